"""The archive builder (``format/torch/archive_writer.py``) writes ``torch.save``'s bytes.

Every case compares the built archive with ``torch.save`` of the same object, byte for
byte, so ``torch.load`` and every other reader of torch archives read it as before;
then checks that ``cloudckpt.save`` (which uses the builder) and ``torch.load`` of the
stored file agree, and that what the builder does not write still goes to torch.save.
"""

from __future__ import annotations

import collections
import io
import struct

import pytest
import torch

import cloudckpt
from cloudckpt._runtime import probes
from cloudckpt.engine import save as save_mod
from cloudckpt.errors import UnpicklableError
from cloudckpt.format.torch import archive_writer
from cloudckpt.format.torch.archive_writer import plan_archive, writer_on
from cloudckpt.format.torch.ziprecords import torch_save
from dtypes import DTYPES


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as bytes (any dtype, any layout)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _built(obj: object, borrow_min: int = 64 << 10) -> bytes:
    plan = plan_archive(obj)
    assert plan is not None, "the builder declined a plain object"
    out = b"".join(bytes(view) for view, _ in plan.pieces(borrow_min))
    assert len(out) <= plan.size_hint
    return out


def _assert_same(obj: object, borrow_min: int = 64 << 10) -> bytes:
    built = _built(obj, borrow_min)
    expected = torch_save(obj)
    assert built == expected, _first_difference(built, expected)
    return built


def _first_difference(a: bytes, b: bytes) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"sizes {len(a)} vs {len(b)}; first difference at byte {at}"


def test_the_builder_is_on_with_torch_defaults():
    assert writer_on()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_layout_is_byte_identical(dtype):
    base = _random((6, 10), dtype)
    obj = {
        "matrix": base,
        "transposed": base.t(),  # a view: same storage, other strides
        "rows": base[2:4],  # a view at an offset
        "scalar": _random((), dtype, seed=1),
        "empty": torch.empty(0, dtype=dtype),
        "empty_2d": torch.empty(3, 0, dtype=dtype),
        "large": _random((300, 300), dtype, seed=2),  # over borrow_min for every dtype
    }
    built = _assert_same(obj)
    out = torch.load(io.BytesIO(built), weights_only=True)
    for name, tensor in obj.items():
        got = out[name]
        assert got.dtype == dtype and got.stride() == tensor.stride(), name
        assert torch.equal(_raw(got), _raw(tensor)), name
    assert out["rows"].untyped_storage().data_ptr() == out["matrix"].untyped_storage().data_ptr()


def test_objects_torch_reduces_itself_are_byte_identical():
    shared = torch.arange(10.0)
    leaf = torch.ones(3, requires_grad=True)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    obj = {
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "param": torch.nn.Parameter(torch.randn(4, 4)),
        "leaf": leaf,  # requires_grad
        "grad_out": leaf * 2,  # a non-leaf with a grad_fn: torch saves it as data
        "conj": torch.randn(3, dtype=torch.complex64).conj(),  # conj bit: torch's path
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag,  # neg bit
        "sparse": sparse,
        "csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.randn(5), 0.1, 2, torch.qint8),
        "untyped": torch.arange(6, dtype=torch.uint8).untyped_storage(),
        "typed": torch.arange(4, dtype=torch.float32).storage(),  # a TypedStorage
        "a": shared[:5],
        "b": shared[5:],
        "again": shared,  # the same tensor twice: pickle's memo
        "twice": [shared, shared],
        "plain": {"step": 7, "lr": 1e-3, "name": "x", "none": None, "bytes": b"\x00\x01"},
        "nested": (1, [2, (3, {"k": collections.OrderedDict(a=1)})]),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
    }
    built = _assert_same(obj)
    out = torch.load(io.BytesIO(built), weights_only=False)
    assert torch.equal(out["param"], obj["param"]) and isinstance(out["param"], torch.nn.Parameter)
    assert out["leaf"].requires_grad and out["conj"].is_conj()
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert out["again"] is out["twice"][0]


@pytest.mark.parametrize("borrow_min", [0, 1, 4096, 1 << 40])
def test_the_bytes_do_not_depend_on_what_is_borrowed(borrow_min):
    obj = {f"t{i}": _random((i * 37,), torch.float32, seed=i) for i in range(40)}
    obj["big"] = torch.randn(100_000)
    _assert_same(obj, borrow_min)


def test_small_records_fill_more_than_one_chunk(monkeypatch):
    monkeypatch.setattr(archive_writer, "CHUNK_BYTES", 1 << 14)
    obj = {f"t{i}": torch.full((1000,), float(i)) for i in range(50)}  # 4 KB records
    plan = plan_archive(obj)
    assert plan is not None
    pieces = list(plan.pieces(1 << 40))
    assert len(pieces) > 10
    assert b"".join(bytes(v) for v, _ in pieces) == torch_save(obj)


def test_more_records_than_the_classic_end_record_counts():
    # 65,600 storages: more than 0xFFFF records; the counts live in the zip64 end record
    # (untyped storages: the fewest pickled objects per record, so the test stays short).
    obj = [torch.UntypedStorage(1).fill_(i % 251) for i in range(65_600)]
    built = _assert_same(obj)
    classic = struct.unpack_from("<HH", built, len(built) - 22 + 8)
    assert classic == (0xFFFF, 0xFFFF)
    zip64_count = struct.unpack_from("<Q", built, built.rindex(b"PK\x06\x06") + 24)[0]
    assert zip64_count == 65_600 + 6


def test_storages_viewed_as_two_dtypes_raise_as_torch_does():
    base = torch.zeros(4)
    obj = [base, base.view(torch.int32)]
    with pytest.raises(RuntimeError, match="view the same data as different types") as ours:
        plan_archive(obj)
    with pytest.raises(RuntimeError) as theirs:
        torch_save(obj)
    assert str(ours.value) == str(theirs.value)


def test_what_torch_save_must_write_is_declined():
    # A storage off the CPU (here: on the meta device) is torch.save's to write.
    assert plan_archive({"meta": torch.empty(3, device="meta").untyped_storage()}) is None
    # A meta tensor is pickled without storage, as torch does.
    _assert_same({"meta": torch.empty(3, device="meta")})
    with torch.serialization.skip_data():
        assert not writer_on()
    assert writer_on()


def test_an_archive_over_4_gib_is_left_to_torch_save(monkeypatch):
    monkeypatch.setattr(archive_writer, "ZIP64_FROM", 1 << 20)
    assert plan_archive({"w": torch.zeros(1 << 18)}) is None  # 1 MiB of data
    assert plan_archive({"w": torch.zeros(1 << 10)}) is not None


def test_a_builder_that_disagrees_with_torch_turns_itself_off(monkeypatch):
    monkeypatch.delitem(probes._results, archive_writer.PROBE, raising=False)
    monkeypatch.setattr(archive_writer, "torch_save", lambda obj: b"other bytes")
    assert not writer_on()
    assert plan_archive({"w": torch.zeros(3)}) is None
    assert archive_writer.tensor_layout(torch.zeros(3), 12) is None


@pytest.mark.parametrize("form", ["object", "tensor"])
def test_the_check_covers_both_forms_of_the_builder(monkeypatch, form):
    """A form whose bytes differ from torch.save's on the probe set fails the one check:
    both forms are then off."""
    monkeypatch.delitem(probes._results, archive_writer.PROBE, raising=False)
    real = archive_writer.torch_save
    if form == "object":
        monkeypatch.setattr(archive_writer, "_object_bytes", lambda obj, found: b"other")
    else:
        monkeypatch.setattr(archive_writer, "_tensor_bytes", lambda t, found: real(t) + b"x")
    assert not archive_writer.builder_on() and not writer_on()
    assert plan_archive({"w": torch.zeros(3)}) is None
    assert archive_writer.tensor_layout(torch.zeros(3), 12) is None


def test_the_probe_set_covers_every_dtype_and_path():
    """Each dtype the format tests cover, both forms; the probe object holds what torch
    reduces itself, views, an empty and a borrowed storage."""
    tensors = archive_writer._probe_tensors()
    obj = archive_writer._probe_object()
    for dtype in DTYPES:
        assert any(t.dtype == dtype for t in tensors), dtype
        assert any(isinstance(v, torch.Tensor) and v.dtype == dtype for v in obj.values())
    assert any(not t.is_contiguous() for t in tensors)
    assert any(t.storage_offset() for t in tensors) and any(t.numel() == 0 for t in tensors)
    assert isinstance(obj["param"], torch.nn.Parameter) and obj["grad"].requires_grad
    assert obj["conj"].is_conj() and obj["big"].nbytes >= 16 << 10


def test_one_tensor_layouts_are_torch_saves_bytes():
    """The one-tensor form, filled with a storage's bytes and CRC-32: torch.save's."""
    found = archive_writer._constants()
    assert found is not None
    for t in (torch.randn(7), torch.arange(6, dtype=torch.int16).reshape(2, 3).t()):
        assert archive_writer._tensor_bytes(t, found) == torch_save(t)
    # What torch.save must write is declined.
    assert archive_writer.tensor_layout(torch.ones(2, requires_grad=True), 8) is None
    assert archive_writer.tensor_layout(torch.nn.Parameter(torch.ones(2)), 8) is None
    assert archive_writer.tensor_layout(torch.ones(2, dtype=torch.complex64).conj(), 16) is None


def test_a_builder_off_still_saves_through_torch_save(monkeypatch, tmp_path):
    monkeypatch.setitem(probes._results, archive_writer.PROBE, False)
    calls = []
    real = torch.save

    def counting(obj, f, *args, **kwargs):
        calls.append(1)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(save_mod.torch, "save", counting)
    state = {"w": torch.randn(100), "step": 3}
    cloudckpt.save(state, tmp_path / "off.pt")
    assert calls == [1]
    assert (tmp_path / "off.pt").read_bytes() == torch_save(state)


def test_cloudckpt_save_writes_torch_saves_bytes(tmp_path, monkeypatch):
    state = {
        "model": {f"layer{i}.weight": torch.randn(64, 64) for i in range(20)},
        "small": [torch.randn(3) for _ in range(50)],
        "big": torch.randn(300_000),  # borrowed: sent from its own memory
        "step": 10,
    }
    expected = torch_save(state)
    calls = []
    monkeypatch.setattr(save_mod.torch, "save", lambda *a, **k: calls.append(1))
    result = cloudckpt.save(state, tmp_path / "ckpt.pt", part_size=5 << 20)
    assert calls == [], "torch.save ran: the builder was not used"
    data = (tmp_path / "ckpt.pt").read_bytes()
    assert result.size == len(data)
    assert data == expected
    out = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert torch.equal(out["big"], state["big"]) and out["step"] == 10


def test_an_unpicklable_object_is_named_and_nothing_is_written(tmp_path):
    state = {"w": torch.randn(4), "opt": {"fn": lambda x: x}}
    with pytest.raises(UnpicklableError, match="opt"):
        cloudckpt.save(state, tmp_path / "bad.pt")
    assert list(tmp_path.iterdir()) == []
