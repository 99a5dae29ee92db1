"""A job of several ranks that ends without ``drain()`` while its drainers are inside a
collective drain: each process exits cleanly (status 0, no "terminate called" abort),
says at WARNING which steps are left, and the next job drains them. Real processes on
gloo: the abort happened at interpreter exit, which forked ranks of a test do not
reach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from cloudckpt.manager import CheckpointManager
from ranks import HOST, free_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import cloudckpt

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    bucket, tier, steps, drain = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    m = cloudckpt.CheckpointManager(
        bucket, kind="dcp", local_dir=f"{tier}/rank-{rank}"
    )
    state = {"w": torch.full((1 << 21,), float(rank))}
    for step in range(steps):
        m.async_save(step, {"model": state}).result()
    if drain == "drain":
        m.drain()
    print("END", rank, flush=True)
    """
)


def run_job(tmp_path, bucket, steps, drain):
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
        _, err = p.communicate(timeout=300)
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
