"""RangeFetcher, the DCP reader's ranged reads: batching, streaming and cancelling.

Against a real directory (LocalStore): a streaming fetcher starts reading once a batch
of ``read_chunk_size`` bytes is waiting, still joins neighbours within a batch, reports
a failed read from ``run()``, and leaving its ``with`` block on an error cancels what it
sent, so nothing keeps filling the caller's buffers.
"""

from __future__ import annotations

import os

import pytest

from cloudckpt.dcp.fetch import RangeFetcher
from cloudckpt.dcp.location import CheckpointLocation
from cloudckpt.errors import NotFoundError
from cloudckpt.options import resolve_options

CHUNK = 64 * 1024
DATA = os.urandom(16 * CHUNK)


@pytest.fixture
def location(tmp_path) -> CheckpointLocation:
    (tmp_path / "data").write_bytes(DATA)
    return CheckpointLocation(
        str(tmp_path), resolve_options(read_chunk_size=CHUNK, read_gap=0, read_concurrency=2)
    )


def _views(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


def test_a_streaming_fetcher_reads_while_requests_are_still_being_added(location):
    views = _views(8, CHUNK // 2)
    with RangeFetcher(location, stream=True) as fetcher:
        for i, view in enumerate(views[:2]):  # one chunk waiting: sent as one batch
            fetcher.add("data", i * CHUNK // 2, view)
        sent_early = fetcher.requests
        for i, view in enumerate(views[2:], start=2):
            fetcher.add("data", i * CHUNK // 2, view)
        fetcher.run()
    assert sent_early == 1
    assert b"".join(views) == DATA[: 4 * CHUNK]


def test_a_plain_fetcher_sends_nothing_before_run_and_joins_neighbours(location):
    views = _views(8, CHUNK // 8)
    done = []
    with RangeFetcher(location) as fetcher:
        for i, view in reversed(list(enumerate(views))):  # out of order: sorted per batch
            fetcher.add("data", 1000 + i * CHUNK // 8, view, lambda i=i: done.append(i))
        assert fetcher.requests == 0
        fetcher.run()
    assert fetcher.requests == 1
    assert sorted(done) == list(range(8))
    assert b"".join(views) == DATA[1000 : 1000 + CHUNK]


def test_a_failed_streamed_read_is_raised_by_run(location):
    fetcher = RangeFetcher(location, stream=True)
    with pytest.raises(NotFoundError, match="missing"), fetcher:
        fetcher.add("missing", 0, _views(1, 2 * CHUNK)[0])
        fetcher.run()


def test_leaving_on_an_error_cancels_what_was_sent_and_drops_the_rest(location):
    views = _views(4, CHUNK)
    waiting = memoryview(bytearray(CHUNK // 2))
    fetcher = RangeFetcher(location, stream=True)
    with pytest.raises(ValueError, match="planning failed"), fetcher:
        for i, view in enumerate(views):
            fetcher.add("data", i * CHUNK, view)
        fetcher.add("data", 8 * CHUNK, waiting)  # below a batch: not sent yet
        assert fetcher.requests == 4
        raise ValueError("planning failed")
    assert fetcher._group is None  # cancelled, running reads waited for
    fetcher.run()
    assert fetcher.requests == 4
    assert not any(waiting)
