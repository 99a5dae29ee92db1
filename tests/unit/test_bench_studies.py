"""The studies' sections of docs/benchmarks.md (benchmarks/cli_startup.py,
benchmarks/studies/tiers.py): rendered from a results file, verdicts computed from its
figures, "No results yet" without one, and a failed study shown as failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmarks import run
from benchmarks.cli_startup import cli_startup_section
from benchmarks.report import demote_headings, studies_sections
from benchmarks.studies.tiers import tiers_section

MiB = 1024**2


def _tiers(**medians: float) -> dict[str, Any]:
    """A tiers.json whose targets are all met, with ``medians`` replacing its figures."""
    m = {"ceiling_put_s": 2.0, "drain_s": 2.0, "save_blocking_s": 0.22,
         "async_blocking_s": 0.05, "restore_local_s": 0.1, "restore_bucket_s": 0.4,
         "restore_corrupt_s": 1.0, "raw_write_shm_s": 0.2, "plain_save_shm_s": 0.21,
         "fresh_memory_s": 0.16}  # fmt: skip
    m.update(medians)
    return {
        "date": "2026-12-04T12:00:00+00:00",
        "mib": 512,
        "tensors": 8,
        "bytes": 512 * MiB,
        "reps": 5,
        "cpus": 2,
        "load_average": {"before": [1.5, 1.0, 0.8], "after": [2.5, 1.2, 0.9]},
        "memcpy_s": 0.04,
        "medians": m,
        "repetitions": {k: [v] for k, v in m.items()},
        "traffic": {"local": {"requests": 1, "payload_gets": 0, "bytes_read": 512},
                    "bucket": {"requests": 30, "payload_gets": 26, "bytes_read": 525 * MiB}},
        "corrupt": {"state_equal": True, "warning": "step 11: the local copy failed a check"},
    }  # fmt: skip


def _write(directory: Path, name: str, data: dict[str, Any]) -> Path:
    (directory / name).write_text(json.dumps(data))
    return directory


def _row(lines: list[str], figure: str) -> str:
    rows = [ln for ln in lines if ln.startswith(f"| {figure} |")]
    assert len(rows) == 1, (figure, lines)
    return rows[0]


def test_tiers_section_all_met(tmp_path: Path) -> None:
    lines = tiers_section(_write(tmp_path, "tiers.json", _tiers()))
    assert lines[0] == "## Tiered checkpoints"
    floor = "the state's bytes written once to a new file on `/dev/shm` (the floor)"
    assert _row(lines, floor) == f"| {floor} | 0.200 s | 5.00x memcpy | |"
    assert _row(lines, "`save`, blocking") == (
        "| `save`, blocking | 0.220 s | 1.10x the floor (5.5x memcpy) | met (<= 1.3x) |"
    )
    assert _row(lines, "`async_save`, blocking") == (
        "| `async_save`, blocking | 0.050 s | 1.25x memcpy | met (<= 1.5x) |"
    )
    assert _row(lines, "drain, local commit to bucket marker").endswith(
        "| 0.25 GiB/s = 1.00x the ceiling | met (>= 0.9x) |"
    )
    assert _row(lines, "restore, local copy valid").endswith("| met (0 payload GETs) |")
    assert _row(lines, "local vs bucket restore") == (
        "| local vs bucket restore | | 4.00x faster | met (>= 3x) |"
    )
    assert _row(lines, "restore, local copy corrupt").endswith("| met (asserted) |")
    text = "\n".join(lines)
    assert "512 MiB in 8 fp32 tensors, median of 5 repetitions" in text
    assert "load average (1 min) 1.50 before and 2.50 after" in text
    assert "took 0.210 s, 1.05x the floor" in text  # the plain save, from the file
    assert "tensors alone took 0.160 s in this run" in text  # the fresh-memory cost
    assert "missed" not in text


def test_tiers_section_missed_targets(tmp_path: Path) -> None:
    data = _tiers(save_blocking_s=0.5, drain_s=4.0, restore_local_s=0.2)
    data["traffic"]["local"]["payload_gets"] = 2
    data["corrupt"]["warning"] = None
    lines = tiers_section(_write(tmp_path, "tiers.json", data))
    assert _row(lines, "`save`, blocking").endswith(
        "| 2.50x the floor (12.5x memcpy) | **missed** (<= 1.3x) |"
    )
    assert _row(lines, "`async_save`, blocking").endswith("| met (<= 1.5x) |")
    assert _row(lines, "drain, local commit to bucket marker").endswith(
        "= 0.50x the ceiling | **missed** (>= 0.9x) |"
    )
    assert _row(lines, "restore, local copy valid").endswith("| **missed** (0 payload GETs) |")
    assert _row(lines, "local vs bucket restore").endswith("| 2.00x faster | **missed** (>= 3x) |")
    assert _row(lines, "restore, local copy corrupt").endswith("| not measured |")


def test_tiers_section_of_a_run_without_the_floor(tmp_path: Path) -> None:
    # A results file written before the floor was measured: the save is not judged.
    data = _tiers()
    del data["medians"]["raw_write_shm_s"]
    lines = tiers_section(_write(tmp_path, "tiers.json", data))
    assert _row(lines, "`save`, blocking") == (
        "| `save`, blocking | 0.220 s | - (5.5x memcpy) | not measured (<= 1.3x) |"
    )


def test_tiers_section_without_results(tmp_path: Path) -> None:
    empty = tiers_section(tmp_path)
    assert empty[0] == "## Tiered checkpoints"
    assert "No results yet: `.venv/bin/python -m benchmarks.studies.tiers`" in empty[2]
    (tmp_path / "tiers.json").write_text("{not json")
    assert tiers_section(tmp_path) == empty


def _cli(**seconds: float) -> dict[str, Any]:
    """A cli_startup.json with each command's median from ``seconds`` (0.2 s if not)."""
    commands = {name: {"median_s": seconds.get(name.strip("-"), 0.2),
                       "runs_s": [0.15, seconds.get(name.strip("-"), 0.2), 0.3],
                       "torch_imported": False}
                for name in ("--version", "--help", "ls", "latest")}  # fmt: skip
    return {
        "date": "2026-12-04T12:00:00+00:00",
        "runs": 3,
        "cpus": 2,
        "target_s": 0.5,
        "load_average": {"before": [2.7, 1.0, 0.5], "after": [2.0, 1.0, 0.5]},
        "references": {"python_pass": {"median_s": 0.02, "runs_s": [0.02]},
                       "import_cli": {"median_s": 0.14, "runs_s": [0.14]},
                       "import_torch": {"median_s": 2.5, "runs_s": [2.5]}},
        "commands": commands,
    }  # fmt: skip


def test_cli_startup_section(tmp_path: Path) -> None:
    data = _cli(ls=0.6)
    data["commands"]["latest"]["torch_imported"] = True
    lines = cli_startup_section(_write(tmp_path, "cli_startup.json", data))
    assert lines[0] == "## CLI start-up"
    assert _row(lines, "`cloudckpt --version`") == (
        "| `cloudckpt --version` | 0.200 | 0.150-0.300 | no | met (< 0.5 s) |"
    )
    assert _row(lines, "`cloudckpt ls`") == (
        "| `cloudckpt ls` | 0.600 | 0.150-0.600 | no | **missed** (< 0.5 s) |"
    )
    assert "| **yes** |" in _row(lines, "`cloudckpt latest`")
    text = "\n".join(lines)
    assert "median and range of 3 runs" in text
    assert '`python -c "import torch"` alone takes 2.50 s' in text
    assert "under a load average of 2.70" in text
    assert "(`python -c pass`) takes 0.020 s" in text
    assert "(`import cloudckpt.cli.main`) 0.120 s more" in text


def test_cli_startup_section_without_results(tmp_path: Path) -> None:
    lines = cli_startup_section(tmp_path)
    assert lines[0] == "## CLI start-up"
    assert "No results yet: `.venv/bin/python -m benchmarks.cli_startup`" in lines[2]


def test_failed_study_is_shown_with_its_error(tmp_path: Path) -> None:
    _write(tmp_path, "cli_startup.json", _cli())
    doc = {"studies": [{"name": "tiers", "command": "python -m benchmarks.studies.tiers",
                        "error": "exited with 1: AssertionError: no WARNING"},
                       {"name": "cli-startup", "command": "python -m benchmarks.cli_startup",
                        "seconds": 9.0}]}  # fmt: skip
    lines = studies_sections(doc, tmp_path)
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert headings == ["## CLI start-up", "## Tiered checkpoints"]
    tiers = lines[lines.index("## Tiered checkpoints") :]
    assert tiers[2] == (
        "**Failed in this run** (`python -m benchmarks.studies.tiers`): `exited with 1: "
        "AssertionError: no WARNING`. Any figures below are from an earlier run."
    )
    assert tiers[4].startswith("No results yet")
    assert not any("Failed" in ln for ln in lines[: lines.index("## Tiered checkpoints")])


def test_run_study_reports_the_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(run.STUDIES, "broken", ("benchmarks.no_such_study", "x.json", (), ()))
    outcome = run.run_study("broken", quick=False, results=tmp_path, timeout=120)
    assert outcome["name"] == "broken"
    assert outcome["command"] == (f"python -m benchmarks.no_such_study --out {tmp_path / 'x.json'}")
    assert outcome["error"].startswith("exited with 1: ")
    assert "No module named benchmarks.no_such_study" in outcome["error"]
    assert sys.executable not in outcome["command"]


def test_a_studys_headings_nest_under_findings() -> None:
    text = "# Title (2026-12-04)\n\n## Met\n```\n# a shell comment\n```\n#tag"
    assert demote_headings(text) == [
        "### Title (2026-12-04)", "", "#### Met", "```", "# a shell comment", "```", "#tag",
    ]  # fmt: skip
