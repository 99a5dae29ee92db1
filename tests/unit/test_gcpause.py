"""The collector paused around the library's entry points and resumed as it was found;
what a kept pause built moved to the oldest generation only when the program opted in
(_runtime/gcpause.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from cloudckpt._runtime import gcpause, set_fast_paths, set_gc_freeze
from cloudckpt._runtime.gcpause import paused_gc


class _Node:
    """A tracked object, as a loaded state's containers and tensors are."""


def _young() -> set[int]:
    return {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}


@pytest.fixture(autouse=True)
def _fast_paths_on() -> Iterator[None]:
    set_fast_paths(True)
    yield
    set_fast_paths(None)


@pytest.fixture
def freeze_opt_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(gcpause, "_frozen_until", 0.0)
    set_gc_freeze(True)
    yield
    set_gc_freeze(None)


_unfreeze, _enable = gc.unfreeze, gc.enable  # the real ones, for clean-ups


def _refuse(*args: object) -> None:
    raise AssertionError("the host's collector was touched")


def test_the_collector_is_paused_inside_and_runs_again_after():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_it_is_resumed_after_an_error_too():
    with pytest.raises(KeyError), paused_gc(kept=True):
        raise KeyError("x")
    assert gc.isenabled()


def test_it_decorates_an_entry_point():
    @paused_gc(kept=True)
    def entry(x: int) -> bool:
        return gc.isenabled() or x == 0

    assert entry(1) is False and entry.__name__ == "entry"
    assert gc.isenabled()


def test_overlapping_pauses_resume_when_the_last_one_ends():
    # Pauses of two threads need not end in the order they began.
    first, second = paused_gc(), paused_gc(kept=True)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    with paused_gc(), paused_gc():  # nested
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_program_disabled_stays_disabled(monkeypatch):
    gc.disable()
    try:
        monkeypatch.setattr(gc, "enable", _refuse)
        monkeypatch.setattr(gc, "disable", _refuse)
        with paused_gc(kept=True):
            built = [_Node() for _ in range(gcpause.FEW + 100)]
        assert not gc.isenabled() and built
    finally:
        _enable()


def test_with_the_fast_paths_off_nothing_is_touched(monkeypatch):
    set_fast_paths(False)
    monkeypatch.setattr(gc, "disable", _refuse)
    monkeypatch.setattr(gc, "freeze", _refuse)
    with paused_gc(kept=True):
        assert gc.isenabled()
    assert gc.isenabled()


def test_without_the_opt_in_nothing_is_moved_nor_frozen(monkeypatch):
    monkeypatch.setattr(gc, "freeze", _refuse)
    monkeypatch.setattr(gc, "unfreeze", _refuse)
    monkeypatch.setattr(gc, "get_freeze_count", _refuse)
    threshold = gc.get_threshold()
    with paused_gc(kept=True):
        built = [_Node() for _ in range(gcpause.FEW + 100)]
    assert built and gc.get_threshold() == threshold


def test_with_the_opt_in_what_a_kept_pause_built_is_in_the_oldest_generation(freeze_opt_in):
    with paused_gc(kept=True):
        built = [_Node() for _ in range(5000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    young = _young()
    assert not any(id(n) in young for n in built)


def test_a_pause_not_kept_is_not_moved_even_with_the_opt_in(freeze_opt_in, monkeypatch):
    monkeypatch.setattr(gc, "freeze", _refuse)
    with paused_gc():
        built = [_Node() for _ in range(gcpause.FEW + 100)]
    assert built and gc.isenabled()


def test_a_pause_that_built_few_objects_is_not_moved_nor_asks_about_frozen_ones(
    freeze_opt_in, monkeypatch
):
    asked = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or 0)
    gc.collect()  # zero counts: a young collection after the pause stops at generation 1
    with paused_gc(kept=True):
        built = [_Node() for _ in range(10)]
    assert not asked
    young = _young()
    assert all(id(n) in young for n in built)  # a young collection walks ten objects


def test_a_frozen_heap_is_asked_about_once_and_stays_frozen(freeze_opt_in, monkeypatch):
    frozen_before = [_Node() for _ in range(100)]
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        asked = []
        real = gc.get_freeze_count
        monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real())
        monkeypatch.setattr(gc, "unfreeze", _refuse)  # it would thaw the program's
        for _ in range(3):
            with paused_gc(kept=True):
                built = [_Node() for _ in range(gcpause.FEW + 100)]
        assert len(asked) == 1 and built  # then taken as frozen for RECHECK seconds
        # Nothing thawed: a thaw empties the permanent generation, while frozen objects
        # that other threads free (a pytest-xdist worker's) only lower its count.
        assert real() >= len(frozen_before) and count >= len(frozen_before)
        assert not any(id(n) in _young() for n in frozen_before)
    finally:
        _unfreeze()
        monkeypatch.setattr(gcpause, "_frozen_until", 0.0)


def test_once_unfrozen_kept_pauses_are_moved_again(freeze_opt_in):
    gc.freeze()
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with paused_gc(kept=True):
        built = [_Node() for _ in range(gcpause.FEW + 100)]
    assert not any(id(n) in _young() for n in built)
