"""The Store contract, run against every backend: filesystem, moto, rclone, GCS, Azure.

Each test gets a fresh bucket (or temp directory) from the ``store_url`` fixture and
talks to the store object itself, below the engine. Where a server is known to differ
(conditional create, credential checks) the expectation is stated per store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from cloudckpt.engine.proof import multipart_etag
from cloudckpt.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    CredentialsError,
    NotFoundError,
)
from cloudckpt.options import resolve_options
from cloudckpt.store import Store, open_url
from conftest import STORES, make_target
from servers import StoreTarget

MiB = 1 << 20

#: Stores that refuse a create-only write over an existing object. rclone ignores
#: ``If-None-Match``; gcp-storage-emulator ignores ``ifGenerationMatch`` (real GCS
#: enforces it).
ENFORCES_IF_NONE_MATCH = {"file", "memory", "moto", "azure"}
#: Stores that check credentials (moto accepts any; the GCS emulator takes none).
CHECKS_CREDENTIALS = {"rclone", "azure"}


@dataclass
class Place:
    """A store and a key prefix inside it that belongs to this test alone."""

    name: str
    store: Store
    prefix: str

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative


@pytest.fixture(params=["memory", *STORES])
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreTarget]:
    """Every store of the suite, and the in-memory one: the same contract for all."""
    yield from make_target(request, request.param, tmp_path)


@pytest.fixture
def place(store_url) -> Place:
    store, key = open_url(
        f"{store_url.base_url}/t", resolve_options(storage_options=store_url.storage_options)
    )
    return Place(store_url.name, store, key)


def _pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ at every offset modulo 251 (so a shifted read shows)."""
    block = bytes((i * 7 + seed) % 251 for i in range(251))
    return (block * (n // 251 + 1))[:n]


def _keys(place: Place, prefix: str = "") -> list[str]:
    return [info.key for info in place.store.list(place.key(prefix))]


# ------------------------------------------------------------------------ put / get


def test_put_head_get(place: Place) -> None:
    data = _pattern(100_000)
    place.store.put(place.key("obj.bin"), data)
    info = place.store.head(place.key("obj.bin"))
    assert info.key == place.key("obj.bin")
    assert info.size == len(data)
    assert info.mtime is not None and info.mtime > 0
    assert place.store.get(place.key("obj.bin")) == data


def test_head_and_list_agree(place: Place) -> None:
    place.store.put(place.key("e/1"), b"one")
    place.store.put(place.key("e/2"), b"two!")
    listed = {i.key: i for i in place.store.list(place.key("e/"))}
    for rel in ("e/1", "e/2"):
        head = place.store.head(place.key(rel))
        assert listed[head.key].size == head.size
        assert listed[head.key].etag == head.etag
    if listed[place.key("e/1")].etag is not None:  # a new version gets a new etag
        place.store.put(place.key("e/1"), b"uno")
        assert place.store.head(place.key("e/1")).etag != listed[place.key("e/1")].etag


#: Stores whose objects have no ETag (the filesystem: a commit checks sizes there).
NO_ETAG = {"file"}
#: rclone answers a completed multipart upload with the multipart ETag and lists the
#: content's MD5: the commit compares only ETags of one form (engine/proof.replaced).
LISTS_ANOTHER_FORM = {"rclone"}


def test_put_returns_the_etag_listings_show(place: Place) -> None:
    """What a commit checks against its listing (manager/marker.Written): the ETag of the
    object this put made, the same as the listing's and the HEAD's, and another
    object's (same size, other bytes) differs from it."""
    made = place.store.put(place.key("tag/a"), b"first bytes")
    listed = {i.key: i.etag for i in place.store.list(place.key("tag/"))}
    if place.name in NO_ETAG:
        assert made is None and listed[place.key("tag/a")] is None
        return
    assert made and made == listed[place.key("tag/a")] == place.store.head(place.key("tag/a")).etag
    again = place.store.put(place.key("tag/a"), b"other bytes")  # the same size
    assert again and again != made
    assert again == place.store.head(place.key("tag/a")).etag


def test_complete_multipart_returns_the_etag_listings_show(place: Place) -> None:
    key = place.key("tag/mp.bin")
    parts = [_pattern(5 * MiB, seed=4), _pattern(1000, seed=5)]
    upload, uploaded = _upload_parts(place, key, parts, lambda ix: ix)
    made = place.store.complete_multipart(upload, uploaded)
    listed = {i.key: i.etag for i in place.store.list(place.key("tag/"))}
    if place.name in NO_ETAG:
        assert made is None
        return
    if place.name in LISTS_ANOTHER_FORM:
        assert made and multipart_etag(made) and not multipart_etag(listed[key] or "")
        return
    assert made and made == listed[key] == place.store.head(key).etag


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "float-view"])
def test_put_accepts_any_buffer(place: Place, kind: str) -> None:
    raw = bytearray(_pattern(4096, seed=3))
    data: bytes | bytearray | memoryview = {
        "bytearray": raw,
        "memoryview": memoryview(raw)[16:],
        "float-view": memoryview(raw).cast("f"),
    }[kind]
    place.store.put(place.key("buf"), data)
    assert place.store.get(place.key("buf")) == memoryview(data).tobytes()


def test_empty_object(place: Place) -> None:
    place.store.put(place.key("empty"), b"")
    assert place.store.head(place.key("empty")).size == 0
    assert place.store.get(place.key("empty")) == b""
    assert place.key("empty") in _keys(place)


def test_overwrite_replaces_whole_object(place: Place) -> None:
    place.store.put(place.key("o"), _pattern(5000, seed=1))
    place.store.put(place.key("o"), b"short")
    assert place.store.get(place.key("o")) == b"short"


def test_keys_with_spaces_unicode_and_depth(place: Place) -> None:
    keys = ["a b/c+d.pt", "ünï/cödé.bin", "deep/x/y/z/w.bin", "q?x=1&y#2"]
    for i, rel in enumerate(keys):
        place.store.put(place.key(rel), bytes([i]) * (i + 1))
    for i, rel in enumerate(keys):
        assert place.store.get(place.key(rel)) == bytes([i]) * (i + 1)
    assert sorted(_keys(place)) == sorted(place.key(k) for k in keys)


# ---------------------------------------------------------------------- ranged reads


def test_get_range(place: Place) -> None:
    data = _pattern(300_000)
    place.store.put(place.key("r"), data)
    for start, end in [(0, 1), (1, 2), (250, 100_000), (299_999, 300_000), (0, 300_000)]:
        assert place.store.get_range(place.key("r"), start, end) == data[start:end]


def test_read_into_scatters_over_buffers(place: Place) -> None:
    data = _pattern(200_000, seed=9)
    place.store.put(place.key("s"), data)
    sizes = [7, 0, 65_536, 1, 100_000]
    buffers = [bytearray(n) for n in sizes]
    start = 1234
    place.store.read_into(place.key("s"), start, [memoryview(b) for b in buffers])
    assert b"".join(buffers) == data[start : start + sum(sizes)]


def test_read_into_typed_buffer(place: Place, request: pytest.FixtureRequest) -> None:
    data = _pattern(4000, seed=5)
    place.store.put(place.key("f"), data)
    target = bytearray(4000)
    place.store.read_into(place.key("f"), 0, [memoryview(target).cast("f")])
    assert bytes(target) == data


def test_read_past_the_end_is_an_error(place: Place) -> None:
    place.store.put(place.key("short"), _pattern(1000))
    with pytest.raises((CorruptCheckpointError, NotFoundError)):
        place.store.get_range(place.key("short"), 900, 1100)
    with pytest.raises((CorruptCheckpointError, NotFoundError)):
        place.store.read_into(place.key("short"), 2000, [memoryview(bytearray(10))])


# --------------------------------------------------------------------- list / delete


def test_list_is_recursive_sorted_and_prefix_exact(place: Place) -> None:
    rels = ["a/b/1", "a/b/2", "a/bc", "a/b/c/3", "b/1", "ab"]
    for rel in rels:
        place.store.put(place.key(rel), rel.encode())
    listed = list(place.store.list(place.key("a/b")))
    got = [i.key for i in listed]
    assert got == sorted(place.key(r) for r in ["a/b/1", "a/b/2", "a/b/c/3", "a/bc"])
    assert {i.key: i.size for i in listed} == {
        place.key(r): len(r) for r in ["a/b/1", "a/b/2", "a/b/c/3", "a/bc"]
    }
    assert _keys(place, "a/b/") == sorted(place.key(r) for r in ["a/b/1", "a/b/2", "a/b/c/3"])
    assert _keys(place, "nothing-here/") == []


def test_delete(place: Place) -> None:
    place.store.put(place.key("d/1"), b"1")
    place.store.put(place.key("d/2"), b"2")
    place.store.delete(place.key("d/1"))
    assert _keys(place, "d/") == [place.key("d/2")]
    with pytest.raises(NotFoundError):
        place.store.head(place.key("d/1"))
    place.store.delete(place.key("d/1"))  # absent: not an error
    place.store.delete(place.key("never-was"))


# ------------------------------------------------------------------ conditional put


def test_if_none_match_creates_when_absent(place: Place) -> None:
    place.store.put(place.key("m"), b"first", if_none_match=True)
    assert place.store.get(place.key("m")) == b"first"


def test_if_none_match_when_present(place: Place, request: pytest.FixtureRequest) -> None:
    place.store.put(place.key("m"), b"first")
    if place.name in ENFORCES_IF_NONE_MATCH:
        with pytest.raises(AlreadyExistsError):
            place.store.put(place.key("m"), b"second", if_none_match=True)
        assert place.store.get(place.key("m")) == b"first"
    else:  # documented quirk of this server: the condition is ignored
        place.store.put(place.key("m"), b"second", if_none_match=True)
        assert place.store.get(place.key("m")) == b"second"


# ------------------------------------------------------------------------ multipart


def _upload_parts(
    place: Place, key: str, parts: list[bytes], order: Callable[[list[int]], list[int]]
) -> tuple[object, list]:
    store = place.store
    upload = store.create_multipart(key)
    offsets = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            results[i] = store.upload_part(upload, i + 1, parts[i], offsets[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in order(list(range(len(parts))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return upload, [results[i] for i in range(len(parts))]


def test_multipart_complete(place: Place) -> None:
    key = place.key("mp/obj.bin")
    parts = [_pattern(5 * MiB, seed=1), _pattern(5 * MiB, seed=2), _pattern(12345, seed=3)]
    upload, uploaded = _upload_parts(place, key, parts, lambda ix: ix[::-1])
    assert [p.number for p in uploaded] == [1, 2, 3]
    assert [p.size for p in uploaded] == [len(p) for p in parts]
    with pytest.raises(NotFoundError):
        place.store.head(key)  # nothing visible before complete
    assert _keys(place, "mp/") == []
    place.store.complete_multipart(upload, uploaded)
    data = b"".join(parts)
    assert place.store.head(key).size == len(data)
    assert place.store.get(key) == data
    assert _keys(place, "mp/") == [key]  # no part objects left in listings
    assert [u.upload_id for u in place.store.list_multipart(place.key("mp/"))] == []


def test_multipart_abort_leaves_nothing(place: Place) -> None:
    key = place.key("ab/obj.bin")
    upload, _ = _upload_parts(place, key, [_pattern(5 * MiB), b"tail"], lambda ix: ix)
    place.store.abort_multipart(upload)
    with pytest.raises(NotFoundError):
        place.store.head(key)
    assert _keys(place, "ab/") == []
    assert [u.upload_id for u in place.store.list_multipart(place.key("ab/"))] == []
    place.store.abort_multipart(upload)  # twice: still fine
    place.store.put(key, b"later")  # the key is usable afterwards
    assert place.store.get(key) == b"later"


def test_multipart_abort_keeps_an_existing_object(place: Place) -> None:
    key = place.key("keep.bin")
    place.store.put(key, b"committed before")
    upload, _ = _upload_parts(place, key, [_pattern(5 * MiB), b"tail"], lambda ix: ix)
    place.store.abort_multipart(upload)
    assert place.store.get(key) == b"committed before"


def test_list_multipart_finds_open_uploads_by_prefix(place: Place) -> None:
    a, _ = _upload_parts(place, place.key("lm/a/x.bin"), [b"a" * 100], lambda ix: ix)
    b, _ = _upload_parts(place, place.key("lm/b/y.bin"), [b"b" * 100], lambda ix: ix)
    try:
        under_a = list(place.store.list_multipart(place.key("lm/a/")))
        assert [(u.key, u.upload_id) for u in under_a] == [(a.key, a.upload_id)]
        both = {(u.key, u.upload_id) for u in place.store.list_multipart(place.key("lm/"))}
        assert both == {(a.key, a.upload_id), (b.key, b.upload_id)}
    finally:
        place.store.abort_multipart(a)
        place.store.abort_multipart(b)
    assert list(place.store.list_multipart(place.key("lm/"))) == []


# --------------------------------------------------------------------------- errors


def test_missing_object(place: Place) -> None:
    key = place.key("missing.bin")
    with pytest.raises(NotFoundError) as info:
        place.store.head(key)
    assert not isinstance(info.value, BucketNotFoundError)
    assert "missing.bin" in str(info.value)
    with pytest.raises(NotFoundError):
        place.store.get_range(key, 0, 10)
    with pytest.raises(NotFoundError):
        place.store.read_into(key, 0, [memoryview(bytearray(10))])
    with pytest.raises(NotFoundError) as info:
        place.store.get(key)
    assert not isinstance(info.value, BucketNotFoundError)


def _missing_bucket(store_url) -> tuple[Store, str]:
    if store_url.server is None:
        pytest.skip(f"{store_url.name} has no buckets that can be missing")
    scheme = store_url.base_url.split("://", 1)[0]
    url = f"{scheme}://no-such-bucket-{store_url.bucket}"[:60] + "/k"
    return open_url(url, resolve_options(storage_options=store_url.storage_options))


def test_missing_bucket_list(store_url) -> None:
    store, _ = _missing_bucket(store_url)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        list(store.list(""))


def test_missing_bucket_head(store_url, request: pytest.FixtureRequest) -> None:
    store, key = _missing_bucket(store_url)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        store.head(key)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        store.get(key)


def test_bad_credentials(store_url) -> None:
    if store_url.name not in CHECKS_CREDENTIALS:
        pytest.skip(f"{store_url.name} does not check credentials")
    opts = dict(store_url.storage_options)
    secret = "d3Jvbmctc2VjcmV0LWtleS1mb3ItdGVzdHM="  # base64, as Azure keys are
    if "connection_string" in opts:
        conn = opts["connection_string"]
        start = conn.index("AccountKey=") + len("AccountKey=")
        opts["connection_string"] = conn[:start] + secret + conn[conn.index(";", start) :]
    else:
        opts["aws_secret_access_key"] = secret
    store, key = open_url(f"{store_url.base_url}/creds/k", resolve_options(storage_options=opts))
    # Azurite answers a bad signature with 403 AuthorizationFailure, which real Azure
    # uses for "not permitted" (it sends AuthenticationFailed for bad signatures).
    expected = AccessDeniedError if store_url.name == "azure" else CredentialsError
    with pytest.raises(expected) as info:
        store.put(key, b"x")
    assert secret not in str(info.value)
    with pytest.raises(expected):
        list(store.list("creds/"))


def test_unknown_storage_option(store_url) -> None:
    opts = {**store_url.storage_options, "no_such_option": 1}
    with pytest.raises(ConfigError, match="no_such_option"):
        open_url(f"{store_url.base_url}/k", resolve_options(storage_options=opts))
