"""How long ``cloudckpt --version``, ``--help``, ``ls`` and ``latest`` take, start to exit.

Each command runs as a fresh ``python -m cloudckpt``-style process (what a user waits
for: the interpreter, the imports, the command) ``--runs`` times, in rounds that run
every command and reference once, so all see the same load; the median is kept, with
whether torch was imported (it never should be for these). ``ls`` and ``latest`` read a
small run with two committed checkpoints in a temporary directory. For scale, the same
number of runs of ``python -c pass`` (the interpreter alone), of importing the command
line (``import cloudckpt.cli.main``) and of ``import torch``. Run from the
repository root (``make bench`` runs it, ``benchmarks/run.py``)::

    .venv/bin/python -m benchmarks.cli_startup   # median of 5 runs each
        [--runs 5] [--out benchmarks/studies/results/cli_startup.json]

Writes every run, the medians, the date and the load averages to ``--out``;
:func:`cli_startup_section` renders the "CLI start-up" section of docs/benchmarks.md
from that file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.many_ranks import STUDY_RESULTS, part, read_study

__all__ = ["COMMAND", "RESULTS_NAME", "TARGET_S", "cli_startup_section", "measure", "write"]

#: The target on the development machine: each command under this many seconds.
TARGET_S = 0.5
RESULTS_NAME = "cli_startup.json"
#: How the results file is made (the page says so when it is missing).
COMMAND = ".venv/bin/python -m benchmarks.cli_startup"
FINDINGS = "2026-12-04-cli-start-up-without-torch.md"
SRC = Path(__file__).resolve().parents[1] / "src"

#: Runs the command line in-process after recording whether torch was loaded at exit.
_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('torch-imported=%s\\n' % ('torch' in sys.modules)))\n"
    "from cloudckpt.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
#: The reference processes: the interpreter alone, the command line's import, torch's.
REFERENCES = {
    "python_pass": "pass",
    "import_cli": "import cloudckpt.cli.main",
    "import_torch": "import torch",
}


def make_run(root: Path) -> str:
    """A run with two committed checkpoints (steps 1 and 2) under ``root``; its path."""
    import torch

    from cloudckpt.manager import CheckpointManager

    run = root / "run1"
    manager = CheckpointManager(str(run))
    for step in (1, 2):
        manager.save(step, {"w": torch.ones(4), "step": step})
    return str(run)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC)}


def _timed_process(argv: list[str], what: str) -> tuple[float, str]:
    """Wall seconds of one fresh ``python ARGV`` process, and what it wrote to stderr.
    Raises ``RuntimeError`` naming ``what`` if it fails."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], env=_env(), capture_output=True, text=True, check=False,
        timeout=120,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited {done.returncode}: {done.stderr.strip()}")
    return seconds, done.stderr


def measure(runs: int = 5) -> dict[str, Any]:
    """Time every command and reference ``runs`` times, in rounds (each runs once per
    round, so all see the same load): every run, the medians, whether each command
    imported torch, the date and the load averages before and after."""
    before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp))
        commands = {
            "--version": ["--version"],
            "--help": ["--help"],
            "ls": ["ls", run],
            "latest": ["latest", run],
        }
        ref_times: dict[str, list[float]] = {name: [] for name in REFERENCES}
        times: dict[str, list[float]] = {name: [] for name in commands}
        torch_seen = dict.fromkeys(commands, False)
        for _ in range(runs):
            for name, code in REFERENCES.items():
                ref_times[name].append(_timed_process(["-c", code], f"python -c {code!r}")[0])
            for name, args in commands.items():
                seconds, err = _timed_process(["-c", _PROBE, *args], f"cloudckpt {name}")
                times[name].append(seconds)
                torch_seen[name] = torch_seen[name] or "torch-imported=True" in err
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": runs,
        "cpus": os.cpu_count(),
        "target_s": TARGET_S,
        "load_average": {"before": before, "after": [round(x, 2) for x in os.getloadavg()]},
        "references": {
            name: {"median_s": statistics.median(t), "runs_s": t} for name, t in ref_times.items()
        },
        "commands": {
            name: {
                "median_s": statistics.median(t),
                "runs_s": t,
                "torch_imported": torch_seen[name],
            }
            for name, t in times.items()
        },
    }


def write(results: dict[str, Any], out: Path) -> None:
    """Write ``results`` (from :func:`measure`) to ``out`` as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


def _median(entry: Any) -> float | None:
    value = entry.get("median_s") if isinstance(entry, dict) else None
    return value if isinstance(value, int | float) else None


def _span(entry: dict[str, Any]) -> str:
    runs = [t for t in entry.get("runs_s", []) if isinstance(t, int | float)]
    return f"{min(runs):.3f}-{max(runs):.3f}" if runs else "-"


def cli_startup_section(results: Path = STUDY_RESULTS) -> list[str]:
    """The page's "CLI start-up" section from ``results/cli_startup.json``: each
    command's median, range and whether it imported torch, its verdict against the
    target computed from the file; "No results yet" without the file."""
    lines = ["## CLI start-up", ""]
    data = read_study(results / RESULTS_NAME)
    commands = (data or {}).get("commands")
    if data is None or not isinstance(commands, dict) or not commands:
        return [*lines, f"No results yet: `{COMMAND}` writes `{RESULTS_NAME}`.", ""]
    target = data.get("target_s", TARGET_S)
    refs = part(data, "references")
    python, cli, torch = (_median(refs.get(k)) for k in REFERENCES)
    loads = part(data, "load_average")
    before = loads.get("before")
    busy = f" under a load average of {before[0]:.2f}" if isinstance(before, list) else ""
    cpus = f" on {data['cpus']} CPUs" if data.get("cpus") else ""
    runs = data.get("runs", "-")
    torch_s = f'; `python -c "import torch"` alone takes {torch:.2f} s' if torch else ""
    lines += [
        f"`benchmarks/cli_startup.py` (`make bench` runs it; alone: `{COMMAND}`): each "
        "command as a fresh `python -m cloudckpt`-style process, median and range of "
        f"{runs} runs; `ls` and `latest` read a local run with two committed checkpoints. "
        "None of them should import torch (`tests/cli/test_startup.py` checks it)"
        f"{torch_s}. Measured {str(data.get('date', '-'))[:10]}{cpus}{busy}; target: under "
        f"{target:g} s each. How it got there: "
        f"[benchmarks/findings/{FINDINGS}](../benchmarks/findings/{FINDINGS}).",
        "",
        "| command | seconds (median) | range | torch imported | target |",
        "|---|---:|---:|---|---|",
    ]
    for name, entry in commands.items():
        if not isinstance(entry, dict):
            continue
        seconds = _median(entry)
        if seconds is None:
            verdict = "not measured"
        else:
            verdict = f"{'met' if seconds < target else '**missed**'} (< {target:g} s)"
        shown = "-" if seconds is None else f"{seconds:.3f}"
        seen = entry.get("torch_imported")
        imported = "-" if not isinstance(seen, bool) else ("**yes**" if seen else "no")
        lines.append(f"| `cloudckpt {name}` | {shown} | {_span(entry)} | {imported} | {verdict} |")
    lines.append("")
    if python is not None:
        prose = f"The interpreter alone (`python -c pass`) takes {python:.3f} s"
        if cli is not None:
            prose += (
                f" and importing the command line (`import cloudckpt.cli.main`) "
                f"{cli - python:.3f} s more"
            )
        lines += [
            prose + "; the rest is the command's own work. The figures move with the "
            "machine's load (the range column).",
            "",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per command (5)")
    parser.add_argument(
        "--out",
        type=Path,
        default=STUDY_RESULTS / RESULTS_NAME,
        help="results file (benchmarks/studies/results/cli_startup.json)",
    )
    args = parser.parse_args(argv)
    results = measure(args.runs)
    write(results, args.out)
    if args.out.name == RESULTS_NAME:
        print("\n".join(cli_startup_section(args.out.parent)))
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
