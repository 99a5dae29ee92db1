"""What a second outside attempt on the trust boundary found (issue 39, after the
memory-safety fixes), each file built here by code and loaded where a crash would show
(a forked child), each compared with ``torch.load(weights_only=True)``:

1. Memory held past what the pickle keeps: the machine held every object it made, so a
   ``data.pkl`` that makes a 10,000-element set and drops it, a thousand times over,
   held a thousand sets (about 1 GiB from 60 KiB; torch none).
2. A tensor's state that sets ``real`` (``_rebuild_from_type_v2(..., {'real': 0.0})``):
   ``t.real = 0`` writes into the storage while the reader threads still fill it: a
   false ``ChecksumError`` on a right file, or the file's values where torch gives 0.
3. A ``byteorder`` record that is neither ``little`` nor ``big`` (``middle``, bytes that
   are no text): accepted and swapped, or a bare ``UnicodeDecodeError``; torch refuses.
4. ``keys=`` of a structure nested deeper than pickle can walk: a bare ``RecursionError``.
5. A legitimate nested tensor, whose rebuild reads its sizes while the pickle is read:
   it must load as torch loads it whatever order the records arrive in.
"""

from __future__ import annotations

import array
import io
import pickle
import struct
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import craft
from craft import ops
from test_memory_safety_repro import MiB, _outcome, _peak, in_child

import cloudckpt
from cloudckpt import errors
from cloudckpt.format.torch import restricted_pickle
from cloudckpt.format.torch.unpickle import load_torch_bytes
from cloudckpt.store.local import LocalStore
from cloudckpt.store.registry import register_store
from faults import FaultyStore


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# --- 1. memory held past what the pickle keeps ------------------------------------------------


def _made_and_dropped(items: int, repeats: int) -> bytes:
    """``d = {1: L}`` for a list ``L`` of ``items`` ints, then ``d[0] = set(L)``
    ``repeats`` times (each set dropped by the next): 9 bytes of pickle per set."""
    body = ops.EMPTY_DICT + ops.int_(1)
    body += ops.list_(*(ops.int_(i) for i in range(items))) + ops.BINPUT(1) + ops.SETITEM
    body += ops.int_(0) + ops.GLOBAL("builtins", "set") + ops.BINPUT(2)
    body += ops.BINGET(1) + ops.TUPLE1 + ops.REDUCE + ops.SETITEM
    once = ops.int_(0) + ops.BINGET(2) + ops.BINGET(1) + ops.TUPLE1 + ops.REDUCE + ops.SETITEM
    return craft.torch_archive(craft.assemble(body + once * repeats))


def _peaks(path: Path) -> dict[str, Any]:
    return {
        "torch": _peak(lambda: torch.load(path, weights_only=True)),
        "cloudckpt": _peak(lambda: cloudckpt.load(path)),
        "bytes": _peak(lambda: load_torch_bytes(path.read_bytes())),
    }


def test_objects_the_pickle_dropped_are_not_held(tmp_path):
    path = _write(tmp_path, "dropped.pt", _made_and_dropped(10_000, 1_000))
    assert path.stat().st_size < 128 * 1024
    found = in_child(_peaks, path)
    assert "accepted" in found["torch"], found["torch"]
    for who in ("cloudckpt", "bytes"):
        assert "accepted" in found[who], (who, found[who])
        # torch holds one set at a time; so must we (it held all: about 500 MiB here)
        assert found[who]["peak"] <= found["torch"]["peak"] + 64 * MiB, (who, found)


# --- 2. a tensor's state that writes into its storage ----------------------------------------


def _state_sets(name: str, numel: int) -> bytes:
    """A float tensor of ``numel`` elements (the record holds 1.0s) rebuilt by
    ``_rebuild_from_type_v2`` with the state ``{name: 0.0}``."""
    storage = ops.storage("FloatStorage", "0", "cpu", numel)
    args = (
        storage
        + ops.int_(0)
        + ops.ints((numel,))
        + ops.ints((1,))
        + ops.NEWFALSE
        + ops.ordered_dict()
    )
    pkl = craft.assemble(
        ops.dict_(
            (
                ops.str_("w"),
                ops.GLOBAL("torch._tensor", "_rebuild_from_type_v2")
                + ops.MARK
                + ops.GLOBAL("torch._utils", "_rebuild_tensor_v2")
                + ops.GLOBAL("torch", "Tensor")
                + ops.MARK
                + args
                + ops.TUPLE
                + ops.dict_((ops.str_(name), ops.BINFLOAT(0.0)))
                + ops.TUPLE
                + ops.REDUCE,
            )
        )
    )
    # (no torch op here: a parallel one would leave OpenMP's threads to the forked child)
    return craft.torch_archive(pkl, {"0": (array.array("f", [1.0]) * numel).tobytes()})


def _loads(path: Path, unpickler: str) -> dict[str, Any]:
    cloudckpt.set_unpickler(unpickler)
    found = {}
    for name, load in {
        "torch": lambda: torch.load(path, weights_only=True)["w"].sum().item(),
        "load": lambda: cloudckpt.load(path)["w"].sum().item(),
        "keys": lambda: cloudckpt.load(path, keys=["w"])["w"].sum().item(),
        "mmap": lambda: cloudckpt.load(path, mmap=True)["w"].sum().item(),
        "bytes": lambda: load_torch_bytes(path.read_bytes())["w"].sum().item(),
    }.items():
        try:
            found[name] = ("value", load())
        except Exception as exc:
            found[name] = ("refused", type(exc).__name__, isinstance(exc, errors.CloudCkptError))
    return found


@pytest.mark.parametrize("numel", [256, 4 * MiB])  # a small record, and one read alone
def test_a_state_that_writes_into_the_storage_is_refused_never_a_false_checksum(tmp_path, numel):
    path = _write(tmp_path, "real.pt", _state_sets("real", numel))
    found = in_child(_loads, path, "cloudckpt")
    assert found["torch"] == ("value", 0.0), found  # torch sets it once its bytes are in
    for how in ("load", "keys", "mmap", "bytes"):
        assert found[how] == ("refused", "UnsafeCheckpointError", True), (how, found)


def test_under_torchs_unpickler_the_bytes_are_in_before_it_runs(tmp_path):
    """The switch hands the whole pickle to torch's unpickler, which may touch any tensor:
    the records are read and checked first, and the result is torch's."""
    path = _write(tmp_path, "real.pt", _state_sets("real", 4 * MiB))
    found = in_child(_loads, path, "torch")
    assert all(v == ("value", 0.0) for v in found.values()), found


def test_a_plain_attribute_in_a_tensors_state_still_loads(tmp_path):
    path = _write(tmp_path, "attr.pt", _state_sets("note", 4 * MiB))
    found = in_child(_loads, path, "cloudckpt")
    assert set(found.values()) == {("value", float(4 * MiB))}, found


# --- 3. and 4. the byte order, and structures nested too deep ---------------------------------


def _with_byteorder(order: bytes) -> bytes:
    pkl = craft.assemble(ops.dict_((ops.str_("w"), ops.tensor_v2(ops.storage(), 0, (4,), (1,)))))
    return craft.torch_archive(pkl, {"0": bytes(16)}, byteorder=order)


@pytest.mark.parametrize("order", [b"middle", b"\xff\xfe", b""])
def test_a_byteorder_neither_little_nor_big_is_damage(tmp_path, order):
    path = _write(tmp_path, "order.pt", _with_byteorder(order))
    with pytest.raises(Exception):  # noqa: B017  (torch: ValueError or UnicodeDecodeError)
        torch.load(path, weights_only=True)
    for load in (
        lambda: cloudckpt.load(path),
        lambda: cloudckpt.load(path, mmap=True),
        lambda: cloudckpt.load(path, keys=["w"]),
        lambda: load_torch_bytes(path.read_bytes()),
    ):
        with pytest.raises(errors.CorruptCheckpointError, match="byteorder"):
            load()


def test_big_endian_archives_still_load(tmp_path):
    value = torch.arange(6, dtype=torch.float32)
    pkl = craft.assemble(
        ops.dict_((ops.str_("w"), ops.tensor_v2(ops.storage(numel=6), 0, (6,), (1,))))
    )
    data = craft.torch_archive(pkl, {"0": value.numpy().byteswap().tobytes()}, byteorder=b"big")
    path = _write(tmp_path, "big.pt", data)
    assert torch.equal(torch.load(path, weights_only=True)["w"], value)
    assert torch.equal(cloudckpt.load(path)["w"], value)
    assert torch.equal(load_torch_bytes(data)["w"], value)


def _deep(depth: int) -> bytes:
    nested = ops.EMPTY_LIST * depth + ops.APPEND * (depth - 1)
    pkl = craft.assemble(
        ops.dict_(
            (ops.str_("a"), nested),
            (ops.str_("w"), ops.tensor_v2(ops.storage(), 0, (4,), (1,))),
        )
    )
    return craft.torch_archive(pkl, {"0": torch.ones(4).numpy().tobytes()})


def _deep_loads(path: Path) -> dict[str, Any]:
    return {
        "torch": _outcome(lambda: torch.load(path, weights_only=True)),
        "keys": _outcome(lambda: cloudckpt.load(path, keys=["a", "w"])),
        "plain": _outcome(lambda: cloudckpt.load(path)),
    }


def test_keys_of_a_structure_nested_deeper_than_pickle_walks(tmp_path):
    path = _write(tmp_path, "deep.pt", _deep(100_000))
    found = in_child(_deep_loads, path)
    assert found["torch"] == found["plain"] == found["keys"] == {"accepted": 16}, found


# --- 5. a rebuild that reads tensors while the pickle is read ----------------------------------


class _HeldReads(FaultyStore):
    """A filesystem store whose reads into the storage records (bytes ``held``; the
    directory's read of the tail is not one) wait until
    the unpickler asks for the bytes (``RestrictedUnpickler._settled``), or 10 s: the
    order a slow network gives, made certain."""

    def __init__(self, root: Path, held: range, released: threading.Event) -> None:
        super().__init__(LocalStore(root))
        self.held = held
        self.released = released

    def _read_into(self, key: str, start: int, views: Any) -> Any:
        if start in self.held:
            self.released.wait(10)
        return self.inner._read_into(key, start, views)


def _nested(root: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(rows, 256, generator=g) for rows in (300, 700, 500)]
    state = {
        "big": torch.randn(1 << 20, generator=g),  # a record read alone
        "n": torch.nested.nested_tensor(parts),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    (root / "q.pt").write_bytes(buf.getvalue())
    with zipfile.ZipFile(root / "q.pt") as zf:
        records = [i for i in zf.infolist() if "/data/" in i.filename]
        held = range(
            min(i.header_offset for i in records),
            max(i.header_offset + i.file_size for i in records) + 1024,
        )
    released = threading.Event()
    settled = getattr(restricted_pickle.RestrictedUnpickler, "_settled", lambda self: None)

    def settle_and_release(self: Any) -> None:
        released.set()
        settled(self)

    restricted_pickle.RestrictedUnpickler._settled = settle_and_release  # type: ignore[method-assign]
    register_store("heldreads", lambda bucket, options: _HeldReads(root, held, released))
    theirs = torch.load(root / "q.pt", weights_only=True)
    found = {}
    for how, load in {
        "load": lambda: cloudckpt.load("heldreads://b/q.pt"),
        "keys": lambda: cloudckpt.load("heldreads://b/q.pt", keys=["n"]),
        "mmap": lambda: cloudckpt.load(root / "q.pt", mmap=True),
    }.items():
        released.clear()
        ours = load()
        found[how] = all(
            torch.equal(mine, theirs_part)
            for mine, theirs_part in zip(ours["n"].unbind(), theirs["n"].unbind(), strict=True)
        ) and len(ours["n"].unbind()) == len(parts)
    return found


def test_a_rebuild_that_reads_tensors_sees_their_bytes(tmp_path):
    """A nested tensor's rebuild reads its sizes, strides and offsets (tensors of their
    own records) while the pickle is read: the records are in before it runs, however
    late the network brings them."""
    found = in_child(_nested, tmp_path)
    assert all(found.values()), found


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


def test_a_storage_where_a_persistent_id_names_its_kind_is_never_formatted(tmp_path):
    """Found by ``make fuzz`` (seed 11, cases 10250 and 56773): a persistent id whose
    first field is a storage the pickle loaded (a million floats). Telling it from
    ``"storage"`` called ``str()`` on it, which formats every element: 100 MiB and
    seconds from 30 bytes of pickle, before the refusal. torch refuses it too."""
    storage_id = (
        b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu")
        + b"J" + struct.pack("<i", 1 << 20) + b"tQ"
    )  # fmt: skip
    pkl = b"\x80\x02(" + storage_id + _text("x") + b"tQ."  # (storage, "x") as an id
    path = tmp_path / "pid.pt"
    path.write_bytes(craft.torch_archive(pkl, {"0": bytes(4 * MiB)}))
    found = in_child(_peak, lambda: cloudckpt.load(str(path)))
    assert found.get("refused") == "UnsafeCheckpointError", found
    assert "persistent id" in found["message"]
    assert found["peak"] < 48 * MiB, found
    with pytest.raises(pickle.UnpicklingError):  # torch refuses it as well
        torch.load(path, weights_only=True)
