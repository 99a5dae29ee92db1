"""Two real ranks (gloo, one process each): rank 0 alone talks to storage, both agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from cloudckpt.manager import CheckpointManager
    from faults import FaultyStore

    rank, root, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    m = CheckpointManager(root, keep_last=1)
    m.store = spy = FaultyStore(m.store)  # counts the manager's own storage requests
    for step in (1, 2, 3):
        m.save(step, {"w": torch.full((8,), float(step)), "rank": 0})
    latest = m.latest()
    restored = m.restore()
    dist.barrier()
    with open(out, "w") as f:
        json.dump({"calls": spy.calls, "latest": latest.step, "steps": [c.step for c in m.list()],
                   "restored": restored["w"].tolist()}, f)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        os._exit(0)  # torch 2.4's gloo teardown can hang (see tests/dcp/dcp_workers.py)
    dist.destroy_process_group()
    """
)


def test_rank0_lists_commits_and_prunes_for_everyone(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = tmp_path / "run"
    init = (tmp_path / "rendezvous").as_uri()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(root), init, str(tmp_path / f"out{r}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    r0, r1 = (json.loads((tmp_path / f"out{r}").read_text()) for r in (0, 1))
    assert r0["latest"] == r1["latest"] == 3
    assert r0["steps"] == r1["steps"] == [3]  # keep_last=1 applied once, by rank 0
    assert r0["restored"] == r1["restored"] == [3.0] * 8
    assert r1["calls"] == {}  # rank 1 never listed, read, wrote or deleted anything
    assert r0["calls"]["list"] >= 2 and r0["calls"]["put"] == 3  # one marker per step
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == ["step-000000003/_CHECKPOINT.json", "step-000000003/state.pt"]
