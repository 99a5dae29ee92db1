"""Accelerate with ``cloudckpt.accelerate``: real ``Accelerator(cpu=True)`` loops on a moto
S3 server, one process and two gloo ranks, runs killed by ``kill -9`` after a commit and
resumed in fresh processes, and a save killed before its commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# tests/ is on sys.path, where this folder reads as a namespace package named
# accelerate: skip unless the real package's accelerator module imports, and leave no
# namespace package behind.
try:
    pytest.importorskip("accelerate.accelerator")
except pytest.skip.Exception:
    sys.modules.pop("accelerate", None)
    raise

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from cloudckpt.errors import ConfigError
from docs_examples import docs_examples, run_example
from ranks import HOST, free_port
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("run_accel.py"))


def committed(server, url):
    """The steps committed under ``url`` (the manager's listing: markers only)."""
    return [c.step for c in CheckpointManager(url, storage_options=server.storage_options()).list()]


def launch(server, url, world, *extra, report=None, storage_options=None):
    """Start the loop as ``world`` processes (gloo ranks when more than one); the
    bucket's ``storage_options`` default to ``server``'s."""
    options = server.storage_options() if storage_options is None else storage_options
    cmd = [sys.executable, SCRIPT, url, json.dumps(options), *extra]
    if report is not None:
        cmd += ["--report", str(report)]
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ)
        if world > 1:
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


def finish(procs, timeout=600):
    """Wait for every process; fail with the stderr of any that failed."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append(err.decode()[-4000:])
    assert not errors, "\n---\n".join(errors)


def kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL
    for p in procs:
        p.communicate(timeout=60)


def reports(path, world):
    return [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]


def wait_for_commit(server, url, step, procs):
    """Poll the bucket until ``step`` is committed (every process still alive)."""
    deadline = time.monotonic() + 300
    while step not in committed(server, url):
        for p in procs:
            assert p.poll() is None, p.stderr.read().decode()[-4000:] if p.stderr else ""
        assert time.monotonic() < deadline, f"step {step} was never committed"
        time.sleep(0.2)


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_killed_after_a_commit_resumes_with_the_same_losses(moto_server, tmp_path, world):
    bucket = moto_server.make_bucket(unique_bucket_name(f"accel-kill-{world}"))
    base_url, url = f"s3://{bucket}/base", f"s3://{bucket}/run"
    finish(launch(moto_server, base_url, world, report=tmp_path / "base"))
    base = reports(tmp_path / "base", world)
    assert [s for s, _ in base[0]["losses"]] == list(range(1, 13))
    assert committed(moto_server, base_url) == [4, 8, 12]

    procs = launch(moto_server, url, world, "--block-at", "10")
    try:
        wait_for_commit(moto_server, url, 8, procs)
    finally:
        kill(procs)
    assert committed(moto_server, url) == [4, 8]

    finish(launch(moto_server, url, world, "--resume", report=tmp_path / "resumed"))
    resumed = reports(tmp_path / "resumed", world)
    for r in range(world):
        assert resumed[r]["resumed_from"] == 8
        assert resumed[r]["losses"] == base[r]["losses"][8:]
    assert committed(moto_server, url) == [4, 8, 12]


def test_every_ranks_rng_file_is_committed(moto_server, tmp_path, monkeypatch, capsys):
    bucket = moto_server.make_bucket(unique_bucket_name("accel-files"))
    url = f"s3://{bucket}/run"
    finish(launch(moto_server, url, 2, "--max-steps", "4"))
    manager = CheckpointManager(url, storage_options=moto_server.storage_options())
    info = manager.latest()
    assert info is not None and info.step == 4 and info.kind == "accelerate"
    names = {f.name for f in info.files}
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= names
    assert any(n.startswith("optimizer") for n in names)
    assert any(n.startswith("scheduler") for n in names)
    assert info.metadata["world_size"] == 2
    # Each file was uploaded once; the command line reads the run, checked file by file.
    assert len(names) == len(info.files)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0
    assert cli_main(["ls", url]) == 0
    assert "accelerate" in capsys.readouterr().out


def test_a_save_killed_before_its_commit_is_not_committed(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("accel-torn"))
    url = f"s3://{bucket}/run"
    procs = launch(moto_server, url, 1, "--kill-before-commit", "8")
    for p in procs:
        p.communicate(timeout=600)
        assert p.returncode == -9
    assert committed(moto_server, url) == [4]
    manager = CheckpointManager(url, storage_options=moto_server.storage_options())
    latest = manager.latest()
    assert latest is not None and latest.step == 4
    # The payload of step 8 is there, its marker is not.
    assert any("step-000000008/" in o.key for o in manager.store.list(""))

    # A fresh process resumes from 4 and saves step 8 again over the leftovers.
    finish(launch(moto_server, url, 1, "--resume", "--max-steps", "8", report=tmp_path / "r"))
    assert reports(tmp_path / "r", 1)[0]["resumed_from"] == 4
    assert committed(moto_server, url) == [4, 8]


@pytest.mark.parametrize("world", [1, 2])
def test_async_saves_commit_and_resume_with_the_same_losses(moto_server, tmp_path, world):
    bucket = moto_server.make_bucket(unique_bucket_name(f"accel-async-{world}"))
    base_url, url = f"s3://{bucket}/base", f"s3://{bucket}/run"
    finish(launch(moto_server, base_url, world, report=tmp_path / "base"))
    base = reports(tmp_path / "base", world)
    finish(launch(moto_server, url, world, "--async", "--max-steps", "8", report=tmp_path / "a"))
    assert committed(moto_server, url) == [4, 8]
    first = reports(tmp_path / "a", world)
    finish(launch(moto_server, url, world, "--resume", "--async", report=tmp_path / "b"))
    resumed = reports(tmp_path / "b", world)
    assert committed(moto_server, url) == [4, 8, 12]
    for r in range(world):
        assert resumed[r]["resumed_from"] == 8
        assert first[r]["losses"] + resumed[r]["losses"] == base[r]["losses"]


def test_nothing_committed_is_none_and_automatic_naming_is_refused(moto_server, tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from cloudckpt.accelerate import load_state, save_state

    bucket = moto_server.make_bucket(unique_bucket_name("accel-empty"))
    url = f"s3://{bucket}/run"
    accelerator = Accelerator(cpu=True)
    assert load_state(accelerator, url, storage_options=moto_server.storage_options()) is None
    accelerator.project_configuration = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True
    )
    with pytest.raises(ConfigError, match="automatic_checkpoint_naming"):
        save_state(accelerator, url, storage_options=moto_server.storage_options())


def test_the_docs_example_runs(moto_server, tmp_path):
    """The Accelerate section of docs/integrations.md, as written, on the local server."""
    bucket = run_example(moto_server, docs_examples("Accelerate")[0], tmp_path, "accel-docs")
    assert committed(moto_server, f"s3://{bucket}/accelerate-run") == [8, 12]


def test_a_ranks_failed_upload_fails_every_rank_and_commits_nothing(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("accel-fail"))
    url = f"s3://{bucket}/run"
    procs = launch(moto_server, url, 2, "--fail-upload", "1:8", report=tmp_path / "r")
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 3, err.decode()[-4000:]
    failed = reports(tmp_path / "r", 2)
    assert failed[1]["error"] == "StorageError"  # the failed rank raises its own error
    assert failed[0]["error"] == "DistributedSaveError"
    assert "rank 1" in failed[0]["message"] and "refused upload" in failed[0]["message"]
    assert committed(moto_server, url) == [4]


def test_another_steps_file_copied_over_is_refused_naming_it(moto_server, tmp_path):
    """Step 2's ``model.safetensors`` copied over step 4's (the same size): load_state
    checks each file against the marker's ETag before the download and names the
    bucket's object; nothing is loaded."""
    import torch
    from accelerate import Accelerator

    from cloudckpt.accelerate import load_state, save_state
    from cloudckpt.errors import CorruptCheckpointError

    bucket = moto_server.make_bucket(unique_bucket_name("accel-swap"))
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    for step in (2, 4):
        with torch.no_grad():
            model.weight.fill_(float(step))
        save_state(accelerator, url, step=step, storage_options=options)
    m = CheckpointManager(url, storage_options=options)
    m.store.put(
        "run/step-000000004/model.safetensors", m.store.get("run/step-000000002/model.safetensors")
    )
    with pytest.raises(CorruptCheckpointError, match=r"step-000000004/model\.safetensors changed"):
        load_state(accelerator, url, storage_options=options)
    assert torch.equal(model.weight, torch.full((4, 4), 4.0))  # nothing loaded


# -- the manager's local tier (local_dir=) ----------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(moto_server, tmp_path_factory):
    """The losses of each rank of a run saving to the bucket alone, steps 1 to 12, per
    world size (made once, at the first test asking for it)."""
    made: dict[int, list] = {}

    def losses(world):
        if world not in made:
            path = tmp_path_factory.mktemp(f"whole-{world}") / "whole"
            bucket = moto_server.make_bucket(unique_bucket_name(f"accel-whole-{world}"))
            finish(launch(moto_server, f"s3://{bucket}/run", world, report=path))
            made[world] = [r["losses"] for r in reports(path, world)]
            assert [s for s, _ in made[world][0]] == list(range(1, 13))
        return made[world]

    return losses


def local_tier_steps(tier):
    """The steps committed in a local tier directory (a marker in their folder)."""
    return sorted(int(p.name[5:]) for p in tier.glob("step-*") if (p / "_CHECKPOINT.json").exists())


def held(tier, step):
    """The files of ``step``'s folder in a local tier directory, marker included."""
    folder = tier / f"step-{step:09d}"
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("world", [1, 2])
def test_local_tier_saves_go_on_while_the_bucket_refuses_and_drain_once_it_is_back(
    moto_server, uninterrupted, tmp_path, monkeypatch, world
):
    """local_dir= while every connection to the bucket is refused: each save returns
    committed in each rank's local tier, nothing in the bucket. Once the bucket answers
    again (a proxy to it on that port), drain() commits both steps there, with the
    layout and marker of a save without local_dir (cloudckpt verify reads it); a run with
    a new, empty local_dir resumes from the bucket alone with the same losses."""
    from cloudckpt.testing.fault_proxy import FaultProxy

    base = uninterrupted(world)
    bucket = moto_server.make_bucket(unique_bucket_name(f"accel-tier-away-{world}"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    port = free_port()
    away = {**moto_server.storage_options(), "endpoint_url": f"http://{HOST}:{port}"}
    args = ("--max-steps", "8", "--local-dir", str(tier), "--fast")
    away_run = launch(
        moto_server, url, world, *args, "--drain", report=tmp_path / "a", storage_options=away
    )
    finish(away_run)
    saved = reports(tmp_path / "a", world)
    for r in range(world):
        assert saved[r]["losses"] == base[r][:8]
        assert saved[r]["drain_error"] is not None  # drain() says the steps wait
        assert local_tier_steps(tier / f"rank-{r}") == [4, 8]
        files = held(tier / f"rank-{r}", 8)
        assert "model.safetensors" in files and f"random_states_{r}.pkl" in files
        assert f"random_states_{1 - r}.pkl" not in files  # each rank's own RNG states only
        assert any(n.startswith("optimizer") for n in files)
    if world == 2:  # rank 1's directory got what the main process alone wrote
        assert held(tier / "rank-1", 8) - {"random_states_1.pkl"} == held(tier / "rank-0", 8) - {
            "random_states_0.pkl"
        }
    assert committed(moto_server, url) == []  # the bucket never answered

    with FaultProxy(moto_server.endpoint_url, port=port):
        finish(launch(moto_server, url, world, *args, "--drain-only", storage_options=away))
    assert committed(moto_server, url) == [4, 8]
    info = CheckpointManager(url, storage_options=moto_server.storage_options()).info(8)
    assert info.kind == "accelerate" and info.metadata["world_size"] == world
    names = {f.name for f in info.files}
    assert names == held(tier / "rank-0", 8) - {"_CHECKPOINT.json"} | {
        f"random_states_{r}.pkl" for r in range(world)
    }
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0

    fresh = ("--resume", "--local-dir", str(tmp_path / "fresh"), "--drain")
    finish(launch(moto_server, url, world, *fresh, report=tmp_path / "b"))
    resumed = reports(tmp_path / "b", world)
    for r in range(world):
        assert resumed[r]["resumed_from"] == 8 and resumed[r]["sources"] == ["s3"], resumed[r]
        assert resumed[r]["losses"] == base[r][8:] and resumed[r]["drain_error"] is None
    assert committed(moto_server, url) == [4, 8, 12]


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_killed_after_a_local_commit_resumes_from_its_local_tier(
    moto_server, uninterrupted, tmp_path, world
):
    """``kill -9`` once step 8 is committed in every rank's local tier and before its
    drain (step 4 drained): the bucket's newest step is 4. The next run on the same
    local_dirs resumes from the local step 8, reading nothing of it from the bucket,
    with the losses of an uninterrupted run, and drains it."""
    base = uninterrupted(world)
    bucket = moto_server.make_bucket(unique_bucket_name(f"accel-tier-kill-{world}"))
    url, tier = f"s3://{bucket}/run", tmp_path / "tier"
    procs = launch(moto_server, url, world, "--local-dir", str(tier), "--kill-after-local", "8")
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == -9, err.decode()[-4000:]
    assert committed(moto_server, url) == [4]
    for r in range(world):
        assert local_tier_steps(tier / f"rank-{r}") == [4, 8]

    args = ("--resume", "--local-dir", str(tier), "--drain")
    finish(launch(moto_server, url, world, *args, report=tmp_path / "r"))
    resumed = reports(tmp_path / "r", world)
    for r in range(world):
        assert resumed[r]["resumed_from"] == 8 and resumed[r]["sources"] == ["file"], resumed[r]
        assert resumed[r]["losses"] == base[r][8:] and resumed[r]["drain_error"] is None
    assert committed(moto_server, url) == [4, 8, 12]


def test_local_dir_refuses_async_save_and_keep_local_needs_it(moto_server, tmp_path):
    from accelerate import Accelerator

    from cloudckpt.accelerate import save_state

    bucket = moto_server.make_bucket(unique_bucket_name("accel-tier-config"))
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigError, match="async_save=True does not take local_dir="):
        save_state(
            accelerator,
            url,
            step=1,
            async_save=True,
            local_dir=tmp_path / "tier",
            storage_options=options,
        )
    with pytest.raises(ConfigError, match="keep_local= needs local_dir="):
        save_state(accelerator, url, step=1, keep_local=2, storage_options=options)
    assert committed(moto_server, url) == []
    assert not (tmp_path / "tier").exists()  # refused before the tier's directory is made
