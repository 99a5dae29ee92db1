"""The per-tensor copies of a snapshot and of the archive builder, and the page faulting
of a DCP load, keep the GIL: another Python thread (a data loader, a logger) must not
get it at every tensor, or the caller waits up to the switch interval each time to get
it back (_runtime/memview.py ``copy_memory``, _runtime/pages.py). Whether a thread gets the
GIL in a short release depends on the scheduler, so these tests check how the calls are
made (ctypes' flag for a call that keeps the GIL) and what they do, not the timing. Each
checks itself once (_runtime/probes.py); with the fast paths off the plain copies run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from cloudckpt._runtime import pages, probes, set_fast_paths
from cloudckpt._runtime.memview import copy_memory, copy_on
from cloudckpt.engine import staging
from cloudckpt.format.torch import archive_writer


def _keeps_gil(fn: object) -> bool:
    """A ctypes function made to run with the GIL held (PYFUNCTYPE, PyDLL)."""
    return bool(getattr(fn, "_flags_", 0) & ctypes._FUNCFLAG_PYTHONAPI)  # type: ignore[attr-defined]


def test_the_flag_tells_the_two_kinds_of_call_apart() -> None:
    assert not _keeps_gil(ctypes.memmove)  # ctypes' own releases the GIL
    assert _keeps_gil(ctypes.pythonapi.PyMemoryView_FromMemory)


def test_the_per_tensor_copies_and_page_faulting_keep_the_gil() -> None:
    assert _keeps_gil(copy_memory)
    assert staging.copy_memory is copy_memory  # a snapshot's small storages
    assert archive_writer.copy_memory is copy_memory  # the builder's small records
    if pages.populate_on():
        assert _keeps_gil(pages._call[0])


def test_the_copy_checks_itself_and_is_off_with_the_fast_paths(monkeypatch) -> None:
    set_fast_paths(True)
    try:
        assert copy_on() and probes.outcome("gil_held_copy") is True
        set_fast_paths(False)
        assert not copy_on() and not pages.populate_on()
        # A snapshot then gives each storage a buffer of its own, copied by torch.
        monkeypatch.setattr(staging, "copy_memory", None)
        snap = staging.snapshot({"a": torch.arange(10), "b": torch.ones(3)})
        try:
            got = snap.materialize()
            assert torch.equal(got["a"], torch.arange(10)) and torch.equal(got["b"], torch.ones(3))
            assert all(offset == -1 for _, offset, _ in snap.parts)
        finally:
            snap.release()
    finally:
        set_fast_paths(None)


def test_a_copy_that_would_release_the_gil_fails_its_check(monkeypatch) -> None:
    from cloudckpt._runtime import memview

    monkeypatch.setattr(memview, "copy_memory", ctypes.memmove)
    monkeypatch.setitem(probes._results, "gil_held_copy", None)
    set_fast_paths(True)
    try:
        assert not copy_on()
    finally:
        set_fast_paths(None)


def test_copy_memory_copies() -> None:
    a = torch.zeros(1 << 20, dtype=torch.uint8)
    b = torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8)
    copy_memory(a.data_ptr() + 1, b.data_ptr(), a.nbytes - 1)
    assert int(a[0]) == 0
    assert torch.equal(a[1:], b[:-1])


@pytest.mark.skipif(not pages.populate_on(), reason="no MADV_POPULATE_WRITE on this kernel")
def test_populate_writes_nothing_and_keeps_resident_bytes() -> None:
    t = torch.arange(100_000, dtype=torch.float32)
    before = t.clone()
    pages.populate(t.data_ptr() + 3, t.nbytes - 3)  # not page-aligned: the page is taken
    assert torch.equal(t, before)
    fresh = torch.empty(1 << 20, dtype=torch.uint8)
    pages.populate(fresh.data_ptr(), fresh.nbytes)
    fresh.fill_(7)
    assert int(fresh.sum()) == 7 << 20
