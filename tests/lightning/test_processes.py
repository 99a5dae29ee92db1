"""Trainer runs in their own processes: 2-process DDP, and a run killed mid-save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudckpt

SCRIPT = str(Path(__file__).with_name("run_fit.py"))


def run_fit(s3, dirpath, epochs, *extra, timeout=300):
    cmd = [sys.executable, SCRIPT, dirpath, str(epochs), json.dumps(s3.storage_options()), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def keys(s3, bucket):
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix="run/")
    return sorted(o["Key"][4:] for o in listing.get("Contents", []))


def test_two_process_ddp_saves_once_and_resumes(rclone_server, tmp_path):
    bucket = rclone_server.make_bucket("lt-ddp")
    dirpath = f"s3://{bucket}/run"
    report = tmp_path / "report.json"
    out = run_fit(rclone_server, dirpath, 3, "--devices", "2", "--async", "--report", str(report))
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(report.read_text())["world_size"] == 2
    assert keys(rclone_server, bucket) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    out = run_fit(
        rclone_server, dirpath, 4, "--devices", "2", "--async", "--resume", "--report", str(report)
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(report.read_text())["started_at_epoch"] == 3
    assert keys(rclone_server, bucket) == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]


def test_run_killed_during_an_async_upload_resumes_from_the_previous_checkpoint(
    moto_server, tmp_path
):
    bucket = moto_server.make_bucket("lt-killed")
    dirpath = f"s3://{bucket}/run"
    marker = tmp_path / "uploading"
    cmd = [
        sys.executable,
        SCRIPT,
        dirpath,
        "5",
        json.dumps(moto_server.storage_options()),
        "--async",
        "--hang-on-save",
        "3",
        "--marker",
        str(marker),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the third save never started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)  # mid-upload of the third last.ckpt
    finally:
        proc.wait(30)
    last = cloudckpt.load(
        f"{dirpath}/last.ckpt", storage_options=moto_server.storage_options(), weights_only=False
    )
    assert last["epoch"] == 1  # the second save (epoch 1) is the newest committed one
    report = tmp_path / "report.json"
    out = run_fit(moto_server, dirpath, 3, "--resume", "--report", str(report))
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(report.read_text())["started_at_epoch"] == 2
