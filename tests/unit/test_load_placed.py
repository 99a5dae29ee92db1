"""A plain load places every record from the directory before unpickling
(engine/records.py): small records in shared page-aligned blocks, each tensor still
over a storage of its own; large ones in storages of their own. With ``mmap=True``
every storage lies over a copy-on-write mapping of the file."""

from __future__ import annotations

import gc
import io
import threading
import zipfile

import pytest
import torch

import cloudckpt
from cloudckpt._runtime import switch
from cloudckpt.engine import load as load_mod
from cloudckpt.errors import (
    ChecksumError,
    ConfigError,
    NotAnObjectError,
    StorageError,
    UnsafeCheckpointError,
)
from cloudckpt.format.torch.unpickle import typed_storage
from cloudckpt.store.local import LocalStore
from dtypes import DTYPES
from faults import FaultyStore


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(512, 1024, generator=g)  # 2 MiB: a record of its own
    small = torch.randn(40, 16, generator=g)
    state: dict[str, object] = {
        "big": big,
        "big_rows": big[10:20],  # shares big's storage
        "small": small,
        "small_t": small.t(),  # shares small's storage, another layout
        "small_tail": small[30:],  # shares it at an offset
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "quantized": torch.quantize_per_tensor(torch.randn(6, generator=g), 0.1, 2, torch.qint8),
        "step": 7,
    }
    for i, dtype in enumerate(DTYPES):
        state[f"d{i}"] = torch.arange(24).to(dtype).reshape(4, 6)
    for i in range(300):
        state[f"n{i}"] = torch.randn(1 + i % 37, generator=g)
    return state


def _same(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert got.storage_offset() == want.storage_offset()
        if want.is_quantized:
            assert torch.equal(got.int_repr(), want.int_repr())
        else:
            as_bytes = [t.reshape(-1).contiguous().view(torch.uint8) for t in (got, want)]
            assert torch.equal(*as_bytes)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    else:
        assert got == want


def test_a_plain_load_equals_torch_load_and_keeps_storages_apart(tmp_path):
    state = _state()
    path = tmp_path / "s.pt"
    cloudckpt.save(state, path)
    got = cloudckpt.load(path)
    _same(got, torch.load(path, weights_only=True))

    # Views that shared a storage share it again; everything else has its own.
    def ptr(name: str) -> int:
        return got[name].untyped_storage().data_ptr()

    assert ptr("big") == ptr("big_rows") and ptr("small") == ptr("small_t") == ptr("small_tail")
    plain = [k for k in got if k.startswith(("n", "d")) or k in ("small", "big", "zero_d")]
    assert len({ptr(k) for k in plain}) == len(plain)
    for k in plain:
        storage = got[k].untyped_storage()
        assert storage.nbytes() == state[k].untyped_storage().nbytes()
        assert storage.data_ptr() % 64 == 0  # aligned as torch aligns records
        assert not storage.resizable()  # as torch.load's: none can grow (docs/security.md)
    # Writing one small tensor leaves its neighbours in the block as they were.
    got["n5"].fill_(0)
    _same(got["n4"], state["n4"])
    _same(got["n6"], state["n6"])
    # Saving one loaded tensor writes its own bytes, not its block's.
    alone = io.BytesIO()
    torch.save({"t": got["n6"]}, alone)
    fresh = io.BytesIO()
    torch.save({"t": state["n6"].clone()}, fresh)
    assert len(alone.getvalue()) == len(fresh.getvalue())


def test_a_tensor_keeps_its_block_alive_after_the_rest_is_dropped(tmp_path):
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(200)}
    cloudckpt.save(state, tmp_path / "k.pt")
    got = cloudckpt.load(tmp_path / "k.pt")
    kept = got["t123"]
    del got  # nothing cyclic: the other tensors are freed here
    junk = [torch.full((100,), -1.0) for _ in range(500)]  # reuse any freed memory
    assert torch.equal(kept, torch.full((100,), 123.0)) and junk


def _unpadded(state: dict[str, object], tmp_path) -> object:
    """``state`` saved by torch, then rewritten by another zip writer (no padding)."""
    torch.save(state, tmp_path / "t.pt")
    with (
        zipfile.ZipFile(tmp_path / "t.pt") as src,
        zipfile.ZipFile(tmp_path / "plain.pt", "w", zipfile.ZIP_STORED) as dst,
    ):
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return tmp_path / "plain.pt"


def test_records_not_aligned_as_torch_aligns_them_get_storages_of_their_own(tmp_path):
    """An archive rewritten by another zip writer (no padding) still loads exactly."""
    state = _state()
    got = cloudckpt.load(_unpadded(state, tmp_path))
    _same(got, state)
    assert got["n7"].untyped_storage().nbytes() == state["n7"].untyped_storage().nbytes()
    assert not got["n7"].untyped_storage().resizable()  # its own storage, fixed as any


@pytest.fixture
def counting(tmp_path, monkeypatch):
    store = FaultyStore(LocalStore(tmp_path))
    monkeypatch.setattr(load_mod, "open_target", store.opener())
    return store


def _feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cloudckpt-read-feeder"]


def test_a_failed_record_read_fails_the_load_and_stops_the_reads(tmp_path, counting):
    state = {f"t{i}": torch.randn(64, 64) for i in range(400)}  # 6.4 MiB in small records
    state["big"] = torch.randn(1 << 20)
    cloudckpt.save(state, tmp_path / "f.pt")
    # The first read is data.pkl; fail one of the records' reads, for good.
    counting.faults["read_into"] = lambda n: StorageError("injected") if n == 3 else None
    with pytest.raises(StorageError, match="injected"):
        cloudckpt.load("f.pt", read_chunk_size=1 << 20, read_concurrency=2)
    assert not _feeders()


def test_a_refused_pickle_stops_the_reads_it_started(tmp_path, counting):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    state = {f"t{i}": torch.randn(64, 64) for i in range(400)}
    state["evil"] = Evil()
    torch.save(state, tmp_path / "e.pt")
    with pytest.raises(UnsafeCheckpointError):
        cloudckpt.load("e.pt", read_chunk_size=1 << 20, read_concurrency=2)
    assert not _feeders()


def test_a_loaded_state_stays_young_unless_the_freeze_is_asked_for(tmp_path, monkeypatch):
    """The host's GC generations are its own: only with the opt-in (docs/runtime.md)
    does a load move what it built to the oldest generation."""
    state = {f"t{i}": torch.randn(4) for i in range(3000)}
    cloudckpt.save(state, tmp_path / "g.pt")
    gc.collect()
    got = cloudckpt.load(tmp_path / "g.pt")
    young = {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}
    assert id(got) in young
    del got
    monkeypatch.setattr(switch, "_freeze", True)
    got = cloudckpt.load(tmp_path / "g.pt")
    young = {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}
    assert not any(id(t) in young for t in got.values()) and id(got) not in young


def test_objects_the_program_froze_stay_frozen(tmp_path):
    cloudckpt.save({"t": torch.randn(4)}, tmp_path / "z.pt")
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        got = cloudckpt.load(tmp_path / "z.pt")
        # Frozen objects freed meanwhile leave the count; an unfreeze would empty it.
        assert frozen // 2 < gc.get_freeze_count() <= frozen
        young = {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}
        assert id(got) in young  # not promoted: that would have thawed the program's
    finally:
        gc.unfreeze()


def test_typed_storages_are_what_the_constructor_makes():
    storage = torch.UntypedStorage(8)
    fast = typed_storage(storage, torch.float16)
    slow = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float16, _internal=True)
    assert type(fast) is type(slow) and vars(fast).keys() == vars(slow).keys()
    assert fast.dtype is slow.dtype and fast._untyped_storage is storage
    assert fast.size() == slow.size() == 4


# -- mmap=True: storages over a copy-on-write mapping of the file -------------------------


def test_a_mapped_load_equals_torch_load_and_never_writes_the_file(tmp_path):
    state = _state()
    path = tmp_path / "m.pt"
    cloudckpt.save(state, path)
    before = path.read_bytes()
    got = cloudckpt.load(path, mmap=True)
    _same(got, torch.load(path, weights_only=True))
    mapped = torch.load(path, weights_only=True, mmap=True)  # torch's own mapped load
    _same(got, mapped)
    # Views that shared a storage share it again; the others have their own.
    assert got["big"].untyped_storage().data_ptr() == got["big_rows"].untyped_storage().data_ptr()
    assert got["n5"].untyped_storage().data_ptr() != got["n6"].untyped_storage().data_ptr()
    got["big"].fill_(0)  # copy-on-write: this process's pages only
    got["n5"].add_(1)
    assert path.read_bytes() == before
    _same(cloudckpt.load(path, mmap=True), state)


def test_a_mapped_tensor_outlives_its_file(tmp_path):
    path = tmp_path / "gone.pt"
    cloudckpt.save({"t": torch.arange(1 << 20, dtype=torch.float32)}, path)
    got = cloudckpt.load(path, mmap=True)
    path.unlink()  # a local tier's retention deletes files under restored tensors
    junk = [torch.full((1 << 18,), -1.0) for _ in range(8)]
    assert torch.equal(got["t"], torch.arange(1 << 20, dtype=torch.float32)) and junk


def test_a_mapped_load_checks_every_record_it_returns(tmp_path):
    state = {"a": torch.randn(1 << 16), "b": torch.randn(64)}
    path = tmp_path / "c.pt"
    cloudckpt.save(state, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    data[info.header_offset + 200] ^= 0xFF  # inside a's bytes, size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="data/0"):
        cloudckpt.load(path, mmap=True)
    # keys= checks only the records it returns
    assert torch.equal(cloudckpt.load(path, mmap=True, keys=["b"])["b"], state["b"])


def test_a_mapped_load_refuses_what_the_plain_load_refuses(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"t": torch.randn(4), "evil": Evil()}, tmp_path / "e.pt")
    with pytest.raises(UnsafeCheckpointError):
        cloudckpt.load(tmp_path / "e.pt", mmap=True)


def test_a_mapped_load_of_an_unaligned_archive_copies_those_records(tmp_path):
    state = _state()
    _same(cloudckpt.load(_unpadded(state, tmp_path), mmap=True), state)


def test_mmap_needs_a_store_that_is_the_filesystem(tmp_path, counting):
    cloudckpt.save({"t": torch.randn(4)}, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="not on a filesystem"):
        cloudckpt.load("x.pt", mmap=True)


def test_mmap_needs_a_torch_archive_in_a_file(tmp_path):
    cloudckpt.save({"t": torch.randn(4)}, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="exclude each other"):
        cloudckpt.load(tmp_path / "x.pt", mmap=True, share=True)
    with pytest.raises(ConfigError, match="safetensors"):
        cloudckpt.load(tmp_path / "x.safetensors", mmap=True)
    with pytest.raises(NotAnObjectError):
        cloudckpt.load(tmp_path, mmap=True)
