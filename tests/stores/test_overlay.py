"""OverlayStore: one step's files, each from the local copy when held, else the bucket."""

from __future__ import annotations

import uuid

import pytest

from cloudckpt.errors import ConfigError, NotFoundError
from cloudckpt.store.memory import MemoryStore
from cloudckpt.store.overlay import OverlayStore


def _stores() -> tuple[MemoryStore, MemoryStore]:
    local, remote = MemoryStore(f"l-{uuid.uuid4().hex}"), MemoryStore(f"r-{uuid.uuid4().hex}")
    local.put("step-1/a", b"local a")
    local.put("step-1/stray", b"not listed by the marker")
    remote.put("run/step-1/a", b"remote a")
    remote.put("run/step-1/b", b"remote bb")
    remote.put("run/step-1/stray", b"the bucket's stray")
    return local, remote


def test_held_names_are_read_locally_and_the_rest_from_the_bucket() -> None:
    local, remote = _stores()
    view = OverlayStore(local, "step-1/", ["a"], remote, "run/step-1/", what="step 1")
    assert view.get("a") == b"local a"
    assert view.get("stray") == b"the bucket's stray"  # not listed: the bucket's copy
    buf = bytearray(4)
    view.read_into("b", 2, [memoryview(buf)])
    assert bytes(buf) == b"mote"
    assert view.head("b").key == "b" and view.head("b").size == 9
    assert view.url("a") == local.url("step-1/a") and view.url("b") == remote.url("run/step-1/b")
    assert view.remote_reads == (2, len(b"the bucket's stray") + 4)
    assert [(o.key, o.size) for o in view.list("")] == [("a", 7), ("b", 9), ("stray", 18)]


def test_without_the_bucket_a_name_not_held_is_not_found_naming_it_and_the_step() -> None:
    local, _ = _stores()
    view = OverlayStore(local, "step-1/", ["a"], None, "", what="step 1", hint="drain it")
    assert view.get("a") == b"local a"
    with pytest.raises(NotFoundError, match=r"^b of step 1 is not in the local copy.*; drain it$"):
        view.get("b")
    assert view.remote_reads == (0, 0)


def test_writes_are_refused() -> None:
    local, remote = _stores()
    view = OverlayStore(local, "step-1/", ["a"], remote, "run/step-1/", what="step 1")
    with pytest.raises(ConfigError, match="read-only"):
        view.put("a", b"x")
    with pytest.raises(ConfigError, match="read-only"):
        view.delete("b")
    assert local.get("step-1/a") == b"local a" and remote.get("run/step-1/b") == b"remote bb"


def test_a_peer_copy_serves_what_the_own_copy_lacks_before_the_bucket() -> None:
    local, remote = _stores()
    local.put("_peers/rank-0/step-1/b", b"peer b")
    local.put("_peers/rank-0/step-1/a", b"peer a")
    also = [("_peers/rank-0/step-1/", ["a", "b"])]
    view = OverlayStore(local, "step-1/", ["a"], remote, "run/step-1/", what="step 1", also=also)
    assert view.get("a") == b"local a"  # the own copy first
    assert view.get("b") == b"peer b"  # then the peer's, not the bucket's
    assert view.url("b") == local.url("_peers/rank-0/step-1/b")
    assert view.remote_reads == (0, 0)
    assert [(o.key, o.size) for o in view.list("")] == [("a", 7), ("b", 6), ("stray", 18)]
    alone = OverlayStore(local, "step-1/", ["a"], None, "", what="step 1", also=also)
    assert alone.get("b") == b"peer b"  # no bucket needed
