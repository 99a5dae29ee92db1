"""A read abandoned at a deadline or Ctrl-C may still land in its buffer: the memory it
fills stays alive until the read has ended (``RangeReader.add(owner=...)``), so a late
write never reaches freed memory."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from cloudckpt._runtime.memview import storage_view
from cloudckpt.errors import DeadlineExceededError
from cloudckpt.io.ranges import RangeReader
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from cloudckpt.store.deadline import deadline_scope
from faults import FaultyStore

#: The stalled read is released after this long at the latest, so a test that waits for
#: it cannot hang (a generous bound, never reached when the code is right).
WATCHDOG_S = 60.0


def _stalled_store(tmp_path, release: threading.Event, entered: threading.Event) -> FaultyStore:
    (tmp_path / "obj.bin").write_bytes(bytes(range(256)) * 4)
    store, _ = open_url(str(tmp_path), resolve_options())
    faulty = FaultyStore(store)

    def stall(n: int) -> None:
        entered.set()
        release.wait(WATCHDOG_S)  # the network holds the answer

    faulty.faults["read_into"] = stall
    return faulty


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["deadline", "ctrl-c"])
def test_an_abandoned_read_keeps_the_memory_it_fills_alive(tmp_path, ctrl_c: bool) -> None:
    release, entered = threading.Event(), threading.Event()
    store = _stalled_store(tmp_path, release, entered)
    storage = torch.UntypedStorage(1024)
    alive = weakref.ref(storage)
    try:
        with deadline_scope(None if ctrl_c else 0.5):
            reader = RangeReader(store, resolve_options(max_attempts=1))
            reader.add("obj.bin", 0, storage_view(storage), owner=storage)
            if ctrl_c:
                reader.start()  # the reads go out from the feeder thread
                assert entered.wait(WATCHDOG_S)
                try:
                    raise KeyboardInterrupt  # what Ctrl-C raises in the waiting caller
                except KeyboardInterrupt:
                    reader.cancel()
            else:
                with pytest.raises(DeadlineExceededError):
                    reader.run()
        assert entered.is_set() and not release.is_set()  # abandoned, still stalled
        del storage, reader
        gc.collect()
        assert alive() is not None  # the stalled read still refers to its memory
    finally:
        release.set()
    stop = time.monotonic() + WATCHDOG_S
    while alive() is not None and time.monotonic() < stop:
        time.sleep(0.01)  # polling for the abandoned read's thread to end
    assert alive() is None  # freed once the read ended, without waiting for a collection
