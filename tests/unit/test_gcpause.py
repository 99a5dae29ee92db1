"""The collector paused around bulk building, and what is kept moved to the oldest
generation at once (_runtime/gcpause.py)."""

from __future__ import annotations

import gc

from cloudckpt._runtime import gcpause
from cloudckpt._runtime.gcpause import paused_gc


class _Node:
    """A tracked object, as a loaded state's containers and tensors are."""


def _young() -> set[int]:
    return {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}


def test_what_a_kept_block_built_is_in_the_oldest_generation_and_the_collector_runs_again():
    assert gc.isenabled()
    with paused_gc(kept=True):
        assert not gc.isenabled()
        built = [_Node() for _ in range(5000)]
    assert gc.isenabled()
    young = _young()
    assert not any(id(n) in young for n in built)


def test_a_collector_the_program_disabled_stays_disabled():
    gc.disable()
    try:
        with paused_gc(kept=True):
            built = [_Node() for _ in range(10)]
        assert not gc.isenabled() and built
    finally:
        gc.enable()


def test_a_block_that_built_few_objects_is_not_moved_nor_asks_about_frozen_ones(monkeypatch):
    asked = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or 0)
    with paused_gc(kept=True):
        built = [_Node() for _ in range(10)]
    assert not asked
    young = _young()
    assert all(id(n) in young for n in built)  # a young collection walks ten objects


def test_a_frozen_heap_is_asked_about_once_and_stays_frozen(monkeypatch):
    monkeypatch.setattr(gcpause, "_frozen_until", 0.0)
    frozen_before = [_Node() for _ in range(100)]
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        asked = []
        real = gc.get_freeze_count
        monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real())
        for _ in range(3):
            with paused_gc(kept=True):
                built = [_Node() for _ in range(gcpause.FEW + 100)]
        assert len(asked) == 1  # then taken as frozen for RECHECK seconds
        assert real() >= count  # nothing thawed (an unfreeze would empty it)
        young = _young()
        assert id(built[0]) in young  # not promoted: that would have thawed the program's
        assert not any(id(n) in young for n in frozen_before)
    finally:
        gc.unfreeze()
        monkeypatch.setattr(gcpause, "_frozen_until", 0.0)


def test_once_unfrozen_kept_blocks_are_moved_again(monkeypatch):
    monkeypatch.setattr(gcpause, "_frozen_until", 0.0)
    gc.freeze()
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with paused_gc(kept=True):
        built = [_Node() for _ in range(gcpause.FEW + 100)]
    assert not any(id(n) in _young() for n in built)
