"""A program that ends right after an ``async_save`` exits cleanly.

The save's thread still runs a moment after its handle is finished (it drops the
snapshot's tensors); an interpreter torn down under it aborted the process about one
run in three ("terminate called without an active exception"). The exit hook joins
it (engine/handle.py). Each run is a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, torch, cloudckpt
state = {"w": torch.randn(1 << 20)}
cloudckpt.async_save(state, sys.argv[1]).result(60)
print("saved")
"""


def test_a_program_ending_after_async_save_exits_cleanly(tmp_path: Path) -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH", "")])),
    }
    for i in range(6):
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / f"a{i}.pt")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        assert (out.returncode, out.stdout.strip()) == (0, "saved"), out.stderr[-2000:]
