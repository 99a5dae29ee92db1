"""An endpoint that answers the headers at once, then trickles the body at 1 byte/s (F6).

Each byte restarts the socket's stall timer, so the stall timeout alone never gives up.
Without a deadline a request is still bounded (docs/configuration.md, ``deadline``):
each attempt of a small request (a listing) by ``connect_timeout + 2 x
metadata_timeout``, each body read by its stall timeout plus its size at
``MIN_BYTES_PER_SECOND``; then retried, ``max_attempts`` times in all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import cloudckpt
from cloudckpt.errors import CloudCkptError, RetriesExhaustedError
from cloudckpt.manager import CheckpointManager
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from trickle import TrickleServer

SETTINGS = {
    "connect_timeout": 1.0,
    "metadata_timeout": 2.0,
    "request_timeout": 3.0,
    "max_attempts": 2,
    "backoff_base": 0.01,
    "backoff_max": 0.02,
}


@pytest.fixture
def trickle() -> Iterator[TrickleServer]:
    server = TrickleServer(size=100_000, bytes_per_second=1.0)
    yield server
    server.close()


def _opts(server: TrickleServer) -> dict[str, object]:
    return {**SETTINGS, "storage_options": server.storage_options()}


def test_a_listing_trickled_in_is_abandoned_and_retried(trickle: TrickleServer) -> None:
    manager = CheckpointManager("s3://bkt/run1", **_opts(trickle))
    started = time.monotonic()
    with pytest.raises(CloudCkptError, match=r"s3://bkt"):
        manager.list()
    took = time.monotonic() - started
    assert took < 2 * (1 + 2 * 2) + 5, took  # two attempts of at most 5 s, and slack
    assert sum("list-type=2" in r for r in trickle.requests) == 2


def test_a_range_trickled_in_is_cut_and_retried(trickle: TrickleServer) -> None:
    store, key = open_url("s3://bkt/run1/x.pt", resolve_options(**_opts(trickle)))
    buf = bytearray(1000)
    started = time.monotonic()
    with pytest.raises(RetriesExhaustedError, match=r"did not arrive within") as info:
        store.read_into(key, 0, [memoryview(buf)])
    took = time.monotonic() - started
    assert "s3://bkt/run1/x.pt" in str(info.value)
    assert took < 2 * 3.1 + 5, took


def test_load_gives_up(trickle: TrickleServer) -> None:
    started = time.monotonic()
    with pytest.raises(CloudCkptError, match=r"s3://bkt/run1/x\.pt"):
        cloudckpt.load("s3://bkt/run1/x.pt", **_opts(trickle))
    assert time.monotonic() - started < 30
