"""One SaveHandle for every background save (engine/handle.py): its two moments, one
registry of what is in flight, failures never dropped, forked children not waiting for
their parent's saves."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import cloudckpt
from cloudckpt.engine.handle import InFlight, SaveHandle
from cloudckpt.manager import ManagedSaveHandle
from cloudckpt.megatron import MegatronSaveHandle


def test_the_public_handle_is_the_one_every_save_returns() -> None:
    assert cloudckpt.SaveHandle is SaveHandle
    assert issubclass(ManagedSaveHandle, SaveHandle)
    assert issubclass(MegatronSaveHandle, SaveHandle)


def test_staged_then_done_then_result() -> None:
    handle: SaveHandle[int] = SaveHandle("mem://b/k")
    seen: list[SaveHandle[int]] = []
    handle.add_done_callback(seen.append)
    assert not handle.staged() and not handle.done()
    handle.mark_staged()
    assert handle.staged() and not handle.done()
    with pytest.raises(TimeoutError, match="mem://b/k"):
        handle.result(timeout=0)
    handle.finish(7, None)
    assert handle.done() and not handle.failed() and handle.result() == 7
    assert seen == [handle]


def test_a_failure_nobody_checked_is_raised_once_by_the_registry() -> None:
    registry = InFlight()
    failed: SaveHandle[None] = SaveHandle("mem://b/failed")
    registry.add(failed)
    assert registry.pending() == [failed]
    failed.finish(None, OSError("boom"))
    with pytest.raises(OSError, match="boom"):
        registry.raise_unreported()
    registry.raise_unreported()  # seen: not raised again
    checked: SaveHandle[None] = SaveHandle("mem://b/checked")
    registry.add(checked)
    checked.finish(None, OSError("seen"))
    assert isinstance(checked.exception(), OSError)
    registry.raise_unreported()  # the caller saw it already


def test_pending_by_kind_counts_only_that_kind() -> None:
    registry = InFlight()
    plain: SaveHandle[None] = SaveHandle("mem://b/plain")
    managed = ManagedSaveHandle(3, "mem://b/step-3/", 0.0)
    registry.add(plain)
    registry.add(managed)
    assert registry.pending() == [plain, managed]
    assert registry.pending(SaveHandle) == [plain]
    assert registry.pending(ManagedSaveHandle) == [managed]


def test_a_forked_child_does_not_wait_for_its_parents_saves_at_exit() -> None:
    code = textwrap.dedent(
        """
        import os, sys, threading
        from cloudckpt.engine.handle import SaveHandle, in_flight

        release = threading.Event()
        handle = SaveHandle("mem://b/parent")
        in_flight.add(handle)
        threading.Thread(target=lambda: (release.wait(), handle.finish(1, None))).start()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal interpreter exit runs cloudckpt's exit hook
        for _ in range(600):  # up to 60 s for the child
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            release.wait(0.1)
        else:
            os.kill(pid, 9)
            print("child hung")
        release.set()
        print("parent", handle.result())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["parent", "1"], out.stdout
