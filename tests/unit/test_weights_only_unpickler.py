"""The weights-only load: torch's allow-list over the C unpickler (format/torch/unpickle.py).

Every case is checked against ``torch.load(weights_only=True)`` of the same file: what
torch loads, cloudckpt loads equal (types, values, views, flags); what torch refuses,
cloudckpt refuses, and the refused code never runs.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from dtypes import DTYPES


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 255, (max(1, torch.Size(shape).numel() * dtype.itemsize),))
    return raw.to(torch.uint8)[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8))


def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` (cloudckpt) is what ``b`` (torch.load) is: type, value, tensor flags."""
    assert type(a) is type(b), where
    if isinstance(b, torch.Tensor):
        assert (a.dtype, a.shape, a.layout) == (b.dtype, b.shape, b.layout), where
        if b.layout == torch.strided:
            assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), where
        assert (a.requires_grad, a.is_conj(), a.is_neg()) == (
            b.requires_grad,
            b.is_conj(),
            b.is_neg(),
        ), where
        assert a._backward_hooks == b._backward_hooks, where
        if b.is_sparse or b.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if b.is_quantized:
            a, b = a.int_repr(), b.int_repr()
        assert bytes(
            a.resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)
        ) == bytes(b.resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)), where
    elif isinstance(b, dict):
        assert list(a) == list(b), where
        for k in b:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _both(path: Path) -> tuple[Any, Any]:
    return cloudckpt.load(str(path)), torch.load(path, weights_only=True)


def test_every_dtype_view_shared_storage_and_plain_object_loads_as_torch_loads(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    state: dict[str, Any] = {f"dtype.{d}": _tensor(d, (3, 5)) for d in DTYPES}
    state.update(
        {
            "empty": torch.empty(0, 4),
            "zero_d": torch.tensor(2.5),
            "base": base,
            "row": base[2],  # views of one storage, saved once
            "column": base[:, 3],
            "transposed": base.t(),
            "offset": base.view(-1)[5:17],
            "param": torch.nn.Parameter(torch.randn(3)),
            "frozen_param": torch.nn.Parameter(torch.randn(2), requires_grad=False),
            "requires_grad": torch.randn(4, requires_grad=True),
            "conj": torch.randn(3, dtype=torch.complex64).conj(),
            "neg": torch.randn(3, dtype=torch.complex64).conj().imag,
            "sparse_coo": torch.randn(4, 4).relu().to_sparse(),
            "sparse_csr": torch.randn(4, 4).relu().to_sparse_csr(),
            "objects": {
                "int": 3,
                "float": 1.5,
                "str": "s",
                "bytes": b"\x00\xff",
                "bytearray": bytearray(b"ab"),
                "none": None,
                "bool": True,
                "big_int": 2**70,
                "complex": 1 + 2j,
                "set": {1, 2},
                "tuple": (1, "x"),
                "ordered": collections.OrderedDict(b=1, a=2),
                "counter": collections.Counter("aab"),
                "size": torch.Size([2, 3]),
                "device": torch.device("cpu"),
                "dtype": torch.bfloat16,
            },
        }
    )
    path = tmp_path / "all.pt"
    cloudckpt.save(state, str(path))
    ours, theirs = _both(path)
    _same(ours, theirs)
    assert ours["row"].untyped_storage().data_ptr() == ours["base"].untyped_storage().data_ptr()
    assert ours["param"].requires_grad and isinstance(ours["param"], torch.nn.Parameter)


def test_archives_written_by_torch_save_load_as_torch_loads(tmp_path):
    torch.manual_seed(1)
    base = torch.arange(64, dtype=torch.float32)
    state = {"w": torch.randn(5, 7), "v": base[3:9], "b": base, "q": [torch.tensor(1), 2.0]}
    path = tmp_path / "torch.pt"
    torch.save(state, path)
    ours, theirs = _both(path)
    _same(ours, theirs)


def _archive(pkl: bytes, path: Path) -> Path:
    """A torch-layout zip archive (stored records) whose data.pkl is ``pkl``."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


def _payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that run ``touch marker`` when unpickled without restriction."""
    cmd = f"touch {marker}"
    py2_eval = b"c__builtin__\neval\n(V__import__('os').system('" + cmd.encode() + b"')\ntR."
    return {
        # GLOBAL + REDUCE (protocol 0-2)
        "global_reduce": b"cos\nsystem\n(V" + cmd.encode() + b"\ntR.",
        # STACK_GLOBAL (protocol 4)
        "stack_global": pickle.dumps(_Call(os.system, cmd), protocol=4),
        # INST (protocol 0): calls the class with the arguments
        "inst": b"(V" + cmd.encode() + b"\nios\nsystem\n.",
        # a builtin reached through its Python 2 name
        "py2_builtin": py2_eval,
    }


class _Call:
    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("name", ["global_reduce", "stack_global", "inst", "py2_builtin"])
def test_code_in_a_pickle_is_refused_as_torch_refuses_it_and_never_runs(tmp_path, name):
    marker = tmp_path / "ran"
    path = _archive(_payloads(marker)[name], tmp_path / f"{name}.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(errors.UnsafeCheckpointError, match="weights_only=False"):
        cloudckpt.load(str(path))
    assert not marker.exists()
    cloudckpt.load(str(path), weights_only=False)  # the payload is live: it runs unrestricted
    assert marker.exists()


def test_getattr_is_not_reachable_from_an_allowed_module(tmp_path):
    path = _archive(b"cbuiltins\ngetattr\n(ctorch\nTensor\nVnew\ntR.", tmp_path / "ga.pt")
    with pytest.raises(errors.UnsafeCheckpointError, match="getattr"):
        cloudckpt.load(str(path))


def test_the_refusal_names_the_global_as_torch_does(tmp_path):
    path = _archive(b"cos\nsystem\n(Vtrue\ntR.", tmp_path / "os.pt")
    with pytest.raises(errors.UnsafeCheckpointError) as ours:
        cloudckpt.load(str(path))
    with pytest.raises(pickle.UnpicklingError) as theirs:
        torch.load(path, weights_only=True)
    assert "os.system" in str(ours.value) and "add_safe_globals" in str(ours.value)
    assert "os.system" in str(theirs.value)


class Point:
    """A user class allowed by ``torch.serialization.add_safe_globals``."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x


def test_globals_the_user_allowed_load_and_only_while_allowed(tmp_path):
    path = tmp_path / "point.pt"
    torch.save({"p": Point(3), "t": torch.ones(2)}, path)
    with pytest.raises(errors.UnsafeCheckpointError, match="Point"):
        cloudckpt.load(str(path))
    with torch.serialization.safe_globals([Point]):
        ours, theirs = _both(path)
    assert ours["p"] == theirs["p"] == Point(3)
    with pytest.raises(errors.UnsafeCheckpointError, match="Point"):
        cloudckpt.load(str(path))
    assert cloudckpt.load(str(path), weights_only=False)["p"] == Point(3)


def test_a_damaged_pickle_is_corrupt_not_unsafe(tmp_path):
    good = io.BytesIO()
    pickle.dump({"a": 1}, good, protocol=2)
    path = _archive(good.getvalue()[:-3] + b"\xee\xee.", tmp_path / "damaged.pt")
    with pytest.raises(errors.CorruptCheckpointError):
        cloudckpt.load(str(path))


def test_a_memo_index_in_the_billions_loads_as_torch_loads_it(tmp_path):
    """LONG_BINPUT 2**31 on a valid pickle: the C unpickler's memo allocation is refused
    or granted; either way the load ends as torch's does (here: the value)."""
    pkl = b"\x80\x02K\x07r\x00\x00\x00\x80."  # PROTO 2, BININT1 7, LONG_BINPUT 2**31, STOP
    path = _archive(pkl, tmp_path / "memo.pt")
    assert torch.load(path, weights_only=True) == 7
    assert cloudckpt.load(str(path)) == 7
