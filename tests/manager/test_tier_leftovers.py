"""What a killed local save leaves: its temp file, removed by the next save, local
retention and ``gc``, never while a live process writes it.

A temp file is locked by its writer (``flock``) for as long as it writes it; the lock
goes with the process, ``kill -9`` included (store/local.py, docs/tiers.md "Leftovers of
a crash"). Real processes are killed here: a save of a few hundred MiB, and writers
holding a temp file open.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import step_dir
from faults import FaultyStore

#: A state of a few hundred MiB: its local save takes long enough to be killed midway.
BIG_MIB = 384
SPAWN_TIMEOUT_S = 120

_SAVE = textwrap.dedent(
    """
    import sys, torch
    from cloudckpt.manager import CheckpointManager
    m = CheckpointManager(sys.argv[1], local_dir=sys.argv[2])
    m.save(2, {"w": torch.ones(int(sys.argv[3]) * 2**18)})
    """
)

_HOLD = textwrap.dedent(
    """
    import sys, threading
    from cloudckpt.store.local import LocalStore
    LocalStore(sys.argv[1]).create_multipart(sys.argv[2])  # a temp file, written no more
    print("ready", flush=True)
    threading.Event().wait()
    """
)


def temps(under: Path) -> list[Path]:
    """The temp files under ``under``; a folder a background drain removes meanwhile is
    skipped (``os.walk`` ignores it where ``Path.rglob`` raises)."""
    return sorted(
        Path(folder) / name
        for folder, _, names in os.walk(under)
        for name in names
        if fnmatch.fnmatch(name, ".*.cloudckpt-*.part")
    )


def spawn(code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], text=True, stderr=subprocess.PIPE, **kwargs
    )


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=SPAWN_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL


def holder(tier: Path, key: str) -> subprocess.Popen[str]:
    """A live process holding a temp file of ``tier`` for ``key`` (until killed)."""
    proc = spawn(_HOLD, str(tier), key, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"the holder did not start: {proc.communicate()[1][-2000:]}")
    return proc


def dead_temp(tier: Path, key: str) -> Path:
    """A temp file of ``tier`` whose writer was killed with SIGKILL."""
    before = set(temps(tier))
    kill(holder(tier, key))
    (left,) = set(temps(tier)) - before
    return left


class HoldMarker(FaultyStore):
    """Holds the bucket's marker write until ``release`` is set."""

    release = threading.Event()

    def _put(self, key: str, data: Any, if_none_match: bool) -> None:
        if key.endswith(MARKER_NAME):
            assert self.release.wait(SPAWN_TIMEOUT_S)
        super()._put(key, data, if_none_match)


def test_a_killed_local_saves_temp_file_is_swept_and_a_live_writers_is_kept(
    tmp_path: Path,
) -> None:
    root, tier = tmp_path / "bucket", tmp_path / "tier"
    first = CheckpointManager(str(root), local_dir=tier)
    first.save(1, {"w": torch.ones(4)})
    first.drain()

    proc = spawn(_SAVE, str(root), str(tier), str(BIG_MIB))
    step = tier / step_dir(2)
    try:
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not temps(step):  # polling for the temp file, not waiting for a time
            assert proc.poll() is None, f"the save ended first: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "no temp file appeared"
            time.sleep(0.002)
    finally:
        kill(proc)
    (leaked,) = temps(step)
    assert not (step / MARKER_NAME).exists()  # not committed: the previous step stands

    live = holder(tier, f"{step_dir(7)}/state.pt")  # another process writing, alive
    try:
        (alive,) = set(temps(tier)) - {leaked}
        m = CheckpointManager(str(root), local_dir=tier, keep_local=1)
        assert [c.step for c in m.list()] == [1]  # the killed save is no checkpoint
        m.save(3, {"w": torch.ones(4)})  # the next save sweeps the tier
        assert not leaked.exists() and not step.exists()
        m.drain()  # and its drain's local retention sweeps it again
        assert alive.exists()  # its writer lives: never removed
        assert m.gc(grace_seconds=0).uploads == []  # nor by gc
        assert alive.exists()
    finally:
        kill(live)

    report = m.gc()  # its writer is gone: gc removes it, whatever its age
    assert not alive.exists()
    assert [u[0] for u in report.uploads] == [f"file://{tier.resolve()}/{step_dir(7)}/state.pt"]

    m.store = held = HoldMarker(m.store)
    held.release = threading.Event()
    m.save(4, {"w": torch.ones(4)})  # its drain waits at the bucket's marker
    left = dead_temp(tier, f"{step_dir(9)}/state.pt")
    held.release.set()
    m.drain()  # the drain's local retention sweeps the tier
    assert not left.exists()
    assert temps(tier) == [] and temps(root) == []
    assert sorted(p.name for p in tier.glob("step-*")) == [step_dir(4)]  # no empty folder


def test_gc_of_a_filesystem_run_root_keeps_a_live_writers_temp_file(tmp_path: Path) -> None:
    """The bucket side (a run root on the filesystem): ``gc`` never removes a temp file
    a live process holds, however old; once its writer is gone it goes past the grace
    period."""
    root = tmp_path / "run"
    m = CheckpointManager(str(root))
    m.save(1, {"w": torch.ones(4)})
    live = holder(root, f"{step_dir(2)}/state.pt")
    try:
        (alive,) = temps(root)
        os.utime(alive, (1.0, 1.0))  # older than any grace period
        assert m.gc(grace_seconds=0).uploads == []
        assert alive.exists()
    finally:
        kill(live)
    assert len(m.gc(grace_seconds=0).uploads) == 1
    assert temps(root) == []
