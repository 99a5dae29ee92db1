"""``examples/demo.py`` (``make demo``) runs end to end, small: against the local S3
server it starts itself, and against a directory given with ``--url``."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
SMALL = ["--steps", "4", "--every", "2", "--width", "64"]


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(DEMO), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_demo_against_its_own_s3_server() -> None:
    out = _run()
    endpoint = re.search(r"local S3 server: .* at http://127\.0\.0\.1:(\d+) ", out)
    assert endpoint, out
    assert re.search(r"step 4: .* saved .*, \d+ requests?$", out, re.MULTILINE), out
    assert "weights identical: True" in out
    assert "a plain S3 GET (boto3) and torch.load read the same object: step 4" in out
    assert "kept steps [2, 4] under s3://demo/run/managed" in out
    assert "$ cloudckpt ls s3://demo/run/managed/" in out
    assert "2 checkpoint(s)" in out
    assert "$ cloudckpt verify s3://demo/run/managed/" in out
    assert "all 2 object(s) verified" in out
    _assert_tiered(out, "s3://demo/run/tiered/")
    # Restored from the local copy, the bucket served only the listing; the bucket's own
    # restore reads the step's marker and payload from it.
    local = re.search(r"^restored step 4 from the local tier .*, (\d+) requests?;", out, re.M)
    bucket = re.search(r"^restored step 4 from the bucket .*, (\d+) requests?;", out, re.M)
    assert local and bucket, out
    assert int(local.group(1)) < int(bucket.group(1))
    assert out.rstrip().endswith("local S3 server stopped")
    # Stopped: nothing listens on its port any more.
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(endpoint.group(1)))) != 0


def test_demo_against_a_directory(tmp_path: Path) -> None:
    out = _run("--url", str(tmp_path / "ckpt"))
    assert "local S3 server" not in out
    assert "torch.load reads the same file: step 4" in out
    assert "all 2 object(s) verified" in out
    _assert_tiered(out, (tmp_path / "ckpt" / "tiered").as_uri() + "/")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*.pt")) == [
        "step-000002.pt",
        "step-000004.pt",
    ]
    # The local tier is a temporary directory, gone when the demo ends.
    tier = re.search(r"^local tier: (\S+), drained to ", out, re.MULTILINE)
    assert tier and not Path(tier.group(1)).exists(), out


def _assert_tiered(out: str, root: str) -> None:
    """The local tier's part: the save, the drain, ``ls --local`` showing the step in both
    tiers, a restore from each tier with the trained weights."""
    assert f", drained to {root}\n" in out
    assert "step 4: committed to the local tier in " in out
    assert "step 4 is committed in the bucket too" in out
    assert re.search(rf"^\$ cloudckpt ls --local \S+ {re.escape(root)}$", out, re.MULTILINE)
    assert re.search(r"^\s+4 .* both ", out, re.MULTILINE), out
    assert "nothing left to drain" in out
    assert re.search(r"^restored step 4 from the local tier .*weights identical: True$", out, re.M)
    assert re.search(r"^restored step 4 from the bucket .*weights identical: True$", out, re.M)
