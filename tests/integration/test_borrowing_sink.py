"""BorrowingSink: large writes go out from the caller's memory, on every store.

The DCP writer sends each large tensor record from the tensor itself: no part buffers,
no copy. Parts are then scatter lists (copied small writes between borrowed views);
every store must store them byte for byte, the owners must be let go once sent, and a
failure must leave nothing behind.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt._runtime.memview import buffer_address
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import NotFoundError
from cloudckpt.io.buffers import get_cache
from cloudckpt.io.sink import BorrowingSink
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url
from cloudckpt.store.s3 import S3Store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Owner:
    """Something a test can watch being released (tensors cannot be weakly referenced
    through every torch version's storage aliasing)."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)


def _pieces() -> list[tuple[str, bytes]]:
    """A mix like a torch.save archive's: small headers around large records."""
    gen = torch.Generator().manual_seed(1)
    out: list[tuple[str, bytes]] = []
    for i, size in enumerate((3 * MiB, 7 * MiB + 123, 64 * 1024, 11 * MiB)):
        out.append(("copy", f"header {i} ".encode() * 50))
        out.append(
            ("borrow", torch.randint(0, 256, (size,), generator=gen).byte().numpy().tobytes())
        )
    out.append(("copy", b"the end"))
    return out


def test_parts_mixing_copies_and_borrowed_views_are_stored_exactly(store_url) -> None:
    store, key = open_url(
        f"{store_url.base_url}/borrowed.bin",
        resolve_options(storage_options=store_url.storage_options),
    )
    opts = resolve_options(part_size=5 * MiB, write_concurrency=2)
    created = get_cache().created
    sink = BorrowingSink(store, key, opts)
    owners = []
    expected = b""
    for kind, data in _pieces():
        if kind == "copy":
            sink.write(data)
        else:
            owner = _Owner(data)
            owners.append(weakref.ref(owner))
            sink.write_borrowed(memoryview(owner.data), owner)
            del owner
        expected += data
    assert sink.commit() == len(expected)
    assert store.get(key) == expected
    assert get_cache().created == created  # no part buffer was made
    gc.collect()
    assert all(ref() is None for ref in owners)  # every owner let go once sent


def test_an_object_smaller_than_a_part_is_one_put(tmp_path) -> None:
    store, key = open_url(tmp_path / "small.bin", resolve_options())
    sink = BorrowingSink(store, key, resolve_options(part_size=5 * MiB))
    owner = _Owner(b"x" * 100_000)
    sink.write(b"head")
    sink.write_borrowed(memoryview(owner.data), owner)
    sink.commit()
    assert store.get(key) == b"head" + b"x" * 100_000


def test_abort_leaves_nothing_and_lets_owners_go(s3_server) -> None:
    bucket = s3_server.make_bucket(f"borrow-abort-{s3_server.name}")
    store, key = open_url(
        f"s3://{bucket}/obj", resolve_options(storage_options=s3_server.storage_options())
    )
    sink = BorrowingSink(store, key, resolve_options(part_size=5 * MiB))
    owner = _Owner(b"y" * (12 * MiB))
    ref = weakref.ref(owner)
    sink.write_borrowed(memoryview(owner.data), owner)  # two parts sent, one pending
    del owner
    sink.abort()
    with pytest.raises(NotFoundError):
        store.head(key)
    assert list(store.list_multipart("")) == []
    gc.collect()
    assert ref() is None


def test_dcp_save_sends_tensor_records_without_copies(s3_server, monkeypatch) -> None:
    bucket = s3_server.make_bucket(f"borrow-dcp-{s3_server.name}")
    url = f"s3://{bucket}/ckpt"
    opts = {"storage_options": s3_server.storage_options(), "part_size": 5 * MiB}
    parent = torch.randn(4 * MiB)
    state = {"a": parent[: 2 * MiB], "b": torch.randn(3 * MiB), "small": torch.arange(5)}
    sent = []
    real = S3Store.upload_part_views

    def spy(self, upload, number, views, offset):
        sent.append(list(views))
        return real(self, upload, number, views, offset)

    monkeypatch.setattr(S3Store, "upload_part_views", spy)
    created = get_cache().created
    dcp.save(state, storage_writer=CloudStorageWriter(url, **opts))
    assert get_cache().created == created
    # Parts are scatter lists that include views of the tensors' own memory.
    addresses = {t.data_ptr() for t in (state["a"], state["b"])}
    assert any(buffer_address(v) in addresses for views in sent for v in views)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=CloudStorageReader(url, storage_options=opts["storage_options"]))
    assert all(torch.equal(out[k], state[k]) for k in state)
