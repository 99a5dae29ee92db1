"""The collector paused around bulk building, and what is kept moved to the oldest
generation at once (format/gcpause.py)."""

from __future__ import annotations

import gc

from cloudckpt.format.gcpause import paused_gc


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
