"""Jobs of several ranks that end with drains unfinished: one that exits without
``drain()`` while its drainers are inside a collective drain (each process exits
cleanly, status 0, no "terminate called" abort), and one whose rank is killed during
``drain()``; the next job drains what was left. Real processes on gloo: the abort
happened at interpreter exit, which forked ranks of a test do not reach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from cloudckpt.manager import CheckpointManager
from ranks import HOST, free_port

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch, torch.distributed as dist
    import cloudckpt
    import cloudckpt.manager.tiers as tiers

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    bucket, tier, steps, drain = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if drain == "die-in-drain" and rank == 1:  # kill -9 once its files of a step are sent
        real = tiers.copy_tree

        def copy_then_die(*args, **kwargs):
            copied = real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return copied

        tiers.copy_tree = copy_then_die
    m = cloudckpt.CheckpointManager(
        bucket, kind="dcp", local_dir=f"{tier}/rank-{rank}"
    )
    state = {f"w{rank}": torch.full((1 << 21,), float(rank + 1))}  # each rank its own
    for step in range(steps):
        if drain == "no-drain":
            m.async_save(step, {"model": state}).result()
        else:
            m.save(step, {"model": state})  # a synchronous save queues no drain
    if drain != "no-drain":
        m.drain()
    print("END", rank, flush=True)
    """
)


def run_job(tmp_path, bucket, steps, drain, timeout=300):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(r))
        env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(script), str(bucket), str(tmp_path / "tier"), str(steps), drain]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out


def test_ranks_exiting_while_their_drainers_drain_exit_cleanly_and_the_next_job_drains(
    tmp_path,
):
    bucket = tmp_path / "bucket" / "run"
    for code, err in run_job(tmp_path, bucket, 3, "no-drain"):
        assert code == 0, err[-3000:]
        assert "terminate called" not in err, err[-3000:]
    committed = [c.step for c in CheckpointManager(str(bucket)).list()]
    assert committed == list(range(len(committed)))  # in order: a prefix of the steps
    # The next job on the same directories drains what was left.
    for code, err in run_job(tmp_path, bucket, 0, "drain"):
        assert code == 0, err[-3000:]
    assert [c.step for c in CheckpointManager(str(bucket)).list()] == [0, 1, 2]


def test_a_rank_killed_during_drain_leaves_nothing_committed_and_the_next_drain_commits(
    tmp_path,
):
    """Rank 1 is killed (SIGKILL) during ``drain()``, right after it sent its files of
    the first step: rank 0's drain fails (the collective breaks off) and the bucket
    holds no marker of that step, only some files. The next job's ``drain()`` on the
    same directories sends what is missing and commits every step; each restores."""
    import torch

    bucket = tmp_path / "bucket" / "run"
    (code0, err0), (code1, _) = run_job(tmp_path, bucket, 2, "die-in-drain", timeout=200)
    assert code1 == -9
    assert code0 != 0 and "terminate called" not in err0, err0[-3000:]
    assert CheckpointManager(str(bucket)).list() == []  # nothing committed...
    assert any((bucket / "step-000000000").rglob("*.distcp"))  # ...some files sent
    for code, err in run_job(tmp_path, bucket, 0, "drain"):
        assert code == 0, err[-3000:]
    manager = CheckpointManager(str(bucket), kind="dcp")
    assert [c.step for c in manager.list()] == [0, 1]
    for step in (0, 1):
        state = {"model": {f"w{r}": torch.zeros(1 << 21) for r in (0, 1)}}
        manager.restore(step, state=state)  # one process reads the 2 ranks' files
        for r in (0, 1):
            assert torch.equal(state["model"][f"w{r}"], torch.full((1 << 21,), float(r + 1)))
