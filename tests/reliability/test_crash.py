"""SIGKILL at chosen points of a save: the previous checkpoint survives; gc cleans up.

Every kill point runs on every store (the filesystem, moto, rclone, the GCS emulator and
Azurite), each in a forked child that must die by SIGKILL at its point: a point the save
never reaches fails its test rather than passing unseen.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.manager.gc import collect_garbage
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from dcp_compat import SINGLE

sys.path.insert(0, str(Path(__file__).parent))
import crash_child

# Where a single-object save (12 MiB in 5 MiB parts: three parts) is killed, each one
# run (none sampled), with whether the new checkpoint exists afterwards.
POINTS = [
    ("create_multipart:1:after", False),
    ("upload_part:1:before", False),
    ("upload_part:2:after", False),
    ("upload_part:3:after", False),
    ("complete_multipart:1:before", False),
    ("complete_multipart:1:after", True),
]

#: Stores whose ``list_multipart`` cannot show an upload staged over a committed object:
#: Azure lists uploads to keys without a committed blob only, and drops the blocks at the
#: blob's next commit or after seven days (docs/stores.md), so gc finds nothing there.
UNLISTED_OVER_AN_OBJECT = {"azure"}


def previous_state() -> dict:
    return {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(3)}


def _kill_run(url: str, storage_options: dict, mode: str, point: str) -> None:
    """Run the save in a forked child (torch already imported: about a second, where a
    fresh interpreter takes five) and check that it died by SIGKILL at ``point``."""
    with tempfile.TemporaryFile() as errors:
        pid = os.fork()
        if pid == 0:  # the child: only os._exit leaves it (no pytest teardown here)
            try:
                torch.set_num_threads(1)  # not the parent's OpenMP pool
                crash_child.run(url, storage_options, mode, point)
            except BaseException:
                errors.write(traceback.format_exc().encode())
                errors.flush()
            os._exit(3)
        status = _wait(pid, point)
        errors.seek(0)
        told = errors.read().decode()[-2000:]
    died = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert died, f"child did not die at {point}: {told}"


def _wait(pid: int, point: str, timeout: float = 120) -> int:
    """The child's exit status; fail (killing it) if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"child still running at {point} after {timeout:.0f} s")
        time.sleep(0.05)


def _check_after_kill(url: str, storage_options: dict, committed_new: bool, listed: bool) -> None:
    loaded = cloudckpt.load(url, storage_options=storage_options)
    expected = 100.0 if committed_new else 0.0
    assert float(loaded["t0"][0]) == expected, "a partial or lost checkpoint became visible"
    opts = resolve_options(storage_options=storage_options)
    store, key = open_url(url, opts)
    root = key.rpartition("/")[0]
    report = collect_garbage(store, root, opts, grace_seconds=0)
    assert list(store.list_multipart(root)) == []
    if not committed_new and listed:
        assert report.uploads, "the killed save left nothing for gc to clean?"


@pytest.mark.parametrize("mode", ["save", "async"])
@pytest.mark.parametrize("point, committed_new", POINTS)
def test_sigkill_during_save_keeps_the_previous_checkpoint(store_url, mode, point, committed_new):
    url = f"{store_url.base_url}/run/ckpt.pt"
    cloudckpt.save(previous_state(), url, storage_options=store_url.storage_options)
    _kill_run(url, store_url.storage_options, mode, point)
    listed = store_url.name not in UNLISTED_OVER_AN_OBJECT
    _check_after_kill(url, store_url.storage_options, committed_new, listed)


@pytest.mark.parametrize("point", ["upload_part:1:after", "complete_multipart:1:after"])
def test_sigkill_during_dcp_save_leaves_no_metadata(store_url, point):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
    from cloudckpt.errors import NotFoundError

    opts = store_url.storage_options
    root = f"{store_url.base_url}/dcp"
    dcp.save(
        previous_state(),
        storage_writer=CloudStorageWriter(f"{root}/step-1", storage_options=opts),
        **SINGLE,
    )
    _kill_run(f"{root}/step-2", opts, "dcp", point)
    # DCP wraps the reader's NotFoundError in its CheckpointException when loading alone.
    with pytest.raises((NotFoundError, CheckpointException), match="no committed checkpoint"):
        dcp.load(
            previous_state(),
            storage_reader=CloudStorageReader(f"{root}/step-2", storage_options=opts),
            **SINGLE,
        )
    out = {k: torch.zeros_like(v) for k, v in previous_state().items()}
    dcp.load(
        out, storage_reader=CloudStorageReader(f"{root}/step-1", storage_options=opts), **SINGLE
    )
    assert float(out["t0"][0]) == 0.0
    ropts = resolve_options(storage_options=opts)
    store, key = open_url(root, ropts)
    collect_garbage(store, key, ropts, grace_seconds=0)
    assert list(store.list_multipart(key)) == []


@pytest.mark.parametrize("point", ["delete:1:before", "delete:1:after", "delete:2:after"])
def test_sigkill_during_retention_keeps_latest_committed(store_url, point):
    opts = store_url.storage_options
    root = f"{store_url.base_url}/managed"
    cloudckpt.CheckpointManager(root, keep_last=1, storage_options=opts).save(1, previous_state())
    _kill_run(root, opts, "retain", point)  # step 2 committed, then killed while pruning 1
    manager = cloudckpt.CheckpointManager(root, keep_last=1, storage_options=opts)
    assert manager.latest().step == 2
    assert float(manager.restore()["t0"][0]) == 100.0
    assert [c.step for c in manager.list()] in ([2], [1, 2])
    manager.gc(grace_seconds=0)
    manager.apply_retention()
    assert [c.step for c in manager.list()] == [2]
