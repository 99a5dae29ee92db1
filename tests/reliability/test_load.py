"""Many processes saving and loading against one server: no lost data, no deadlock.

CI-sized by default (4 processes x 10 checkpoints); CLOUDCKPT_SOAK=1 runs the long
variant (8 processes x 20 checkpoints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("load_worker.py"))


@pytest.mark.slow
def test_concurrent_processes_lose_nothing(rclone_server):
    soak = os.environ.get("CLOUDCKPT_SOAK") == "1"
    procs, count = (8, 20) if soak else (4, 10)
    bucket = rclone_server.make_bucket("load-many")
    opts = json.dumps(rclone_server.storage_options())
    running = [
        subprocess.Popen(
            [sys.executable, WORKER, f"s3://{bucket}", opts, str(w), str(count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(procs)
    ]
    reports = []
    for p in running:
        out, err = p.communicate(timeout=900)  # a deadlock fails here, bounded
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["worker"] for r in reports) == list(range(procs))
    assert all(r["bad"] == 0 for r in reports), reports
    keys = rclone_server.client().list_objects_v2(Bucket=bucket, MaxKeys=1000).get("Contents", [])
    assert len([k for k in keys if "ckpt-" in k["Key"]]) == procs * count
    # Memory does not grow with the number of checkpoints: resident memory after all of
    # them (garbage collected, free allocator pages trimmed) is resident memory after the
    # first half plus allocator noise (a leak of one 12 MiB state per checkpoint would
    # add 60 MiB over the second half). The peak, which depends on how the threads
    # interleave, stays within the 12 MiB state, its staging and loaded copies, two 5 MiB part
    # buffers, and 96 MiB of slack (the allocator and thread stacks).
    for r in reports:
        assert r["grown"] <= 24 << 20, r
        assert r["extra"] <= 3 * (12 << 20) + 2 * (5 << 20) + (96 << 20), r
