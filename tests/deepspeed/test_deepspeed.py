"""DeepSpeed with ``cloudckpt.deepspeed``: real ``deepspeed.initialize`` engines (ZeRO-2
and ZeRO-3, fp32, torch Adam, gloo) on 2 ranks, each a process of its own, saving to a
moto S3 server: resume to the same losses as an uninterrupted run, a ``kill -9`` of a
rank mid-save, a fetched step read by DeepSpeed's own ``zero_to_fp32.py``, and the
errors (nothing committed, another world size, a refused write, a corrupt file)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# tests/ is on sys.path, where this folder reads as a namespace package named
# deepspeed: skip unless the real package imports, and leave no namespace package behind.
try:
    pytest.importorskip("deepspeed.runtime.engine")
except pytest.skip.Exception:
    sys.modules.pop("deepspeed", None)
    raise

import torch

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from docs_examples import docs_examples, run_example
from ranks import HOST, free_port
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("run_ds.py"))
ERRORS = str(Path(__file__).with_name("errors_ds.py"))


def committed(server, url):
    """The steps committed under ``url`` (the manager's listing: markers only)."""
    return [c.step for c in CheckpointManager(url, storage_options=server.storage_options()).list()]


def launch(server, url, world, *extra, report=None, storage_options=None):
    """Start the loop as ``world`` processes (gloo ranks), as torchrun would, with
    ``server``'s storage options (or ``storage_options``)."""
    given = server.storage_options() if storage_options is None else storage_options
    cmd = [sys.executable, SCRIPT, url, json.dumps(given), *extra]
    if report is not None:
        cmd += ["--report", str(report)]
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=HOST,
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        )
    return procs


def finish(procs, timeout=300, code=0):
    """Wait for every process; fail with the stderr of any that did not exit with ``code``."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != code:
            errors.append(f"exit {p.returncode}: " + err.decode()[-4000:])
    assert not errors, "\n---\n".join(errors)


def reports(path, world):
    return [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def base(moto_server, tmp_path_factory):
    """An uninterrupted 12-step run of each stage on 2 ranks (saves at 4, 8, 12)."""
    runs = {}
    tmp = tmp_path_factory.mktemp("ds-base")
    for stage in (2, 3):
        bucket = moto_server.make_bucket(unique_bucket_name(f"ds-base-{stage}"))
        url = f"s3://{bucket}/run"
        local = tmp / f"local-{stage}"
        report = tmp / f"base-{stage}"
        finish(
            launch(moto_server, url, 2, "--stage", str(stage), "--local", str(local), report=report)
        )
        runs[stage] = (url, reports(report, 2), local)
    return runs


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_killed_mid_save_leaves_the_previous_step_and_resumes_the_same(
    moto_server, base, tmp_path, stage
):
    base_url, base_reports, _ = base[stage]
    assert [s for s, _ in base_reports[0]["losses"]] == list(range(1, 13))
    assert committed(moto_server, base_url) == [4, 8, 12]

    bucket = moto_server.make_bucket(unique_bucket_name(f"ds-kill-{stage}"))
    url = f"s3://{bucket}/run"
    procs = launch(moto_server, url, 2, "--stage", str(stage), "--kill-in-save", "8")
    _, err = procs[1].communicate(timeout=300)
    assert procs[1].returncode == -9, err.decode()[-4000:]
    procs[0].kill()  # waiting for rank 1 in a collective
    procs[0].communicate(timeout=60)
    manager = CheckpointManager(url, storage_options=moto_server.storage_options())
    assert [c.step for c in manager.list()] == [4]
    latest = manager.latest()
    assert latest is not None and latest.step == 4 and latest.metadata["tag"] == "global_step4"

    # Fresh processes resume from 4, step by step as the uninterrupted run, and save 8
    # again over the leftovers.
    args = ("--stage", str(stage), "--resume")
    finish(launch(moto_server, url, 2, *args, report=tmp_path / "resumed"))
    resumed = reports(tmp_path / "resumed", 2)
    for r in range(2):
        assert resumed[r]["resumed_from"] == 4
        assert resumed[r]["losses"] == base_reports[r]["losses"][4:]
        # Each rank read its model states and its optimizer partition, each once.
        model = f"zero_pp_rank_{r}_mp_rank_00" if stage == 3 else "mp_rank_00"
        assert resumed[r]["reads"] == {
            f"global_step4/{model}_model_states.pt": 1,
            f"global_step4/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1,
        }
    assert committed(moto_server, url) == [4, 8, 12]


def test_async_saves_commit_and_resume_with_the_same_losses(moto_server, base, tmp_path):
    """ZeRO-2 on 2 ranks, each save returned once staged, written and committed in the
    background: the run's steps are committed and a resume continues as the
    uninterrupted run."""
    _, base_reports, _ = base[2]
    bucket = moto_server.make_bucket(unique_bucket_name("ds-async"))
    url = f"s3://{bucket}/run"
    args = ("--async", "--max-steps", "8")
    finish(launch(moto_server, url, 2, *args, report=tmp_path / "a"))
    assert committed(moto_server, url) == [4, 8]
    first = reports(tmp_path / "a", 2)
    finish(launch(moto_server, url, 2, "--async", "--resume", report=tmp_path / "b"))
    resumed = reports(tmp_path / "b", 2)
    assert committed(moto_server, url) == [4, 8, 12]
    for r in range(2):
        assert resumed[r]["resumed_from"] == 8
        assert first[r]["losses"] + resumed[r]["losses"] == base_reports[r]["losses"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_fetched_step_is_deepspeeds_own_folder(moto_server, base, tmp_path, monkeypatch, stage):
    """The files each rank wrote, ``latest`` and the recovery scripts are committed, the
    command line verifies them, and DeepSpeed's ``zero_to_fp32.py`` run on a copy gives
    the weights it gives for DeepSpeed's own local save of the same step."""
    url, _, local = base[stage]
    info = CheckpointManager(url, storage_options=moto_server.storage_options()).latest()
    assert info is not None and info.step == 12 and info.kind == "deepspeed"
    assert info.metadata["tag"] == "global_step12" and info.metadata["zero_stage"] == stage
    assert info.metadata["dp_world_size"] == 2
    names = {f.name for f in info.files}
    assert names == {
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
        *(n.relative_to(local).as_posix() for n in (local / "global_step12").iterdir()),
    }
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0
    fetched = tmp_path / "fetched"
    assert cli_main(["cp", "-r", info.url, str(fetched)]) == 0
    assert (fetched / "latest").read_text() == "global_step12"
    out = subprocess.run(  # DeepSpeed's own script, from the fetched folder
        [sys.executable, str(fetched / "zero_to_fp32.py"), str(fetched), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (found,) = (tmp_path / "out").iterdir()
    if found.suffix == ".safetensors":
        from safetensors.torch import load_file

        ours = load_file(found)
    else:
        ours = torch.load(found, weights_only=True)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = {"ours": ours, "deepspeed": get_fp32_state_dict_from_zero_checkpoint(str(local))}
    assert (
        weights["ours"].keys()
        == weights["deepspeed"].keys()
        == {
            "0.weight",
            "0.bias",
            "2.weight",
            "2.bias",
        }
    )
    for key, value in weights["deepspeed"].items():
        assert torch.equal(weights["ours"][key], value), key


def test_a_save_killed_before_its_commit_is_not_committed_and_gc_removes_it(
    moto_server, tmp_path, monkeypatch, capsys
):
    """Rank 0 killed with every rank's files of step 8 in the bucket, the marker not:
    ``cloudckpt latest`` says 4, and ``gc`` removes step 8's leftovers."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-torn"))
    url = f"s3://{bucket}/run"
    procs = launch(moto_server, url, 2, "--kill-before-commit", "8")
    _, err = procs[0].communicate(timeout=300)
    assert procs[0].returncode == -9, err.decode()[-4000:]
    procs[1].kill()  # waiting for rank 0's commit
    procs[1].communicate(timeout=60)
    manager = CheckpointManager(url, storage_options=moto_server.storage_options())
    assert [c.step for c in manager.list()] == [4]
    torn = {o.key.rsplit("/", 1)[-1] for o in manager.store.list("run/step-000000008/")}
    assert {"latest", "zero_to_fp32.py", "mp_rank_00_model_states.pt"} <= torn
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["latest", url]) == 0
    assert capsys.readouterr().out.strip().endswith("step-000000004/")
    assert cli_main(["gc", url, "--grace", "0"]) == 0
    assert not list(manager.store.list("run/step-000000008/"))
    assert [c.step for c in manager.list()] == [4]


def test_a_refused_write_fails_every_rank_and_commits_nothing(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("ds-refused"))
    url = f"s3://{bucket}/run"
    procs = launch(moto_server, url, 2, "--fail-write", "1:8", report=tmp_path / "r")
    finish(procs, code=3)
    failed = reports(tmp_path / "r", 2)
    assert failed[1]["error"] == "StorageError"  # the failed rank raises its own error
    assert failed[0]["error"] == "DistributedSaveError"
    assert "rank 1" in failed[0]["message"] and "refused write" in failed[0]["message"]
    assert committed(moto_server, url) == [4]


def test_load_errors_are_typed_and_raised_before_any_read(moto_server, base):
    """Nothing committed, a step or tag not committed, a missing bucket, another world
    size, another ZeRO stage: each a typed error naming what is wrong, never a silent
    ``(None, None)``; the module alone loads on another world size."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-empty"))
    empty, gone = f"s3://{bucket}/run", f"s3://{unique_bucket_name('ds-gone')}/run"
    cmd = [sys.executable, ERRORS, json.dumps(moto_server.storage_options()), empty, gone]
    out = subprocess.run(
        [*cmd, base[2][0], base[3][0]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(ERRORS).parent)},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["empty"][0] == "NotFoundError" and empty in found["empty"][1]
    assert found["empty_ok"] == ["ok", "None"]
    assert found["no_step"][0] == "NotFoundError" and "step 5" in found["no_step"][1]
    assert found["no_tag"][0] == "NotFoundError" and "'nope'" in found["no_tag"][1]
    assert found["gone_load"][0] == "BucketNotFoundError"
    assert found["gone_save"][0] == "BucketNotFoundError"
    for key, stage in (("world2", 2), ("world3", 3)):
        assert found[key][0] == "ConfigError", found[key]
        assert "saved by 2 data-parallel ranks and this job has 1" in found[key][1]
        assert f"ZeRO stage {stage}" in found[key][1]
    assert found["stage"][0] == "ConfigError" and "ZeRO-3" in found["stage"][1]
    assert found["module_only"] == ["ok", "12"]
    assert found["tier_async"][0] == "ConfigError" and "local_dir" in found["tier_async"][1]
    assert found["tier_keep"] == ["ConfigError", "keep_local= needs local_dir="]
    assert found["tier_keep_0"][0] == "ConfigError" and "keep_local=0" in found["tier_keep_0"][1]
    assert found["tier_dir"][0] == "ConfigError" and "local_dir=3" in found["tier_dir"][1]
    assert found["roundtrip0"] == found["roundtrip1"] == ["ok", "True"]


def test_a_corrupt_file_fails_every_rank(moto_server, base, tmp_path):
    """Step 12's optimizer partition of rank 1 rewritten with its bytes changed: rank 1
    raises a checksum error, rank 0 a DistributedLoadError naming it, before DeepSpeed's
    load runs."""
    url, _, _ = base[2]
    bucket = moto_server.make_bucket(unique_bucket_name("ds-corrupt"))
    copy = f"s3://{bucket}/run"
    assert cli_main_quiet(moto_server, ["cp", "-r", url, copy]) == 0
    target = CheckpointManager(copy, storage_options=moto_server.storage_options())
    info = target.latest()
    assert info is not None
    key = (
        f"{target.root_key}/step-000000012/global_step12/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    data = bytearray(target.store.get(key))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # the largest tensor record
        record = max(archive.infolist(), key=lambda i: i.file_size)
    offset = record.header_offset + 26  # the local header's name and extra lengths
    start = offset + 4 + int.from_bytes(data[offset : offset + 2], "little")
    start += int.from_bytes(data[offset + 2 : offset + 4], "little")
    data[start + record.file_size // 2] ^= 0xFF
    target.store.put(key, bytes(data))
    finish(launch(moto_server, copy, 2, "--resume", report=tmp_path / "r"), code=3)
    failed = reports(tmp_path / "r", 2)
    assert failed[1]["error"] in ("ChecksumError", "CorruptCheckpointError"), failed[1]
    assert failed[0]["error"] == "DistributedLoadError" and "rank 1" in failed[0]["message"]


def cli_main_quiet(server, argv):
    env = {**os.environ, **server.env()}
    out = subprocess.run(
        [sys.executable, "-m", "cloudckpt", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    return out.returncode


def test_the_docs_example_runs(moto_server, tmp_path):
    """The DeepSpeed section of docs/integrations.md, as written, on the local server."""
    bucket = run_example(moto_server, docs_examples("DeepSpeed")[0], tmp_path, "ds-docs")
    assert committed(moto_server, f"s3://{bucket}/deepspeed-run") == [8, 12]


def test_the_docs_local_tier_example_runs(moto_server, tmp_path):
    """The DeepSpeed section's local-tier example, as written: both steps drained to the
    bucket, the local tier down to its newest step (``keep_local=1``)."""
    code = docs_examples("DeepSpeed")[1]
    paths = {"/local_nvme/": f"{tmp_path}/"}
    bucket = run_example(moto_server, code, tmp_path, "ds-docs-tier", paths=paths)
    assert committed(moto_server, f"s3://{bucket}/deepspeed-tiered") == [4, 8]
    assert local_tier_steps(tmp_path / "ckpt" / "deepspeed-tiered") == [8]


def test_another_steps_file_of_the_same_size_fails_the_load(moto_server, tmp_path, monkeypatch):
    """Step 4's files copied over step 8's (the same sizes, valid CRC-32s): the marker's
    ETags tell them apart. Rank 1's optimizer partition swapped: rank 1 raises
    CorruptCheckpointError naming the file and step 8, rank 0 DistributedLoadError; the
    model states (read by every rank) swapped: every rank raises CorruptCheckpointError,
    never an engine at global_steps 4 returned as step 8."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-etag"))
    url = f"s3://{bucket}/run"
    finish(launch(moto_server, url, 2, "--max-steps", "8"))
    assert committed(moto_server, url) == [4, 8]
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    for index, (name, failing) in enumerate(
        (("zero_pp_rank_1_mp_rank_00_optim_states.pt", [1]), ("mp_rank_00_model_states.pt", [0, 1]))
    ):
        copy = f"s3://{moto_server.make_bucket(unique_bucket_name(f'ds-etag-{index}'))}/run"
        assert cli_main_quiet(moto_server, ["cp", "-r", url, copy]) == 0
        target = CheckpointManager(copy, storage_options=moto_server.storage_options())
        old = f"{target.root_key}/step-000000004/global_step4/{name}"
        new = f"{target.root_key}/step-000000008/global_step8/{name}"
        data = target.store.get(old)
        assert len(data) == target.store.head(new).size and data != target.store.get(new)
        target.store.put(new, data)
        assert cli_main(["verify", copy]) != 0  # the command line sees it: the ETag differs
        report = tmp_path / f"r{index}"
        finish(launch(moto_server, copy, 2, "--resume-strict", report=report), code=3)
        failed = reports(report, 2)
        for r in range(2):
            if r in failing:
                assert failed[r]["error"] == "CorruptCheckpointError", failed[r]
                assert f"step-000000008/global_step8/{name}" in failed[r]["message"]
                assert "step 8" in failed[r]["message"] and "ETag" in failed[r]["message"]
            else:
                assert failed[r]["error"] == "DistributedLoadError", failed[r]
                assert "rank 1" in failed[r]["message"] and name in failed[r]["message"]


def test_a_zero3_module_load_checks_the_etags_before_its_download(moto_server, base, tmp_path):
    """ZeRO-3 with ``load_optimizer_states=False`` downloads the whole step for DeepSpeed:
    each file's ETag is checked against the marker first. Step 8 loads as it is; with
    step 4's rank-1 optimizer partition copied over step 8's, every rank raises
    CorruptCheckpointError naming the file and step 8."""
    url, _, _ = base[3]
    copy = f"s3://{moto_server.make_bucket(unique_bucket_name('ds-etag-z3'))}/run"
    assert cli_main_quiet(moto_server, ["cp", "-r", url, copy]) == 0
    args = ("--stage", "3", "--load-step", "8", "--max-steps", "8", "--module-only")
    finish(launch(moto_server, copy, 2, *args, report=tmp_path / "ok"))
    assert [r["global_steps"] for r in reports(tmp_path / "ok", 2)] == [8, 8]
    target = CheckpointManager(copy, storage_options=moto_server.storage_options())
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    new = f"{target.root_key}/step-000000008/global_step8/{name}"
    data = target.store.get(f"{target.root_key}/step-000000004/global_step4/{name}")
    assert len(data) == target.store.head(new).size
    target.store.put(new, data)
    finish(launch(moto_server, copy, 2, *args, report=tmp_path / "r"), code=3)
    for failed in reports(tmp_path / "r", 2):
        assert failed["error"] == "CorruptCheckpointError", failed
        assert f"step-000000008/global_step8/{name}" in failed["message"]
        assert "step 8" in failed["message"] and "ETag" in failed["message"]


def test_retention_keeps_the_restored_step_and_the_step_just_saved(moto_server, tmp_path):
    """Steps 2, 4, 6 committed; 2 ranks load step 2 and save 3 and 5 with keep_last=1:
    retention never deletes the restored step 2 nor the step just saved; the abandoned
    branch's newest step 6 stays (the newest committed), its 4 and the new branch's 3
    go as keep_last says."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-retain"))
    url = f"s3://{bucket}/run"
    finish(launch(moto_server, url, 2, "--max-steps", "6", "--save-every", "2"))
    assert committed(moto_server, url) == [2, 4, 6]
    args = ("--load-step", "2", "--max-steps", "5", "--save-at", "3,5", "--keep-last", "1")
    finish(launch(moto_server, url, 2, *args, report=tmp_path / "r"))
    resumed = reports(tmp_path / "r", 2)
    for r in range(2):
        assert resumed[r]["resumed_from"] == 2 and resumed[r]["global_steps"] == 5
    # After 3: {2, 3, 4, 6}, 4 deleted (6 is the newest; 2 restored, 3 just saved). After
    # 5: 3 deleted (5 just saved, 2 restored, 6 the newest).
    assert committed(moto_server, url) == [2, 5, 6]
    manager = CheckpointManager(url, storage_options=moto_server.storage_options())
    latest = manager.latest()
    assert latest is not None and latest.step == 6
    for step in (3, 4):
        assert not list(manager.store.list(f"run/step-{step:09d}/"))


# -- the manager's local tier (local_dir=) ----------------------------------------------


def local_tier_steps(tier):
    """The steps committed in a local tier directory (a marker in their folder)."""
    return sorted(int(p.name[5:]) for p in tier.glob("step-*") if (p / "_CHECKPOINT.json").exists())


def refused(server):
    """``server``'s storage options with its endpoint a port where nothing listens."""
    return {**server.storage_options(), "endpoint_url": f"http://{HOST}:{free_port()}"}


def test_a_local_tier_save_returns_while_the_bucket_refuses_and_drains_later(
    moto_server, tmp_path, monkeypatch, capsys
):
    """One process, ZeRO-2, local_dir= while every connection to the bucket is refused:
    each save returns at local speed, committed on local disk only. A later process with
    the bucket there drains both steps (``cloudckpt ls`` shows them), and a process
    with a fresh local_dir resumes from the bucket alone to the same weights and
    optimizer state."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-tier-away"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    args = ("--max-steps", "8", "--tier", str(tier), "--fast", "--dump", str(tmp_path / "a.pt"))
    away = refused(moto_server)
    finish(launch(moto_server, url, 1, *args, report=tmp_path / "a", storage_options=away))
    (saved,) = reports(tmp_path / "a", 1)
    assert len(saved["save_seconds"]) == 2 and max(saved["save_seconds"]) < 10, saved
    assert local_tier_steps(tier / "rank-0") == [4, 8]
    assert committed(moto_server, url) == []  # the bucket never answered

    finish(launch(moto_server, url, 1, "--tier", str(tier), "--drain-only"))
    assert committed(moto_server, url) == [4, 8]
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["ls", url]) == 0
    listed = capsys.readouterr().out
    assert "2 checkpoint(s)" in listed and "latest step 8" in listed, listed
    assert cli_main(["verify", url]) == 0

    fresh = tmp_path / "fresh"
    args = ("--max-steps", "8", "--resume-strict", "--tier", str(fresh))
    finish(
        launch(moto_server, url, 1, *args, "--dump", str(tmp_path / "c.pt"), report=tmp_path / "c")
    )
    (resumed,) = reports(tmp_path / "c", 1)
    assert resumed["resumed_from"] == 8 and resumed["sources"] == ["s3"], resumed
    before = torch.load(tmp_path / "a.pt.0", weights_only=True)
    after = torch.load(tmp_path / "c.pt.0", weights_only=True)
    assert before.keys() == after.keys() and any(k.startswith("/optimizer") for k in before)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_save_to_their_local_tiers_drain_and_resume_the_same(
    moto_server, base, tmp_path, stage
):
    """ZeRO-2 and ZeRO-3 on 2 ranks, each rank's local_dir a node of its own: each
    directory holds the DeepSpeed folder but the other rank's own files (rank 0's
    scripts, ``latest`` and, ZeRO-2, model states copied to rank 1's), the drains
    commit the steps in the bucket, and a resume from the local tiers and one from the
    bucket alone continue as the uninterrupted run."""
    _, base_reports, base_local = base[stage]
    bucket = moto_server.make_bucket(unique_bucket_name(f"ds-tier-ranks-{stage}"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    args = ("--stage", str(stage), "--max-steps", "8", "--tier", str(tier), "--drain")
    finish(launch(moto_server, url, 2, *args))
    assert committed(moto_server, url) == [4, 8]
    expected = {
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
        *(n.relative_to(base_local).as_posix() for n in (base_local / "global_step12").iterdir()),
    }
    expected = {n.replace("global_step12", "global_step8") for n in expected}
    for r in range(2):
        assert local_tier_steps(tier / f"rank-{r}") == [4, 8]
        folder = tier / f"rank-{r}" / "step-000000008"
        held = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        theirs = {n for n in expected if f"zero_pp_rank_{1 - r}_" in n}
        assert held == (expected - theirs) | {"_CHECKPOINT.json"}, held
    info = CheckpointManager(url, storage_options=moto_server.storage_options()).info(8)
    assert {f.name for f in info.files} == expected

    args = ("--stage", str(stage), "--resume", "--tier", str(tier), "--drain")
    finish(launch(moto_server, url, 2, *args, report=tmp_path / "local"))
    assert committed(moto_server, url) == [4, 8, 12]
    fresh = str(tmp_path / "fresh")
    args = ("--stage", str(stage), "--load-step", "8", "--save-at", "10", "--tier", fresh)
    finish(launch(moto_server, url, 2, *args, "--drain", report=tmp_path / "bucket"))
    for name, source in (("local", "file"), ("bucket", "s3")):
        resumed = reports(tmp_path / name, 2)
        for r in range(2):
            assert resumed[r]["resumed_from"] == 8 and resumed[r]["sources"] == [source]
            assert resumed[r]["losses"] == base_reports[r]["losses"][8:]
    assert committed(moto_server, url) == [4, 8, 10, 12]


def test_a_local_tier_save_killed_before_its_drain_is_drained_by_the_next_process(
    moto_server, tmp_path, monkeypatch, capsys
):
    """One process: step 4 drained, then ``kill -9`` once step 8 is committed locally
    and before its drain: the bucket's newest step is 4 (``cloudckpt latest``). The
    next process on the same local_dir resumes from the local step 8 to the losses of
    an uninterrupted run and drains it."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-tier-kill"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    whole = f"s3://{moto_server.make_bucket(unique_bucket_name('ds-tier-whole'))}/run"
    finish(
        launch(
            moto_server, whole, 1, "--tier", str(tmp_path / "w"), "--drain", report=tmp_path / "w"
        )
    )
    (uninterrupted,) = reports(tmp_path / "w", 1)
    assert committed(moto_server, whole) == [4, 8, 12]

    args = ("--tier", str(tier), "--kill-after-local", "8")
    (proc,) = launch(moto_server, url, 1, *args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -9, err.decode()[-4000:]
    assert committed(moto_server, url) == [4]
    assert local_tier_steps(tier / "rank-0") == [4, 8]
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["latest", url]) == 0
    assert capsys.readouterr().out.strip().endswith("step-000000004/")

    finish(
        launch(
            moto_server, url, 1, "--tier", str(tier), "--resume", "--drain", report=tmp_path / "r"
        )
    )
    (resumed,) = reports(tmp_path / "r", 1)
    assert resumed["resumed_from"] == 8 and resumed["sources"] == ["file"], resumed
    assert resumed["losses"] == uninterrupted["losses"][8:]
    assert committed(moto_server, url) == [4, 8, 12]


def test_a_resave_on_one_rank_commits_none_of_a_killed_two_rank_saves_files(moto_server, tmp_path):
    """ZeRO-2 on 2 ranks sharing one local_dir, ``kill -9`` once DeepSpeed wrote every
    file of step 8 and before its local marker; the job restarts on 1 rank and saves
    step 8 again: neither marker of step 8 lists the killed save's rank-1 files (the
    save first removes what the killed one left in its folder)."""
    bucket = moto_server.make_bucket(unique_bucket_name("ds-tier-leftover"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    args = ("--save-at", "8", "--max-steps", "8", "--tier", str(tier), "--shared-tier")
    procs = launch(moto_server, url, 2, *args, "--kill-before-local", "8")
    procs[0].wait(timeout=300)
    assert procs[0].returncode == -9
    procs[1].kill()  # waiting for rank 0's local commit
    procs[1].wait(timeout=60)
    folder = tier / "step-000000008"
    theirs = "global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert (folder / theirs).exists() and not (folder / "_CHECKPOINT.json").exists()

    finish(launch(moto_server, url, 1, *args, "--drain"))
    local = json.loads((folder / "_CHECKPOINT.json").read_text())
    local_files = {f["name"] for f in local["files"]}
    assert "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt" in local_files
    assert theirs not in local_files and not (folder / theirs).exists()
    info = CheckpointManager(url, storage_options=moto_server.storage_options()).info(8)
    assert {f.name for f in info.files} == local_files
