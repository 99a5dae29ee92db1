"""Part buffers stay warm between saves, bounded, and can be handed back."""

from __future__ import annotations

import torch

import cloudckpt
from cloudckpt._runtime import probes
from cloudckpt.engine.staging import get_pool
from cloudckpt.format.torch import archive_writer
from cloudckpt.format.torch.archive_writer import ChunkPool, get_chunk_pool
from cloudckpt.io.buffers import PartBufferCache, SaveBuffers, get_cache
from cloudckpt.io.sink import BORROW_MIN, MIN_SHRUNK_PART, choose_part_size
from cloudckpt.options import MiB


def _never() -> None:
    pass


def _small_storages() -> dict[str, torch.Tensor]:
    """6 MiB in storages too small to send from their own memory: two 5 MiB parts."""
    return {f"w{i}": torch.randn(BORROW_MIN // 8) for i in range(6 * MiB // (BORROW_MIN // 2))}


def test_a_second_save_reuses_the_first_saves_part_buffers(tmp_path, monkeypatch):
    # The part buffers of the torch.save path (the archive builder turned off).
    monkeypatch.setitem(probes._results, archive_writer.PROBE, False)
    cloudckpt.release_buffers()
    cache = get_cache()
    state = _small_storages()
    opts = {"part_size": 5 * MiB, "write_concurrency": 2}
    cloudckpt.save(state, tmp_path / "a.pt", **opts)
    created = cache.created
    assert cache.idle_bytes == 2 * 5 * MiB
    for name in "bcd":
        cloudckpt.save(state, tmp_path / f"{name}.pt", **opts)
    assert cache.created == created
    loaded = cloudckpt.load(tmp_path / "d.pt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_second_save_reuses_the_first_saves_chunks(tmp_path):
    # The archive builder copies small records into chunks, kept for the next save.
    cloudckpt.release_buffers()
    pool = get_chunk_pool()
    state = _small_storages()
    opts = {"part_size": 5 * MiB, "write_concurrency": 2}
    cloudckpt.save(state, tmp_path / "a.pt", **opts)
    held = pool.held_bytes
    assert held >= 6 * MiB
    for name in "bcd":
        cloudckpt.save(state, tmp_path / f"{name}.pt", **opts)
    assert pool.held_bytes == held  # every chunk came from the pool
    loaded = cloudckpt.load(tmp_path / "d.pt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert cloudckpt.release_buffers() >= held
    assert pool.held_bytes == 0


def test_a_chunk_is_not_handed_out_while_a_view_of_it_lives():
    pool = ChunkPool()
    first = pool.take()
    view = memoryview(first)[:10]
    del first
    second = pool.take()
    assert second is not view.obj  # the view still refers to the first chunk
    del view, second
    third = pool.take()
    assert pool.held_bytes == 2 * len(third)  # one of the two came back


def test_large_storages_are_sent_from_their_own_memory(tmp_path):
    cloudckpt.release_buffers()
    cache = get_cache()
    created = cache.created
    parent = torch.randn(3 * MiB)
    state = {"big": torch.randn(2 * MiB), "view": parent[MiB:], "small": torch.arange(10)}
    cloudckpt.save(state, tmp_path / "a.pt", part_size=5 * MiB, write_concurrency=2)
    assert cache.created == created and cache.idle_bytes == 0  # no part buffer made
    loaded = cloudckpt.load(tmp_path / "a.pt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert torch.equal(torch.load(tmp_path / "a.pt")["view"], state["view"])  # a real archive


def test_large_storages_take_no_chunk_each(tmp_path):
    # Headers between borrowed storages share one chunk: chunks follow the bytes copied.
    cloudckpt.release_buffers()
    state = {f"w{i}": torch.randn(BORROW_MIN) for i in range(40)}
    cloudckpt.save(state, tmp_path / "a.pt", part_size=5 * MiB, write_concurrency=2)
    assert get_chunk_pool().held_bytes == archive_writer.CHUNK_BYTES
    loaded = cloudckpt.load(tmp_path / "a.pt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_idle_buffers_are_bounded_by_one_saves_use():
    cache = PartBufferCache()
    first = SaveBuffers(3, 1024, cache)
    bufs = [first.acquire(_never) for _ in range(3)]
    for b in bufs:
        first.release(b)
    assert cache.idle_bytes == 3 * 1024
    # A second save of the same size takes them all back: nothing new is created.
    second = SaveBuffers(3, 1024, cache)
    again = [second.acquire(_never) for _ in range(3)]
    assert cache.created == 3 and cache.idle_bytes == 0
    for b in again:
        second.release(b)
    # Another part size drops the idle ones: one size is kept, never a mix.
    third = SaveBuffers(2, 2048, cache)
    b = third.acquire(_never)
    third.release(b)
    assert cache.idle_bytes == 2048


def test_release_buffers_frees_part_and_staging_buffers(tmp_path):
    state = {"w": torch.randn(6 * MiB // 4)}
    cloudckpt.save(state, tmp_path / "a.pt", part_size=5 * MiB, write_concurrency=2)
    cloudckpt.async_save(state, tmp_path / "b.pt").result(60)
    chunks = get_chunk_pool()
    held = get_cache().idle_bytes + get_pool().idle_bytes + chunks.held_bytes
    assert held >= 6 * MiB
    assert cloudckpt.release_buffers() == held
    assert get_cache().idle_bytes == 0 and get_pool().idle_bytes == 0
    assert chunks.held_bytes == 0


def test_small_objects_spread_over_every_upload_stream():
    # 128 MiB with 64 MiB parts would keep 2 of 10 streams busy; parts shrink to fill 10.
    part = choose_part_size(128 * MiB, 64 * MiB, 10)
    assert part % MiB == 0 and 128 * MiB / part > 9
    # Never below the floor, never above what was asked for.
    assert choose_part_size(20 * MiB, 64 * MiB, 10) == MIN_SHRUNK_PART
    assert choose_part_size(100 * MiB, 5 * MiB, 10) == 5 * MiB
    # Large objects keep the configured size.
    assert choose_part_size(4096 * MiB, 64 * MiB, 10) == 64 * MiB
