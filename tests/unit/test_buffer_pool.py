"""The one pool class (io/buffers.py) and the staging copy built on it (engine/staging.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cloudckpt
from cloudckpt.engine.staging import StagingPool, stage_tensors
from cloudckpt.errors import CloudCkptError
from cloudckpt.io.buffers import BufferPool, PartBufferCache, unshared


def _bytes_pool() -> BufferPool[int, bytearray]:
    return BufferPool(bytearray, int)


def test_idle_buffers_are_bounded_by_the_largest_keep():
    pool = _bytes_pool()
    bufs = [pool.take(100) for _ in range(4)]
    assert pool.created == 4 and pool.allocated_bytes == 400
    for buf in bufs:
        pool.give_back(buf, 100, keep=2)
    assert pool.idle_bytes == 200  # two kept, two let go
    assert pool.allocated_bytes == 200
    # A larger keep raises the bound; a smaller one later does not lower it.
    more = [pool.take(100) for _ in range(4)]
    for buf in more:
        pool.give_back(buf, 100, keep=3)
    assert pool.idle_bytes == 300
    extra = [pool.take(100) for _ in range(4)]
    for buf in extra:
        pool.give_back(buf, 100, keep=1)
    assert pool.idle_bytes == 300


def test_without_keep_every_buffer_given_back_stays():
    pool = _bytes_pool()
    bufs = [pool.take(10) for _ in range(5)]
    for buf in bufs:
        pool.give_back(buf, 10)
    assert pool.idle_bytes == 50 and pool.allocated_bytes == 50


def test_buffers_are_reused_by_key():
    pool = _bytes_pool()
    small, large = pool.take(8), pool.take(16)
    pool.give_back(small, 8)
    pool.give_back(large, 16)
    assert pool.take(16) is large
    assert pool.take(8) is small
    other = pool.take(8)  # none idle: a new one
    assert other is not small and pool.created == 3


def test_staging_pool_keys_pinning_apart():
    pool = StagingPool()
    plain = pool.take((64, False))
    pool.give_back_all([plain], [False])
    assert pool.take((64, False)) is plain
    pool.give_back_all([plain], [False])
    # A buffer of the same size that is pinned (or not) is another key: never mixed.
    pool.give_back_all([torch.UntypedStorage(64)], [True])
    assert pool.take((64, False)) is plain
    assert pool.idle_bytes == 64


def test_part_cache_keeps_one_size_only():
    cache = PartBufferCache()
    first = [cache.take(1024) for _ in range(3)]
    for buf in first:
        cache.give_back(buf, 1024, keep=3)
    assert cache.idle_bytes == 3 * 1024
    # Another part size drops the idle ones (and their bound).
    other = cache.take(2048)
    cache.give_back(other, 2048, keep=1)
    assert cache.idle_bytes == 2048
    assert cache.allocated_bytes == 2048
    assert cache.take(1024) is not first[0] and cache.created == 5


def test_a_multi_key_pool_keeps_every_key():
    pool = _bytes_pool()
    a, b = pool.take(1), pool.take(2)
    pool.give_back(a, 1)
    pool.give_back(b, 2)
    assert pool.idle_bytes == 3


def test_clear_returns_the_idle_bytes_and_lets_go_of_them():
    pool = _bytes_pool()
    kept, in_use = pool.take(100), pool.take(50)
    pool.give_back(kept, 100)
    assert pool.allocated_bytes == 150
    assert pool.clear() == 100
    assert pool.idle_bytes == 0 and pool.allocated_bytes == 50  # the one in use remains
    pool.give_back(in_use, 50)
    assert pool.take(50) is in_use and pool.created == 2


def test_release_buffers_empties_every_pool():
    pool = _bytes_pool()
    pool.give_back(pool.take(4096), 4096)
    assert cloudckpt.release_buffers() >= 4096
    assert pool.idle_bytes == 0 and pool.allocated_bytes == 0


def test_registration_does_not_keep_a_pool_alive():
    pool = _bytes_pool()
    pool.give_back(pool.take(10), 10)
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None
    cloudckpt.release_buffers()  # a pool that is gone is passed over


def test_a_reusable_buffer_is_handed_out_once_nothing_else_refers_to_it():
    pool: BufferPool[int, bytearray] = BufferPool(bytearray, int, reusable=unshared)
    first = pool.take(32)
    view = memoryview(first)[:4]
    del first
    second = pool.take(32)
    assert second is not view.obj  # a view still refers to the first buffer
    assert pool.created == 2 and pool.idle_bytes == 64  # the pool holds both
    first_id, second_id = id(view.obj), id(second)
    del view
    again = pool.take(32)
    assert id(again) == first_id  # the first one came back
    del second
    assert id(pool.take(32)) == second_id  # the first is in use again; the second free
    assert pool.created == 2
    # Another key is never handed out for this one.
    assert len(pool.take(16)) == 16 and pool.created == 3


def test_a_reusable_pool_takes_nothing_back_and_clears_what_it_holds():
    pool: BufferPool[int, bytearray] = BufferPool(bytearray, int, reusable=unshared)
    buf = pool.take(8)
    with pytest.raises(CloudCkptError, match="reusable"):
        pool.give_back(buf, 8)
    assert pool.clear() == 8
    assert pool.idle_bytes == 0 and pool.allocated_bytes == 0
    assert pool.take(8) is not buf  # let go of: a new one


def test_staged_tensors_are_independent_copies_of_the_same_dtype_and_shape():
    pool = StagingPool()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [
        base,
        base.t(),  # not contiguous
        torch.tensor(3, dtype=torch.int64),  # 0-dim
        torch.zeros(0, 5, dtype=torch.bfloat16),  # no bytes
        torch.tensor([True, False, True]),
    ]
    want = [t.clone() for t in tensors]
    staged = stage_tensors(tensors, pool)
    base.add_(100)  # the sources change; the copies do not
    for got, expected in zip(staged.copies, want, strict=True):
        assert got.device.type == "cpu"
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
    assert pool.allocated_bytes == sum(t.numel() * t.element_size() for t in want)


def test_staged_buffers_go_back_on_release_and_serve_the_next_staging():
    pool = StagingPool()
    tensors = [torch.randn(100), torch.randn(7, 3)]
    staged = stage_tensors(tensors, pool)
    allocated = pool.allocated_bytes
    assert pool.idle_bytes == 0
    staged.release()
    assert staged.copies == [] and pool.idle_bytes == allocated
    again = stage_tensors(tensors, pool)
    assert pool.allocated_bytes == allocated and pool.created == 2
    assert all(torch.equal(a, b) for a, b in zip(again.copies, tensors, strict=True))
    again.release()


def test_a_failed_staging_gives_its_buffers_back():
    pool = StagingPool()

    class Broken(torch.Tensor):
        """A tensor whose copy fails (after the first tensor was staged)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.detach:
                raise RuntimeError("cannot read this tensor")
            return super().__torch_function__(func, types, args, kwargs or {})

    bad = torch.ones(4).as_subclass(Broken)
    with pytest.raises(RuntimeError, match="cannot read"):
        stage_tensors([torch.ones(8), bad], pool)
    assert pool.idle_bytes == pool.allocated_bytes > 0
