"""The store seam: every public method checks, retries and maps; callers never retry.

FaultyStore (tests/faults.py) injects a fault at each backend primitive of an
in-memory store; the public method must retry it by the store's policy. The scheme
registry serves third-party stores; no module above the store layer retries by hand.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cloudckpt
from cloudckpt.errors import InvalidURLError, RetriesExhaustedError, TransientError
from cloudckpt.options import MiB
from cloudckpt.store import RetryPolicy, open_target, register_store
from cloudckpt.store.memory import MemoryStore, clear
from faults import PRIMITIVES, FaultyStore

FAST = RetryPolicy(max_attempts=3, backoff_base=0.001, backoff_max=0.002)
SRC = Path(cloudckpt.__file__).parent


@pytest.fixture
def faulty():
    store = FaultyStore(MemoryStore("seam-test")).with_retry(FAST)
    yield store
    clear("seam-test")


def _exercise(store, name: str) -> None:
    """Make one call of the public method ``name``."""
    store.put("a/obj", b"x" * 10)
    if name == "head":
        assert store.head("a/obj").size == 10
    elif name == "get":
        assert store.get("a/obj") == b"x" * 10
    elif name == "get_range":
        assert store.get_range("a/obj", 2, 5) == b"xxx"
    elif name == "read_into":
        buf = bytearray(4)
        store.read_into("a/obj", 0, [memoryview(buf)])
        assert buf == b"xxxx"
    elif name == "put":
        store.put("a/other", b"y")
    elif name == "delete":
        store.delete("a/obj")
    elif name == "list":
        assert [o.key for o in store.list("a/")] == ["a/obj"]
    elif name == "list_multipart":
        store.create_multipart("a/big")
        assert [u.key for u in store.list_multipart("a/")] == ["a/big"]
    else:
        upload = store.create_multipart("a/big")
        first = store.upload_part(upload, 1, b"p" * (5 * MiB), 0)
        views = [memoryview(b"q" * 3), memoryview(b"r" * 4)]
        second = store.upload_part_views(upload, 2, views, 5 * MiB)
        if name == "abort_multipart":
            store.abort_multipart(upload)
            assert list(store.list_multipart("a/")) == []
            return
        store.complete_multipart(upload, [first, second])
        assert store.get("a/big")[-7:] == b"qqqrrrr"


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_every_public_method_retries_its_primitive(faulty, name):
    faulty.faults[name] = lambda n: TransientError("503 SlowDown") if n == 1 else None
    _exercise(faulty, name)
    assert faulty.calls[name] >= 2, faulty.calls  # the first attempt failed, then retried


@pytest.mark.parametrize("name", ["head", "put", "upload_part_views", "list"])
def test_retries_end_with_a_typed_error_naming_the_url(faulty, name):
    faulty.faults[name] = lambda n: TransientError("503 SlowDown")
    with pytest.raises(RetriesExhaustedError, match=r"memory://seam-test/a/.*3 attempts"):
        _exercise(faulty, name)
    assert faulty.calls[name] == 3


def test_unsafe_keys_are_refused_before_any_request(faulty):
    for key in ("../x", "/abs", "a/../b", ""):
        with pytest.raises(InvalidURLError):
            faulty.put(key, b"x")
    assert faulty.calls == {}


def test_a_third_party_scheme_is_served_by_its_registered_factory():
    made = []

    def factory(bucket, options):
        made.append((bucket, options.read_concurrency))
        return MemoryStore(f"plugin-{bucket}")

    register_store("plugintest", factory)
    try:
        target = open_target("plugintest://b1/run/x.pt", read_concurrency=7)
        assert made == [("b1", 7)] and target.key == "run/x.pt"
        cloudckpt.save({"a": 1}, "plugintest://b1/run/x.pt")
        assert cloudckpt.load("plugintest://b1/run/x.pt", weights_only=False) == {"a": 1}
    finally:
        clear("plugin-b1")
    with pytest.raises(InvalidURLError, match="plugintest://"):
        open_target("nosuch://b/k")


def test_each_call_gets_its_own_retry_policy_on_shared_connections():
    a = open_target("memory://policies/x", max_attempts=2)
    b = open_target("memory://policies/x", max_attempts=5)
    assert (a.store.retry.max_attempts, b.store.retry.max_attempts) == (2, 5)
    assert a.store._data is b.store._data  # one cached store underneath
    clear("policies")


def test_connection_pools_follow_the_configured_concurrency():
    opts = cloudckpt.TransferOptions(read_concurrency=100, write_concurrency=50)
    assert opts.connection_pool_size == 150
    assert cloudckpt.TransferOptions().connection_pool_size == 64


def test_no_module_above_the_store_retries_by_hand():
    """Retrying lives in store/retry.py, used by store/base.py alone."""
    for path in SRC.rglob("*.py"):
        if path.parent.name == "store":
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(tree)
            if isinstance(n, (ast.Name, ast.Attribute))
        }
        assert not names & {"call_with_retries", "RetryPolicy"}, path
