"""The command line starts fast: ``--version``, ``--help``, ``ls`` and ``latest`` never
import torch (it alone takes about a second to import); benchmarks/cli_startup.py times
them (docs/benchmarks.md, "CLI start-up")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloudckpt.manager import CheckpointManager

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: Runs ``main(argv)`` in a fresh interpreter, then reports the heavy modules it loaded.
_PROGRAM = """
import sys
from cloudckpt.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "numpy", "cloudckpt.engine.load", "cloudckpt.engine.save")
               if m in sys.modules)
print("loaded:" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run with two committed checkpoints."""
    root = str(tmp_path_factory.mktemp("startup") / "run1")
    manager = CheckpointManager(root)
    for step in (1, 2):
        manager.save(step, {"w": torch.ones(3), "step": step})
    return root


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["ls", "{root}"], ["latest", "{root}"]], ids=str
)
def test_these_commands_never_import_torch(argv: list[str], run_root: str) -> None:
    args = [a.format(root=run_root) for a in argv]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "loaded:", done.stderr
    if argv[0] == "latest":
        assert done.stdout.strip().endswith("step-000000002/")
    if argv[0] == "ls":
        assert "2 checkpoint(s)" in done.stdout


def test_importing_the_command_line_loads_no_torch() -> None:
    code = "import sys, cloudckpt.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
