"""The differential fuzzer (fuzz.py) in the suite: fixed seeds, a share of the cases
``make fuzz`` runs, zero failures (issues 29 and 39).

Each run is a fresh interpreter (the fuzzer forks its batches from it):

* the classic cases: archives and DCP metadata through the in-memory entry point, then
  archives through ``cloudckpt.load`` of a file (the record-by-record path, with its own
  tensor rebuild): 16,000 cases in about 25 s on two cores;
* the kinds issue 39 added: ``attack`` (hostile integers at every integer position,
  stride-0 and overlapping views also inside device rebuilds, BUILD states of every
  length on every kind of object, mutations of what allowed calls return, size
  constructors; under torch's policy and DCP ``.metadata``'s) and ``records`` (archives
  of 1-8 MiB records through cloudckpt.load of a file, with ``keys=`` and of an
  ``s3://`` object on a moto server, the reader threads running; each load's peak
  memory against torch's): about 40 s on two cores (a quiet machine).

``make fuzz`` runs ``--target all``: the classic cases with both new kinds mixed in.
Where a run fails, its failures are in the assertion message with the command that
replays each one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: Failures are expected only while the boundary (issue 29) has not landed.
_before_boundary = pytest.mark.xfail(
    not fuzz.HAS_BOUNDARY, strict=False, reason="issue 29: boundary not landed"
)


def _fuzz(tmp_path: Path, *args: str, timeout: float = 300) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "fuzz.py"), "--jobs", "2", "--report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    assert report.exists(), f"the fuzzer did not finish (exit {proc.returncode}):\n{tail}"
    found = json.loads(report.read_text())
    found["output"] = proc.stdout
    found["returncode"] = proc.returncode
    return found


def _check(found: dict, cases: int) -> None:
    assert found["cases"] == cases, found["output"][-4000:]
    counts = found["counts"]
    assert counts.get("both-accepted-equal", 0) > cases // 20, "too few accepted cases compared"
    assert counts.get("both-refused", 0) > cases // 2
    assert found["counts"].get("failure", 0) == 0, found["output"][-8000:]
    assert found["returncode"] == 0, found["output"][-4000:]


@_before_boundary
def test_the_boundary_agrees_with_torch_on_mutated_and_generated_files(tmp_path):
    cases = 12_000 if fuzz.HAS_BOUNDARY else 300  # before it, a short run fails soon enough
    _check(_fuzz(tmp_path, "--seed", "1", "--cases", str(cases), "--target", "classic"), cases)


def test_attacks_on_integers_views_builds_and_call_results(tmp_path):
    """Issue 39's attack programs over small records, in memory, under torch's policy
    and under DCP ``.metadata``'s: 8,000 cases in about 20 s on two cores."""
    cases = 8_000
    found = _fuzz(tmp_path, "--seed", "3", "--cases", str(cases), "--target", "attack")
    assert found["modes"] == {"attack": cases}
    _check(found, cases)


def test_large_records_through_every_load_path(tmp_path):
    """Issue 39's records cases: cloudckpt.load of archives with 1-8 MiB records, by a
    file, by the file with ``keys=`` and (a quarter of them) by S3 on a moto server,
    each with its peak memory against torch's: 300 cases in about 20 s on two cores."""
    cases = 300
    found = _fuzz(tmp_path, "--seed", "4", "--cases", str(cases), "--target", "records")
    assert found["modes"] == {"records": cases}
    assert found["s3"], "no moto server: the s3 entries did not run\n" + found["output"][-2000:]
    _check(found, cases)


@_before_boundary
def test_cloudckpt_load_of_a_file_agrees_with_torch(tmp_path):
    cases = 4_000 if fuzz.HAS_BOUNDARY else 200  # seed 2 case 3039: a device rebuild
    found = _fuzz(
        tmp_path, "--seed", "2", "--cases", str(cases), "--target", "archive", "--entry", "file"
    )
    _check(found, cases)
