"""``cloudckpt ls --local`` and ``verify --local`` on a real local tier drained to a moto
bucket, and ``ls``/``verify`` on the tier's directory itself (a run root of its own)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudckpt.cli import main
from cloudckpt.manager import CheckpointManager
from servers import S3Server, unique_bucket_name

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEP = "step-{:09d}"


@dataclass
class Run:
    """A run with steps 1..6 saved through a local tier, drained every 2nd step, then:
    step 2 removed from the tier (bucket only), step 6's bucket marker removed (its drain
    unfinished), so the tiers are 1, 3, 5 local; 2 remote; 4 both; 6 local and due."""

    root: str
    local: Path
    env: dict[str, str]


def cli(*args: str) -> tuple[int, str, str]:
    """``main(argv)`` in this process (the fixture put the server's env in os.environ)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def cli_json(*args: str, code: int = 0) -> Any:
    got, out, err = cli(*args, "--json")
    assert got == code, (got, out, err)
    return json.loads(out)


def rows(text: str) -> dict[int, str]:
    """The table of ``ls``: each step's row, by step."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+)\s+\d{4}-\d\d-\d\d ", line)
        if m:
            found[int(m.group(1))] = line
    return found


@pytest.fixture
def run(moto_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Run]:
    for k, v in moto_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = moto_server.make_bucket(unique_bucket_name("tiers"))
    root = f"s3://{bucket}/run1"
    local = tmp_path / "local"
    manager = CheckpointManager(
        root,
        local_dir=local,
        drain_every_n_steps=2,
        storage_options=moto_server.storage_options(),
    )
    for step in range(1, 7):
        manager.save(step, {"w": torch.full((64,), float(step)), "step": step})
    manager.drain()
    shutil.rmtree(local / STEP.format(2))
    moto_server.client().delete_object(Bucket=bucket, Key=f"run1/{STEP.format(6)}/_CHECKPOINT.json")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    yield Run(root, local, env)
    with contextlib.suppress(Exception):
        moto_server.remove_bucket(bucket)


def test_ls_local_says_which_tiers_hold_each_step_and_what_is_not_drained(run: Run) -> None:
    # The real command line, as a user runs it: credentials from the environment only.
    argv = ["ls", "--local", str(run.local), run.root, "--drain-every-n-steps", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "cloudckpt", *argv],
        env=run.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"{run.root}/  6 checkpoint(s), latest step 6" in done.stdout
    assert "5 in the local tier" in done.stdout and "2 in the bucket" in done.stdout
    table = rows(done.stdout)
    tiers = {step: line.split()[-2] for step, line in table.items()}  # before the metrics
    assert tiers == {1: "local", 2: "remote", 3: "local", 4: "both", 5: "local", 6: "local"}
    assert "1 step(s) due for the bucket and not drained yet: 6 " in done.stdout

    # Without --drain-every-n-steps every step is due (the manager's default).
    code, out, _ = cli("ls", "--local", str(run.local), run.root)
    assert code == 0
    assert "4 step(s) due for the bucket and not drained yet: 1, 3, 5, 6 " in out


def test_ls_local_json(run: Run) -> None:
    body = cli_json("ls", "--local", str(run.local), run.root, "--drain-every-n-steps", "2")
    assert body["kind"] == "run" and body["url"] == f"{run.root}/"
    assert body["local_url"] == run.local.resolve().as_uri() + "/"
    assert body["drain_every_n_steps"] == 2
    assert {c["step"]: c["tiers"] for c in body["checkpoints"]} == {
        1: ["local"],
        2: ["remote"],
        3: ["local"],
        4: ["local", "remote"],
        5: ["local"],
        6: ["local"],
    }
    assert body["undrained"] == [6]
    # Step 6's payload went up, its marker did not: an uncommitted prefix in the bucket.
    assert body["uncommitted"] == [f"{run.root}/{STEP.format(6)}/"]
    # The bucket's description where it has the step, the tier's otherwise.
    urls = {c["step"]: c["url"] for c in body["checkpoints"]}
    assert urls[4] == f"{run.root}/{STEP.format(4)}/"
    assert urls[5] == f"{body['local_url']}{STEP.format(5)}/"


def test_verify_local_checks_the_local_copies(run: Run) -> None:
    body = cli_json("verify", "--local", str(run.local), run.root)
    assert body["ok"] is True
    checked = [c["url"].rsplit("/", 2)[-2] for c in body["checked"]]
    assert checked == [STEP.format(s) for s in (1, 3, 4, 5, 6)]

    # A local copy changed after its commit fails, naming the file; exit code 4.
    state = run.local / STEP.format(5) / "state.pt"
    data = bytearray(state.read_bytes())
    at = data.index(torch.full((64,), 5.0).numpy().tobytes())  # the tensor's record
    data[at + 10] ^= 0xFF
    state.write_bytes(bytes(data))
    code, out, _ = cli("verify", "--local", str(run.local), run.root)
    assert code == 4
    assert re.search(rf"^FAILED {re.escape(state.as_uri())}  \S", out, re.MULTILINE), out
    assert "NOT all 5 object(s) verified" in out
    body = cli_json("verify", "--local", str(run.local), run.root, code=4)
    failed = [c["url"] for c in body["checked"] if not c["ok"]]
    assert failed == [state.as_uri()]


def test_the_tier_directory_is_a_run_root(run: Run) -> None:
    code, out, err = cli("ls", str(run.local))
    assert code == 0, err
    assert "5 checkpoint(s)" in out and sorted(rows(out)) == [1, 3, 4, 5, 6]
    assert "_TIER.json" not in out and "uncommitted" not in out
    body = cli_json("ls", "--all", str(run.local))
    assert body["uncommitted"] == [] and body["leftovers"] == []
    code, out, err = cli("verify", str(run.local))
    assert code == 0, err
    assert "all 5 object(s) verified" in out


def test_local_tier_errors(run: Run, tmp_path: Path) -> None:
    # A directory no manager made a tier of: not found, and nothing written there.
    plain = tmp_path / "plain"
    plain.mkdir()
    code, _, err = cli("ls", "--local", str(plain), run.root)
    assert code == 3 and "is not a local tier: it has no _TIER.json" in err
    assert list(plain.iterdir()) == []
    # The tier of another run is never read for this one.
    code, _, err = cli("verify", "--local", str(run.local), run.root + "-other")
    assert code == 2 and f"holds the local tier of {run.root}/, not of" in err
    code, _, err = cli("ls", "--drain-every-n-steps", "2", run.root)
    assert code == 2 and "add --local DIR" in err
    code, _, err = cli("ls", "--local", str(run.local), f"{run.root}/{STEP.format(4)}")
    assert code == 2 and "is a checkpoint, not a run root" in err
