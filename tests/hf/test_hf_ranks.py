"""The Hugging Face Trainer with ``cloudckpt.hf`` on several processes: real Trainers
under DDP on 2 gloo processes against a moto S3 server, a worker killed by ``kill -9``
mid-save and the run resumed to the same losses, a rank's failed upload failing every
rank, and the multi-process docs example run under torchrun as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from cloudckpt.errors import ConfigError
from cloudckpt.hf import CloudCheckpointCallback, fetch_latest, file_owners
from docs_examples import docs_examples
from ranks import HOST, free_port
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("run_train.py"))


def committed(server, url):
    """The steps committed under ``url`` (the manager's listing: markers only)."""
    return [c.step for c in CheckpointManager(url, storage_options=server.storage_options()).list()]


def launch(server, url, output_dir, max_steps, *extra, report=None, world=2):
    """run_train.py as ``world`` DDP processes (the variables torchrun sets), one node:
    every rank's ``output_dir`` is the same folder."""
    cmd = [sys.executable, SCRIPT, url, str(output_dir), json.dumps(server.storage_options())]
    cmd += ["--max-steps", str(max_steps), *extra]
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


def finish(procs, timeout=600):
    """Wait for every process; the return codes and the stderr tails."""
    codes, errors = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        codes.append(p.returncode)
        errors.append(err.decode()[-4000:])
    return codes, "\n---\n".join(errors)


def succeed(procs):
    codes, errors = finish(procs)
    assert codes == [0] * len(procs), errors


def only_tier(output_dir):
    """The one local tier the callback made under ``output_dir`` (a folder per run URL)."""
    (tier,) = (output_dir / "_cloudckpt-tier").iterdir()
    return tier


def reports(path, world=2):
    return [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]


def test_a_worker_killed_mid_save_leaves_the_previous_checkpoint_and_resumes(
    moto_server, tmp_path, monkeypatch, capsys
):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-ddp-kill"))
    base_url, url = f"s3://{bucket}/base", f"s3://{bucket}/run"
    base_run = launch(moto_server, base_url, tmp_path / "base", 12, report=tmp_path / "a")
    # Rank 1 uploads its files of step 8 (rng_state_1.pth), then is killed (SIGKILL)
    # before the ranks settle: rank 0 has nothing to commit step 8 with.
    # Each rank a node of its own (its own output_dir and local tier), so rank 1 sends
    # its own files.
    killed = launch(
        moto_server, url, tmp_path / "killed", 12, "--kill-in-upload", "1:8", "--output-per-rank"
    )
    codes, errors = finish(killed[1:])
    assert codes == [-9], errors
    # Rank 0's collectives fail when the dead peer's connection drops; torchrun would
    # end it then: so does this test, if it is still there a minute later.
    codes, errors = finish(killed[:1], timeout=60)
    assert codes[0] != 0, errors
    succeed(base_run)
    base = reports(tmp_path / "a")
    assert [step for step, _ in base[0]["losses"]] == list(range(1, 13))
    assert base[0]["losses"] == base[1]["losses"]  # the Trainer logs the mean over ranks
    assert committed(moto_server, base_url) == [8, 12]

    assert committed(moto_server, url) == [4]  # step 8 is not committed...
    store = CheckpointManager(url, storage_options=moto_server.storage_options()).store
    names = {o.key.rpartition("/")[2] for o in store.list("run/step-000000008/")}
    assert "rng_state_1.pth" in names and "_CHECKPOINT.json" not in names  # ...its bytes are

    # Resumed as if each rank were a node of its own: each fetches into its own
    # output_dir, and uploads what it wrote (rank 1: its rng_state_1.pth alone).
    resumed = launch(
        moto_server,
        url,
        tmp_path / "resumed",
        12,
        "--resume",
        "--output-per-rank",
        report=tmp_path / "b",
    )
    succeed(resumed)
    for r, report in enumerate(reports(tmp_path / "b")):
        assert report["resumed_from"] == str(tmp_path / "resumed" / f"rank-{r}" / "checkpoint-4")
        assert report["losses"] == base[r]["losses"], r  # step by step
    assert sorted(
        p.name for p in (tmp_path / "resumed" / "rank-1" / "checkpoint-12").iterdir()
    ) == ["rng_state_1.pth"]
    assert committed(moto_server, url) == [8, 12]  # save_total_limit=2 in the bucket too

    info = CheckpointManager(url, storage_options=moto_server.storage_options()).latest()
    assert info is not None and info.kind == "hf-trainer"
    assert info.metadata == {"folder": "checkpoint-12", "world_size": 2}
    names = {f.name for f in info.files}
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= names
    assert "trainer_state.json" in names
    assert len(names) == len(info.files)  # each file uploaded once
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0
    assert cli_main(["ls", url]) == 0
    assert "hf-trainer" in capsys.readouterr().out


def test_a_ranks_failed_upload_fails_every_rank_naming_it(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-ddp-fail"))
    url = f"s3://{bucket}/run"
    procs = launch(
        moto_server,
        url,
        tmp_path / "out",
        8,
        "--fail-upload",
        "1:4",
        "--output-per-rank",
        report=tmp_path / "r",
    )
    codes, errors = finish(procs)
    assert codes == [3, 3], errors
    failed = reports(tmp_path / "r")
    # Every rank's train() raises the step's failure (the drain at the end, tried again
    # there): rank 1 its own error, rank 0 a CollectiveError naming rank 1, its error
    # and the step.
    assert failed[1]["error"] == "StorageError" and "refused upload" in failed[1]["message"]
    assert failed[0]["error"] == "CollectiveError"
    assert "rank 1" in failed[0]["message"] and "refused upload" in failed[0]["message"]
    assert "drain of step 4" in failed[0]["message"]
    # Step 4 was tried again (at the end) and never committed in the bucket; step 8 was.
    assert committed(moto_server, url) == [8]
    # Step 4 stays committed in each rank's local tier, whole there, for a later drain.
    for r, mine in ((0, "rng_state_0.pth"), (1, "rng_state_1.pth")):
        tier = only_tier(tmp_path / "out" / f"rank-{r}") / "step-000000004"
        assert (tier / "_CHECKPOINT.json").is_file() and (tier / mine).is_file()
        assert (tier / "optimizer.pt").is_file()  # the main process's files: every node's


def test_the_multi_process_docs_example_runs_under_torchrun(moto_server, tmp_path):
    """The second example of the Hugging Face section, as written, under torchrun."""
    bucket = moto_server.make_bucket(unique_bucket_name("hf-ddp-docs"))
    code = docs_examples("Hugging Face Trainer")[1]
    script = tmp_path / "train.py"
    script.write_text(code.replace("s3://ckpt/", f"s3://{bucket}/"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = subprocess.run(
        [*cmd, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **moto_server.env()},
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    assert committed(moto_server, f"s3://{bucket}/hf-ddp-run") == [8, 12]


def test_each_file_is_uploaded_by_the_rank_that_wrote_it():
    shared = ["model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"]
    assert file_owners([shared, shared]) == {
        "model.safetensors": 0,
        "optimizer.pt": 0,
        "rng_state_0.pth": 0,
        "rng_state_1.pth": 1,
    }
    # DeepSpeed's ZeRO files and DCP's (FSDP) data files name their rank.
    zero = [
        "global_step8/mp_rank_00_model_states.pt",
        "global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "pytorch_model_fsdp_0/__1_0.distcp",
        "pytorch_model_fsdp_0/.metadata",
        "latest",
    ]
    owners = file_owners([zero, zero])
    assert [owners[n] for n in zero] == [0, 1, 1, 1, 0, 0]
    # One folder per node: each rank sees its own files (and names no one else's).
    assert file_owners([["model.safetensors", "rng_state_0.pth"], ["rng_state_1.pth"]]) == {
        "model.safetensors": 0,
        "rng_state_0.pth": 0,
        "rng_state_1.pth": 1,
    }
    # A name naming a rank that does not see it: the lowest rank that does.
    assert file_owners([["x/rng_state_1.pth"], []]) == {"x/rng_state_1.pth": 0}
    assert file_owners([[], ["rng_state_7.pth"]]) == {"rng_state_7.pth": 1}


def test_several_processes_need_the_process_group(tmp_path, monkeypatch):
    callback = CloudCheckpointCallback(str(tmp_path / "bucket"))
    args = SimpleNamespace(world_size=2, output_dir=str(tmp_path), save_total_limit=None)
    state = SimpleNamespace(best_model_checkpoint=None)
    with pytest.raises(ConfigError, match=r"2 processes.*torchrun"):
        callback.on_train_begin(args, state, None)
    # fetch_latest before the Trainer started the group would race the other processes.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE.*create the Trainer first"):
        fetch_latest(str(tmp_path / "bucket"), tmp_path / "out")


def _trainer_counting_one_process(rank, world, root, results):  # run_ranks: a gloo rank
    """The Trainer counts 1 process (args.world_size) inside a group of 2 ranks, as under
    accelerate's DeepSpeed path on a host without a GPU: refused before any save."""
    callback = CloudCheckpointCallback(str(root / "bucket"))
    args = SimpleNamespace(world_size=1, output_dir=str(root / "out"), save_total_limit=None)
    with pytest.raises(ConfigError, match=r"holds 2 ranks and the Trainer counts 1 process"):
        callback.on_train_begin(args, SimpleNamespace(best_model_checkpoint=None), None)
    results.put(rank)


def test_a_trainer_counting_one_process_in_a_group_of_several_is_refused(tmp_path):
    import multiprocessing

    from ranks import run_ranks

    results = multiprocessing.get_context("fork").SimpleQueue()
    run_ranks(_trainer_counting_one_process, 2, tmp_path, results, timeout=60)
    assert sorted(results.get() for _ in range(2)) == [0, 1]
    assert not (tmp_path / "out").exists()  # nothing staged


def _two_ranks_save(rank, world, root, results):  # run_ranks: a forked gloo rank
    """The callback's events on 2 ranks without a Trainer: a folder per rank (a node
    each), a step whose folder is missing on rank 1, a drain failing once on rank 1."""
    import cloudckpt.hf as hf
    import cloudckpt.manager.tiers as tiers
    from cloudckpt.errors import DistributedSaveError, NotFoundError, StorageError

    out = root / f"out-{rank}"
    callback = hf.CallbackBase(str(root / "bucket" / "run"))
    args = SimpleNamespace(world_size=world, output_dir=str(out), save_total_limit=None)

    def state(step):
        return SimpleNamespace(best_model_checkpoint=None, global_step=step)

    def write(step, names):
        import torch

        folder = out / f"checkpoint-{step}"
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            if name.endswith((".pth", ".bin")):  # torch archives, as the Trainer's are
                torch.save({"name": name, "step": step}, folder / name)
            else:
                (folder / name).write_bytes(f"{name} {step}".encode())

    callback.on_train_begin(args, state(0), None)
    mine = [f"rng_state_{rank}.pth"] + (["model.safetensors", "sub/a.bin"] if rank == 0 else [])
    write(4, mine)
    callback.on_save(args, state(4), None)

    if rank == 0:
        write(8, mine)  # rank 1 never writes checkpoint-8
    raised = None
    try:
        callback.on_save(args, state(8), None)
    except (DistributedSaveError, NotFoundError) as exc:
        raised = exc
    assert raised is not None
    assert isinstance(raised, NotFoundError if rank == 1 else DistributedSaveError)
    if rank == 0:
        assert "rank 1" in str(raised) and "nothing committed" in str(raised)

    real_copy, tries = tiers.copy_tree, []

    def fail_once(src, src_prefix, dst, dst_prefix, *rest, **kw):
        if rank == 1 and "step-000000012/" in dst_prefix and not tries:
            tries.append(1)
            raise StorageError("refused once")
        return real_copy(src, src_prefix, dst, dst_prefix, *rest, **kw)

    tiers.copy_tree = fail_once
    write(12, mine)
    callback.on_save(args, state(12), None)  # committed in each rank's tier; drains after
    callback.on_train_end(args, state(12), None)  # every rank tries the failed drain again
    assert tries == ([1] if rank == 1 else [])
    # A restart: each rank's checkpoint-12 is there with its own files only (rank 1's:
    # rng_state_1.pth); the fetch keeps them and brings the rest from its tier.
    path = hf.fetch_latest(str(root / "bucket" / "run"), out)
    assert path == str(out / "checkpoint-12")
    fetched = sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file())
    results.put((rank, sorted(hf.drained_steps(callback._tier)), fetched))


def test_two_ranks_commit_once_agree_on_failures_and_retry_together(tmp_path):
    import multiprocessing

    from ranks import run_ranks

    results = multiprocessing.get_context("fork").SimpleQueue()
    run_ranks(_two_ranks_save, 2, tmp_path, results, timeout=120)
    found = sorted(results.get() for _ in range(2))
    assert [(r, drained) for r, drained, _ in found] == [(0, [4, 12]), (1, [4, 12])]
    every = ["model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "sub/a.bin"]
    assert [fetched for _, _, fetched in found] == [every, every]
    manager = CheckpointManager(str(tmp_path / "bucket" / "run"))
    assert [c.step for c in manager.list()] == [4, 12]
    info = manager.info(12)
    assert sorted(f.name for f in info.files) == [
        "model.safetensors",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "sub/a.bin",
    ]
    assert info.metadata == {"folder": "checkpoint-12", "world_size": 2}
    # Each node's tier holds its own rank's files and the main process's.
    tier1 = only_tier(tmp_path / "out-1") / "step-000000012"
    held = sorted(p.relative_to(tier1).as_posix() for p in tier1.rglob("*") if p.is_file())
    assert held == ["_CHECKPOINT.json", "model.safetensors", "rng_state_1.pth", "sub/a.bin"]
    # Step 8, refused on both ranks, is committed nowhere.
    assert not (only_tier(tmp_path / "out-0") / "step-000000008" / "_CHECKPOINT.json").exists()


def _begun(rank, world, root, step):
    """A callback of the run ``root/bucket/run`` on this rank, with an output_dir of its
    own (a node each), after its ``on_train_begin``; the Trainer's arguments and state."""
    import cloudckpt.hf as hf

    out = root / f"out-{rank}"
    callback = hf.CallbackBase(str(root / "bucket" / "run"))
    args = SimpleNamespace(world_size=world, output_dir=str(out), save_total_limit=None)
    state = SimpleNamespace(best_model_checkpoint=None, global_step=step)
    callback.on_train_begin(args, state, None)
    return out, callback, args, state


def _rewritten_before_the_commit(rank, world, root, results):  # run_ranks: a gloo rank
    """Another run's save rewrites rank 0's ``model.safetensors`` (another size) in the
    bucket between the ranks' drains and the commit: the drain fails on both ranks,
    nothing is committed in the bucket, and the step stays committed in each tier."""
    import cloudckpt.hf as hf
    from cloudckpt.errors import CloudCkptError

    out, callback, args, state = _begun(rank, world, root, 4)
    folder = out / "checkpoint-4"
    folder.mkdir(parents=True)
    for name in [f"rng_state_{rank}.pth"] + (["model.safetensors"] if rank == 0 else []):
        (folder / name).write_bytes(f"{name} of this run".encode())
    manager = callback._tier
    real = manager._commit

    def theirs_first(step, *rest, **kw):  # the first rank, just before its commit
        manager.store.put(
            manager._step_prefix(step) + "model.safetensors",
            b"the other run's weights, another size",
        )
        return real(step, *rest, **kw)

    manager._commit = theirs_first
    callback.on_save(args, state, None)
    raised = None
    try:
        callback.wait()
    except CloudCkptError as exc:
        raised = type(exc).__name__
    results.put((rank, raised, sorted(hf.drained_steps(manager))))


def test_a_file_rewritten_before_a_two_rank_commit_fails_it(tmp_path):
    import multiprocessing

    from ranks import run_ranks

    results = multiprocessing.get_context("fork").SimpleQueue()
    run_ranks(_rewritten_before_the_commit, 2, tmp_path, results, timeout=120)
    found = sorted(results.get() for _ in range(2))
    assert [(r, drained) for r, _, drained in found] == [(0, []), (1, [])]
    assert all(raised is not None for _, raised, _ in found), found
    assert CheckpointManager(str(tmp_path / "bucket" / "run")).list() == []
    for r in (0, 1):
        assert (only_tier(tmp_path / f"out-{r}") / "step-000000004" / "_CHECKPOINT.json").is_file()


def _a_fetch_failing_on_one_rank(rank, world, root, results, told, how):  # run_ranks
    """Both ranks fetch step 2 of their tiers; on rank 1 ``how`` fails it: its
    checkpoint-2 is a symbolic link, or its tier's run file is damaged. Rank 1 raises
    its own error, rank 0 DistributedLoadError naming it, at once (rank 1 stays alive
    until rank 0 has answered: a rank waiting on it would hang)."""
    import torch

    import cloudckpt.hf as hf
    from cloudckpt.errors import CloudCkptError

    out, callback, args, state = _begun(rank, world, root, 2)
    folder = out / "checkpoint-2"
    folder.mkdir(parents=True)
    torch.save({"rank": rank}, folder / f"rng_state_{rank}.pth")
    if rank == 0:
        (folder / "model.safetensors").write_bytes(b"weights")
    callback.on_save(args, state, None)
    callback.on_train_end(args, state, None)
    fresh = root / f"fresh-{rank}"
    fresh.mkdir()
    tier = hf.default_tier(out, callback.url)
    if rank == 1 and how == "link":
        (root / "elsewhere").mkdir()
        (fresh / "checkpoint-2").symlink_to(root / "elsewhere")
    if rank == 1 and how == "run-file":
        (tier / "_TIER.json").write_text("not the run file")
    raised = None
    try:
        hf.fetch_latest(str(root / "bucket" / "run"), fresh, tier_dir=tier)
    except CloudCkptError as exc:
        raised = (type(exc).__name__, str(exc))
    if rank == 0:
        told.set()
    else:
        assert told.wait(60), "rank 0 did not answer while rank 1 lived"
    results.put((rank, raised))


@pytest.mark.parametrize(
    ("how", "error"), [("link", "UnsafePathError"), ("run-file", "CorruptCheckpointError")]
)
def test_a_fetch_failing_on_one_rank_is_raised_on_every_rank_without_waiting(tmp_path, how, error):
    import multiprocessing

    from ranks import run_ranks

    ctx = multiprocessing.get_context("fork")
    results, told = ctx.SimpleQueue(), ctx.Event()
    run_ranks(_a_fetch_failing_on_one_rank, 2, tmp_path, results, told, how, timeout=120)
    found = dict(results.get() for _ in range(2))
    assert found[1][0] == error, found
    assert found[0][0] == "DistributedLoadError" and "rank 1" in found[0][1], found
    assert error in found[0][1], found
