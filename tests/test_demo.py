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
    assert out.rstrip().endswith("local S3 server stopped")
    # Stopped: nothing listens on its port any more.
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(endpoint.group(1)))) != 0


def test_demo_against_a_directory(tmp_path: Path) -> None:
    out = _run("--url", str(tmp_path / "ckpt"))
    assert "local S3 server" not in out
    assert "torch.load reads the same file: step 4" in out
    assert "all 2 object(s) verified" in out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*.pt")) == [
        "step-000002.pt",
        "step-000004.pt",
    ]
