"""async_save's staging: small storages share pooled slabs, the archive stays torch's own.

Each state is saved with async_save and read back twice: by cloudckpt.load and by
torch.load of the object as written (a plain file, as a downloaded copy would be).
"""

from __future__ import annotations

import contextlib
import io
import zipfile

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.engine.staging import SLAB_BYTES, SMALL_MAX, get_pool, snapshot

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.fixture(autouse=True)
def _no_leftover_saves():
    yield
    with contextlib.suppress(Exception):
        cloudckpt.wait_all(timeout=60)


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (n,), generator=g, dtype=torch.int64).to(dtype)


def _round_trip(state, tmp_path, name="x.pt"):
    path = tmp_path / name
    cloudckpt.async_save(state, path).result(120)
    raw = path.read_bytes()
    return (
        cloudckpt.load(path, weights_only=False),
        torch.load(io.BytesIO(raw), weights_only=False),
        raw,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
    assert a.requires_grad == b.requires_grad
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    assert torch.equal(_bytes(a.untyped_storage()), _bytes(b.untyped_storage()))


def _bytes(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def test_many_small_tensors_of_every_dtype(tmp_path):
    state = {f"{dtype}-{i}": _tensor(dtype, 1 + 37 * i, i) for dtype in DTYPES for i in range(20)}
    for out in _round_trip(state, tmp_path)[:2]:
        assert out.keys() == state.keys()
        for key, value in state.items():
            _same(out[key], value)


def test_one_record_per_storage_views_and_sharing(tmp_path):
    base = torch.randn(8, 16)
    other = torch.arange(10, dtype=torch.int32)
    state = {
        "base": base,
        "t": base.t(),
        "row": base[3],
        "col": base[:, 5],
        "flat": base.view(-1)[7:40],
        "other": other,
        "again": other,  # the same tensor twice
        "alias": other[:],  # another tensor, same storage
        "nested": {"list": [base[1:3], other[2:]]},
    }
    for out in _round_trip(state, tmp_path)[:2]:
        for key in ("base", "t", "row", "col", "flat", "other", "alias"):
            _same(out[key], state[key])
        ptr = out["base"].untyped_storage().data_ptr()
        for key in ("t", "row", "col", "flat"):
            assert out[key].untyped_storage().data_ptr() == ptr
        assert out["nested"]["list"][0].untyped_storage().data_ptr() == ptr
        assert out["again"] is out["other"]
        other_ptr = out["other"].untyped_storage().data_ptr()
        assert out["alias"].untyped_storage().data_ptr() == other_ptr
    names = zipfile.ZipFile(tmp_path / "x.pt").namelist()
    assert len([n for n in names if "/data/" in n and not n.endswith("serialization_id")]) == 2


def test_empty_scalar_and_non_tensor_objects(tmp_path):
    state = {
        "empty": torch.empty(0),
        "empty2d": torch.zeros(3, 0, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "int0d": torch.tensor(7, dtype=torch.int16),
        "step": 12,
        "lr": 0.1,
        "name": "run",
        "none": None,
        "tuple": (1, (2, "x")),
        "bytes": b"\x00\x01",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(4)),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "storage": torch.arange(6, dtype=torch.float32).untyped_storage(),
    }
    for out in _round_trip(state, tmp_path)[:2]:
        for key in ("empty", "empty2d", "scalar", "int0d", "grad"):
            _same(out[key], state[key])
        assert isinstance(out["param"], torch.nn.Parameter)
        assert torch.equal(out["param"], state["param"])
        assert out["conj"].is_conj() and torch.equal(out["conj"], state["conj"])
        assert torch.equal(_bytes(out["storage"].untyped()), _bytes(state["storage"]))
        for key in ("step", "lr", "name", "none", "tuple", "bytes", "dtype", "size"):
            assert out[key] == state[key]


def test_mix_of_small_and_large_tensors(tmp_path):
    state = {
        "small": [_tensor(torch.float32, 100 + i, i) for i in range(300)],
        "edge": torch.randn(SMALL_MAX // 4),  # the largest slab part
        "above": torch.randn(SMALL_MAX // 4 + 1),  # a pool buffer of its own
        "large": torch.randn(3 << 20),
        "view": None,
    }
    state["view"] = state["large"][1000:2000]
    snap = snapshot(state)
    try:
        # One slab for the 301 small ones, one buffer each for "above" and "large".
        assert len(snap.storages) == 3
        assert sum(1 for _, offset, _ in snap.parts if offset < 0) == 2
    finally:
        snap.release()
    for out in _round_trip(state, tmp_path)[:2]:
        for got, want in zip(out["small"], state["small"], strict=True):
            _same(got, want)
        for key in ("edge", "above", "large", "view"):
            _same(out[key], state[key])
        assert out["view"].untyped_storage().data_ptr() == out["large"].untyped_storage().data_ptr()


def test_parts_are_separate_aligned_storages_in_slabs(tmp_path):
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(200)}
    snap = snapshot(state)
    try:
        assert len(snap.storages) == 1  # 200 small storages, one slab
        assert snap.storages[0].nbytes() == SLAB_BYTES
        offsets = [offset for _, offset, _ in snap.parts]
        assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)
        staged = snap.staged_storages()
        assert [s.nbytes() for s in staged] == [4 * (i + 1) for i in range(200)]
        obj = snap.materialize()
        for i in range(200):
            assert torch.equal(obj[f"t{i}"], state[f"t{i}"])
    finally:
        snap.release()


def test_mutation_right_after_return_does_not_reach_the_archive(tmp_path):
    small = [torch.full((64,), float(i)) for i in range(500)]
    large = torch.ones(2 << 20)
    state = {"small": small, "large": large, "step": 1}
    expected_small = [t.clone() for t in small]
    handle = cloudckpt.async_save(state, tmp_path / "m.pt")
    for t in small:
        t.mul_(-1).add_(123)
    large.zero_()
    small[0].resize_(3)
    state["step"] = 2
    state["small"].append(torch.zeros(1))
    handle.result(120)
    for out in (cloudckpt.load(tmp_path / "m.pt"), torch.load(tmp_path / "m.pt")):
        assert out["step"] == 1 and len(out["small"]) == 500
        for got, want in zip(out["small"], expected_small, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(out["large"], torch.ones(2 << 20))


def test_second_save_reuses_the_pool(tmp_path):
    pool = get_pool()
    state = {
        "small": [torch.randn(500 + i) for i in range(2000)],  # several slabs
        "large": torch.randn(1 << 20),
    }
    cloudckpt.async_save(state, tmp_path / "1.pt").result(120)
    allocated = pool.allocated_bytes
    for i in range(3):
        for t in state["small"]:
            t.add_(1)
        cloudckpt.async_save(state, tmp_path / f"{i + 2}.pt").result(120)
        assert pool.allocated_bytes == allocated
    out = torch.load(tmp_path / "4.pt")
    for got, want in zip(out["small"], state["small"], strict=True):
        assert torch.equal(got, want)


def test_a_staged_part_keeps_its_slab_alive():
    snap = snapshot({"a": torch.arange(10, dtype=torch.float32)})
    part = snap.staged_storages()[0]
    snap.release()
    get_pool().clear()  # the slab leaves the pool; the part still holds it
    assert torch.equal(torch.empty(0).set_(part), torch.arange(10, dtype=torch.float32))


def test_unpicklable_state_gives_back_its_slabs(tmp_path):
    pool = get_pool()
    pool.clear()
    with pytest.raises(errors.UnpicklableError):
        cloudckpt.async_save(
            {"w": [torch.zeros(10) for _ in range(10)], "fn": lambda: 1}, tmp_path / "x.pt"
        )
    assert pool.idle_bytes == pool.allocated_bytes


def test_a_snapshots_records_leave_the_young_generations_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the opt-in freeze (docs/runtime.md) the snapshot's per-tensor records go to
    the oldest generation when the collector resumes: the caller's next allocations do
    not start a young collection over them. Without it the host's generations are left
    as they are."""
    import gc

    from cloudckpt._runtime import switch
    from cloudckpt._runtime.gcpause import paused_gc

    state = {f"t{i}": torch.randn(4) for i in range(3000)}
    for freeze in (False, True):
        monkeypatch.setattr(switch, "_freeze", freeze)
        # Start from zero counts: the one young collection that the first allocation
        # after the pause sets off then moves survivors from generation 0 to 1, never
        # further (with the counts earlier tests left, it could be a generation-1 one).
        gc.collect()
        with paused_gc(kept=True):  # as async_save takes its snapshot
            snap = snapshot(state)
        try:
            young = {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}
            assert any(id(t) in young for t in snap.tensors) is not freeze
            assert snap.nbytes == 3000 * 16
        finally:
            snap.release()
