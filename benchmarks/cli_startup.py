"""How long ``cloudckpt --version``, ``--help``, ``ls`` and ``latest`` take, start to exit.

Each command runs as a fresh ``python -m cloudckpt`` process (what a user waits for:
the interpreter, the imports, the command) ``--runs`` times; the median is printed,
with whether torch was imported (it never should be for these). ``ls`` and ``latest``
read a small run with two committed checkpoints in a temporary directory. Run from the
repository root::

    .venv/bin/python -m benchmarks.cli_startup            # median of 5 runs each
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The target on the development machine (docs/benchmarks.md, "CLI start-up").
TARGET_S = 0.5

#: Runs the command line in-process after recording whether torch was loaded at exit.
_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('torch-imported=%s\\n' % ('torch' in sys.modules)))\n"
    "from cloudckpt.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def make_run(root: Path) -> str:
    """A run with two committed checkpoints (steps 1 and 2) under ``root``; its path."""
    import torch

    from cloudckpt.manager import CheckpointManager

    run = root / "run1"
    manager = CheckpointManager(str(run))
    for step in (1, 2):
        manager.save(step, {"w": torch.ones(4), "step": step})
    return str(run)


def time_command(args: list[str], runs: int) -> tuple[float, bool]:
    """Median wall seconds of ``runs`` fresh processes running ``cloudckpt ARGS``, and
    whether any of them imported torch."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    times = []
    torch_seen = False
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"cloudckpt {' '.join(args)} exited {done.returncode}: {done.stderr}")
        torch_seen = torch_seen or "torch-imported=True" in done.stderr
    return statistics.median(times), torch_seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per command (5)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp))
        commands = {
            "--version": ["--version"],
            "--help": ["--help"],
            "ls": ["ls", run],
            "latest": ["latest", run],
        }
        python = statistics.median(_time([sys.executable, "-c", "pass"]) for _ in range(args.runs))
        print(f"cloudckpt start-up, median of {args.runs} runs (python -c pass: {python:.3f} s)")
        print(f"| command | seconds | torch imported | under {TARGET_S} s |")
        print("|---|---:|---|---|")
        worst = 0.0
        for name, command in commands.items():
            seconds, torch_seen = time_command(command, args.runs)
            worst = max(worst, seconds)
            ok = "yes" if seconds < TARGET_S else "no"
            print(
                f"| `cloudckpt {name}` | {seconds:.3f} | {'yes' if torch_seen else 'no'} | {ok} |"
            )
    return 0 if worst < TARGET_S else 1


def _time(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, timeout=60)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
