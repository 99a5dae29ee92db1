"""The "Many ranks" section of docs/benchmarks.md, from the studies' results files.

``benchmarks/studies/shared_load.py`` and ``benchmarks/studies/ranks_under_limit.py``
write their medians under ``benchmarks/studies/results/``; this renders what is there
(a missing or unreadable file renders as "No results yet"), so the page carries the
many-rank figures docs/scale.md discusses.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["STUDY_RESULTS", "many_ranks_section", "part", "read_study"]

#: The studies' results files the page's "Many ranks" section is rendered from.
STUDY_RESULTS = Path(__file__).with_name("studies") / "results"
MiB = 1024**2


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_of(data: dict[str, Any], what: str) -> str:
    reps = data.get("reps")
    return f", median of {reps} {what}{'s' * (reps != 1)}" if isinstance(reps, int) else ""


def read_study(path: Path) -> dict[str, Any] | None:
    """A study's results file as a dict; None when it is missing, unreadable or not an
    object (the page then says there are no results yet)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def part(data: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """``data[key]`` where it is an object, else an empty one: the renderers read a
    results file written by another version without checking every level."""
    value = (data or {}).get(key)
    return value if isinstance(value, dict) else {}


def _num(data: dict[str, Any], key: str, digits: int = 2) -> str:
    value = data.get(key)
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


#: ranks_under_limit.py's modes, as its docstring describes them.
LIMIT_MODES = {
    "adaptive": "the default (`adaptive_rate=True`)",
    "plain": "retries with backoff only",
    "static": "a fixed rate per rank at its fair share",
    "unlimited": "the default, through a proxy that limits nothing",
}


def many_ranks_section(results: Path = STUDY_RESULTS) -> list[str]:
    """The page's "Many ranks" section, from the studies' results files where they exist
    (``studies/shared_load.py``, ``studies/ranks_under_limit.py``): what is there is
    shown, what is not is skipped."""
    lines = [
        "## Many ranks",
        "",
        "Two studies of many ranks on this machine, run by hand (not by `make bench`) and "
        "rendered here from their results files in `benchmarks/studies/results/`; the "
        "design, the request arithmetic and the cost model at 1,024 ranks: "
        "[scale.md](scale.md).",
        "",
        "### Read once, share: a DDP resume",
        "",
    ]
    shared = read_study(results / "shared_load.json")
    medians = (shared or {}).get("medians")
    if not isinstance(medians, dict) or not medians:
        lines += ["No results yet: `.venv/bin/python -m benchmarks.studies.shared_load` "
                  "writes `shared_load.json`.", ""]  # fmt: skip
    else:
        assert shared is not None
        size = shared.get("object_bytes")
        what = f"the same {size / MiB:.0f} MiB object" if isinstance(size, int | float) else (
            "the same object")  # fmt: skip
        if shared.get("tensors"):
            what += f" ({shared['tensors']:,} tensors)"
        lines += [
            f"`benchmarks/studies/shared_load.py`: {shared.get('ranks', 'N')} forked gloo "
            f"ranks each load {what} from `rclone serve s3` on tmpfs, alone (every rank "
            "reads all of it) and with `share=True` (each byte read once in all); the "
            "slowest rank's wall time, the ranks' CPU summed, the requests the server "
            f"logged{_median_of(shared, 'repetition')}. See "
            "[scale.md](scale.md#read-once-share-a-ddp-resume).",
            "",
            "| mode | seconds | CPU s | requests |",
            "|---|---:|---:|---:|",
        ]
        for mode, m in medians.items():
            if isinstance(m, dict):
                lines.append(f"| {mode} | {_num(m, 'seconds')} | {_num(m, 'cpu_s')} "
                             f"| {_num(m, 'requests', 0)} |")  # fmt: skip
        alone, share = medians.get("alone"), medians.get("shared")
        if isinstance(alone, dict) and isinstance(share, dict):
            ratios = [f"{share[k] / alone[k]:.2f}x the {label}"
                      for k, label in (("seconds", "time"), ("cpu_s", "CPU"),
                                       ("requests", "requests"))
                      if isinstance(share.get(k), int | float) and alone.get(k)]  # fmt: skip
            if ratios:
                lines += ["", f"shared / alone: {', '.join(ratios)}."]
        lines.append("")
    lines += ["### Many ranks behind a request limit", ""]
    limit = read_study(results / "ranks_under_limit.json")
    modes = (limit or {}).get("modes")
    if not isinstance(modes, dict) or not modes:
        lines += ["No results yet: `.venv/bin/python -m benchmarks.studies.ranks_under_limit` "
                  "writes `ranks_under_limit.json`.", ""]  # fmt: skip
        return lines
    assert limit is not None
    rate = limit.get("rate")
    ideal = limit.get("ideal_s")
    load, machine = limit.get("load_average"), limit.get("machine")
    cpus = machine.get("cpus") if isinstance(machine, dict) else None
    busy = f", load average {load:.1f}" if isinstance(load, int | float) else ""
    busy += f" on {cpus} CPUs" if busy and cpus else ""
    lines += [
        f"`benchmarks/studies/ranks_under_limit.py`: {limit.get('ranks', 'N')} forked gloo "
        f"ranks each save {limit.get('saves', 'N')} small objects to one prefix at once "
        "through the fault proxy, which enforces "
        + (f"{rate:g} requests/s" if isinstance(rate, int | float) else "a request rate")
        + " per prefix with 503 SlowDown; the slowest rank's time against the ideal "
        "(requests / rate after the burst"
        + (f": {ideal:.2f} s" if isinstance(ideal, int | float) else "")
        + f"){_median_of(limit, 'round')}"
        + (", after one untimed save per rank" if limit.get("warm") else "")
        + busy
        + ". See [scale.md](scale.md#many-ranks-behind-a-request-limit-measured).",
        "",
        "| mode | what | x ideal (median, range) | 503s sent (median) | seconds (median) "
        "| limiter cuts (median) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, m in modes.items():
        if not isinstance(m, dict):
            continue
        rounds = [r for r in m.get("rounds", []) if isinstance(r, dict)]
        span = m.get("x_ideal_range")
        x_ideal = _num(m, "x_ideal_median")
        if isinstance(span, list) and len(span) == 2 and all(isinstance(v, int | float)
                                                              for v in span):  # fmt: skip
            x_ideal += f" ({span[0]:.2f}-{span[1]:.2f})"
        med = {k: _median([r[k] for r in rounds if isinstance(r.get(k), int | float)])
               for k in ("seconds", "cuts")}  # fmt: skip
        lines.append(f"| {mode} | {LIMIT_MODES.get(mode, '')} | {x_ideal} "
                     f"| {_num(m, 'proxy_503s_median', 0)} "
                     f"| {_num(med, 'seconds')} | {_num(med, 'cuts', 0)} |")  # fmt: skip
    return [*lines, ""]
