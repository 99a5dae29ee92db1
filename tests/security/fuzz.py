"""Differential fuzzing of the trust boundary, torch's weights-only unpickler the oracle.

    python tests/security/fuzz.py --seed S --cases N [--jobs J]
        [--target all|classic|archive|metadata|attack|records] [--no-s3]

Each case is a file built from ``(seed, index)`` alone (so any case can be replayed with
``--case INDEX``), loaded by cloudckpt and by the oracle. The targets: ``archive`` and
``metadata`` (below), ``classic`` (both, 80:20), ``attack`` and ``records`` (issue 39,
below), and ``all``, the default and what ``make fuzz`` runs: the classic cases with
``attack`` (10 %) and ``records`` (0.4 %) cases mixed in (which index is which kind is
drawn apart from the case, so the classic cases of ``all`` are those of ``classic``).

* ``archive`` cases: a torch.save archive, loaded by ``torch.load(weights_only=True)``
  and by ``cloudckpt.format.torch.unpickle.load_torch_bytes`` (or, where that entry point is
  absent or with ``--entry file``, by ``cloudckpt.load`` of a temporary file). Their
  ``data.pkl`` is a real checkpoint's (of many kinds of state, see :func:`_states`)
  mutated at opcode boundaries, or a generated opcode sequence aimed at the
  constructors and mutators torch allows (:class:`Gen`), or both; a few also have
  their storage records or their zip bytes damaged.
* ``metadata`` cases: a DCP ``.metadata`` pickle (of torch's and cloudckpt's writers,
  in protocols 2 to 5) mutated or generated, given to
  ``cloudckpt.format.dcp.metadata.decode_metadata``. torch's weights-only unpickler
  does not run the protocol-4 opcodes DCP writes, so the oracle here is Python's own
  pickle machine restricted to the same allow-list (and refusing any mutation of a
  global, or any change to an object every load shares: an enum member, a dtype, a
  layout; :func:`shared_objects`); ``decode_metadata`` checks fields besides, so
  refusing more is expected.
* ``attack`` cases (:class:`Attack`): generated programs aimed at what the above
  rarely reach: every integer position (sizes, strides, offsets, a persistent id's
  element count, requires_grad) sometimes a bool, zero, a negative or a huge value;
  views that reach past their storage, share elements (stride 0) or overlap, also
  inside ``_rebuild_device_tensor_from_cpu_tensor`` (which copies them); BUILD states
  of every length (0-5 items; tuple, list, dict) on every kind of object the machine
  builds (tensors, parameters, containers, instances of allowed classes, what allowed
  calls return: enum members, dtypes, layouts, ``torch.Size``, ``torch.device``);
  SETITEM(S), APPEND(S) and BUILD on what allowed calls return, under both policies;
  the legacy size constructors with bools among the sizes. Small records, the run's
  entry point; a quarter are DCP ``.metadata``.
* ``records`` cases: archives of realistic size (1 to 3 records of 1-8 MiB, read by
  the reader threads straight into their storages while ``data.pkl`` is unpickled;
  one about the 256 KiB small-record threshold; a few small ones), a tensor over most
  records as torch.save writes it, and none to four attack statements (or that,
  mutated). cloudckpt's side is every real path: ``cloudckpt.load`` of a local file,
  of the same file with ``keys=[...]``, and (a quarter of the cases) of an ``s3://``
  object on one moto server the run starts (``--no-s3``, or no moto installed: files
  only); each is judged against torch's load (the ``keys`` one against torch's result
  cut to those keys).

Properties: the oracle refuses -> cloudckpt raises a ``CloudCkptError`` subclass (never
another exception, never a result); both accept -> the results are equal
(:func:`diff`: same types, key order, values, tensors' dtype, shape, strides, offset,
flags and bytes, the same sharing of objects and storages); the oracle accepts and
cloudckpt refuses with a ``CloudCkptError`` -> "stricter", counted and listed, not a
failure. Never a crash, a hang, a changed global (:func:`snapshot` of every allowed
global, DCP's metadata classes and pathlib's, the enum members, dtypes and layouts every
load shares, checked after every batch) or a side effect (torch's sparse-validation
queue left filled, a module imported, torch's defaults changed); never a result holding
far more storage than the file (16 times it and a MiB) and than torch's result and the
file. Issue 39 adds: never a refusal over a CRC-32 (``ChecksumError``, or any message
naming a CRC) of a file whose records' CRCs are right ("false-checksum"); never a load
that runs what docs/security.md says cloudckpt refuses although torch runs it (a size
constructor given integers, bools among them: "size-constructor"); and, for attack and
records cases, never a peak of resident memory during cloudckpt's load (the kernel's
high-water mark, reset before each load) above torch's peak for the same file plus the
file's size plus 32 MiB ("peak-memory"; a peak over it is measured twice more and the
least counts, as other threads of the process show in it too). One
allowance: an archive whose zip bytes were damaged, which torch's zip reader refuses
over a field cloudckpt does not read (or reads wrong: memory it never filled), is
"lenient-zip" (counted and listed) when what cloudckpt loaded equals what torch loads
from the undamaged archive. Memory a
constructor leaves uninitialized compares equal on both sides: torch's deterministic
mode fills what torch allocates, glibc's ``M_PERTURB`` fills what malloc hands out.

Cases run in batches, each batch in a fresh process forked from this one (so one
case's damage cannot leak into another batch), ``--jobs`` at a time. A batch whose
process dies, hangs or changes a global is run again one case per process, and then
each side alone, to name the case and the side; its bytes are printed in hex. Where
no case does it again alone (a race: the reader threads of a records case), the
batch itself is a failure, named by its first case.

The summary line counts cases, both-refused, both-accepted-equal, stricter, failures;
the exit status is 1 if any case failed. ``--report PATH`` writes it all as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import multiprocessing
import os
import pickle
import pickletools
import random
import re
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
import types
import warnings
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import craft
import torch
from craft import ops

import cloudckpt
from cloudckpt import errors

# --- the two sides ----------------------------------------------------------------------


def _load_torch_bytes() -> Callable[..., Any] | None:
    try:
        from cloudckpt.format.torch import unpickle
    except ImportError:
        return None
    return getattr(unpickle, "load_torch_bytes", None)


LOAD_TORCH_BYTES = _load_torch_bytes()
#: Whether the boundary's in-memory entry point is there (issue 29).
HAS_BOUNDARY = LOAD_TORCH_BYTES is not None
URL = "mem://fuzz/case"

_tmpdir: list[str] = []
#: Where the processes of a run put their temporary files (removed at the end).
_TMP_ROOT: list[str] = []


def load_ours(data: bytes, entry: str = "bytes") -> Any:
    """cloudckpt's load of an archive held in ``data``: in memory ("bytes", where that
    entry point exists), from a file ("file"), or a file mapped ("mapped": ``mmap=True``)."""
    if entry == "bytes" and LOAD_TORCH_BYTES is not None:
        return LOAD_TORCH_BYTES(data, map_location="cpu", weights_only=True, url=URL)
    if not _tmpdir:
        _tmpdir.append(tempfile.mkdtemp(prefix="cloudckpt-fuzz-", dir=(_TMP_ROOT or [None])[0]))
    path = os.path.join(_tmpdir[0], "case.pt")
    with open(path, "wb") as f:
        f.write(data)
    return cloudckpt.load(path, map_location="cpu", weights_only=True, mmap=entry == "mapped")


def load_torch(data: bytes) -> Any:
    """The oracle: ``torch.load(weights_only=True)``."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def decode_ours(payload: bytes) -> Any:
    from cloudckpt.format.dcp.metadata import decode_metadata

    return decode_metadata(payload, URL + "/.metadata")


@functools.cache
def metadata_globals() -> dict[str, Any]:
    """What a DCP ``.metadata`` may name: cloudckpt's allow-list where it exposes one,
    else the same list written out (DCP's metadata classes, dtypes, pathlib...)."""
    try:
        from cloudckpt.format.dcp import metadata as md

        policy = getattr(md, "_POLICY", None)
        if policy is not None:
            return dict(policy.globals)
        found = getattr(md, "_GLOBALS", None)
        if isinstance(found, dict):
            table = {f"{m}.{n}": o for (m, n), o in found.items()}
            table.update({f"torch.{n}": v for n, v in vars(torch).items() if _is_dtype(v)})
            return table
    except ImportError:
        pass
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata, planner

    table: dict[str, Any] = {}
    for module, names in [
        (metadata, _DCP_METADATA_NAMES),
        (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
        (filesystem, ("_StorageInfo",)),
    ]:
        for name in names:
            table[f"{module.__name__}.{name}"] = getattr(module, name)
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        table[f"pathlib.{name}"] = getattr(pathlib, name)
    table["torch.Size"] = torch.Size
    table["collections.OrderedDict"] = OrderedDict
    table["torch.serialization._get_layout"] = torch.serialization._get_layout
    table.update({f"torch.{n}": v for n, v in vars(torch).items() if _is_dtype(v)})
    return table


_DCP_METADATA_NAMES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)


def _is_dtype(v: Any) -> bool:
    return isinstance(v, torch.dtype)


@functools.cache
def shared_objects() -> dict[str, Any]:
    """Objects every load in a process shares, which a pickle reaches through an allowed
    global without naming them: the members of the enums among the allowed classes and
    in DCP's modules (``_MEM_FORMAT_ENCODING(0)`` returns one), and torch's dtypes,
    layouts, memory formats and qschemes (``_get_layout`` returns one)."""
    import enum

    from torch import _weights_only_unpickler as wo
    from torch.distributed.checkpoint import metadata, planner

    classes = [*metadata_globals().values(), *wo._get_allowed_globals().values()]
    classes += [v for m in (metadata, planner) for v in vars(m).values()]
    found: dict[str, Any] = {}
    for cls in classes:
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls is not enum.Enum:
            for name, member in cls.__members__.items():
                found[f"member {cls.__module__}.{cls.__qualname__}.{name}"] = member
    kinds = (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)
    for name, value in vars(torch).items():
        if isinstance(value, kinds):
            found[f"torch.{name}"] = value
    return found


def _changes(op: int, at: int, machine: Any, target: Any) -> bool:
    """Whether Python's handler of ``op`` would change ``target`` (a BUILD with an
    empty state, an APPENDS or SETITEMS of nothing, do not)."""
    if op == pickle.BUILD[0]:
        if getattr(target, "__setstate__", None) is not None:
            return True
        state, slots = machine.stack[-1], None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        return _probe(lambda: bool(state) or bool(slots)) != ("ok", False)
    if at == -1:
        return bool(machine.stack)
    return True


def _guarded(op: int, at: int) -> Callable[[Any], None]:
    """Python pickle's handler of ``op``, refusing when its target (``at`` on the stack;
    -1: below the last mark) is a global, or an object every load shares
    (:func:`shared_objects`) that it would change."""
    real = pickle._Unpickler.dispatch[op]  # type: ignore[attr-defined]

    def run(self: Any) -> None:
        if at == -1:
            target = self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None
        else:
            target = self.stack[at] if len(self.stack) >= -at else None
        self._no_global(target)
        if id(target) in self._shared and _changes(op, at, self, target):
            raise pickle.UnpicklingError("mutation of an object every load shares")
        real(self)

    return run


class _MetadataOracle(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Python's pickle machine (a dict memo, every protocol) under the ``.metadata``
    allow-list, refusing BUILD, APPEND(S), SETITEM(S) and ADDITEMS on a global (the
    oracle must not poison the process it compares in)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    for _op, _at in [
        (pickle.BUILD[0], -2),
        (pickle.APPEND[0], -2),
        (pickle.SETITEM[0], -3),
        (pickle.APPENDS[0], -1),
        (pickle.SETITEMS[0], -1),
        (pickle.ADDITEMS[0], -1),
    ]:
        dispatch[_op] = _guarded(_op, _at)
    del _op, _at

    def __init__(self, file: Any) -> None:
        super().__init__(file, fix_imports=False)
        self._globals = metadata_globals()
        self._global_ids = {id(v) for v in self._globals.values()}
        self._shared = {id(v) for v in shared_objects().values()}

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent id")

    def _no_global(self, target: Any) -> None:
        if id(target) in self._global_ids or isinstance(
            target, type | types.FunctionType | types.BuiltinFunctionType | types.ModuleType
        ):
            raise pickle.UnpicklingError("mutation of a global")


def decode_oracle(payload: bytes) -> Any:
    return _MetadataOracle(io.BytesIO(payload)).load()


# --- equality ---------------------------------------------------------------------------

_ATOMS = (
    type(None),
    bool,
    int,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.qscheme,
)
_IDENTITY = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
)


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 is not 0.0


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__)


def _canon(v: Any) -> str:
    """A sort key that is the same for equal values in both processes' objects."""
    t = type(v)
    if t is float:
        return "f:nan" if math.isnan(v) else f"f:{v.hex()}"
    if t in _ATOMS or t is complex:
        return f"{t.__name__}:{v!r}"
    if isinstance(v, tuple):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if isinstance(v, torch.Tensor):
        # a set of tensors iterates in the order of their ids: everything that tells two
        # apart goes in the key (set(t) of a meta tensor: rows that differ in offset only)
        geometry = _probe(lambda: (tuple(v.stride()), v.storage_offset()))
        values = _probe(
            lambda: zlib.crc32(v.detach().contiguous().view(-1).view(torch.uint8).numpy())
        )
        return f"T:{v.dtype}:{tuple(v.shape)}:{geometry}:{values}"
    if isinstance(v, torch.UntypedStorage | torch.storage.TypedStorage):
        kind = _probe(lambda: (str(getattr(v, "dtype", "untyped")), v.nbytes(), v.device.type))
        return f"S:{kind}:{_probe(lambda: zlib.crc32(_storage_bytes(_untyped(v)) or b''))}"
    return t.__qualname__


def _untyped(s: Any) -> torch.UntypedStorage:
    """The untyped storage behind a storage of either kind."""
    return s if isinstance(s, torch.UntypedStorage) else s.untyped()


def _storage_bytes(s: torch.UntypedStorage) -> bytes | None:
    """A CPU storage's bytes (None where there are none to read safely)."""
    if s.device.type != "cpu" or s.nbytes() == 0 or s.data_ptr() == 0:
        return None
    return bytes(torch.empty(0, dtype=torch.uint8).set_(s).numpy())


def _tensor_facts(t: torch.Tensor) -> dict[str, Any]:
    facts = {
        "layout": _probe(lambda: t.layout),
        "dtype": _probe(lambda: t.dtype),
        "device": _probe(lambda: str(t.device)),
        "shape": _probe(lambda: tuple(t.shape)),
        "requires_grad": _probe(lambda: t.requires_grad),
        "is_leaf": _probe(lambda: t.is_leaf),
        "grad_fn": _probe(lambda: type(t.grad_fn).__name__),
        "conj": _probe(lambda: t.is_conj()),
        "neg": _probe(lambda: t.is_neg()),
        "quantized": _probe(lambda: t.is_quantized),
        "nested": _probe(lambda: t.is_nested),
    }
    if t.layout == torch.strided and not t.is_nested:
        facts["stride"] = _probe(lambda: t.stride())
        facts["offset"] = _probe(lambda: t.storage_offset())
    if t.is_quantized:
        q = _probe(t.qscheme)[-1]
        facts["qscheme"] = q
        if q in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            facts["scale"] = _probe(lambda: struct.pack("<d", t.q_scale()))
            facts["zero_point"] = _probe(t.q_zero_point)
        else:
            facts["axis"] = _probe(t.q_per_channel_axis)
    if t.layout == torch.sparse_coo:
        facts["sparse_dim"] = _probe(t.sparse_dim)
        facts["dense_dim"] = _probe(t.dense_dim)
        facts["coalesced"] = _probe(t.is_coalesced)
    return facts


def _tensor_parts(t: torch.Tensor) -> list[tuple[str, Any]]:
    """The component tensors and objects compared further (never a dense copy of a
    sparse or nested tensor: its indices may point anywhere)."""
    parts: list[tuple[str, Any]] = [
        ("_backward_hooks", _probe(lambda: t._backward_hooks)),
        ("__dict__", _probe(lambda: dict(t.__dict__))),
    ]
    layout = t.layout
    if layout == torch.sparse_coo:
        parts += [("indices", _probe(t._indices)), ("values", _probe(t._values))]
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts += [("crow", _probe(t.crow_indices)), ("col", _probe(t.col_indices))]
        parts += [("values", _probe(t.values))]
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts += [("ccol", _probe(t.ccol_indices)), ("row", _probe(t.row_indices))]
        parts += [("values", _probe(t.values))]
    elif t.is_nested:
        parts += [("sizes", _probe(t._nested_tensor_size))]
        parts += [("strides", _probe(t._nested_tensor_strides))]
        parts += [("offsets", _probe(t._nested_tensor_storage_offsets))]
        parts += [("storage", _probe(t.untyped_storage))]
    else:
        parts += [("storage", _probe(t.untyped_storage))]
        if t.is_quantized and _probe(t.qscheme)[-1] in (
            torch.per_channel_affine,
            torch.per_channel_symmetric,
            torch.per_channel_affine_float_qparams,
        ):
            parts += [("scales", _probe(t.q_per_channel_scales))]
            parts += [("zero_points", _probe(t.q_per_channel_zero_points))]
    return parts


_MAX_STEPS = 200_000


def _empty_storage(x: Any) -> bool:
    if isinstance(x, torch.storage.TypedStorage | torch.UntypedStorage):
        return _probe(x.nbytes) == ("ok", 0)
    return False


def diff(a: Any, b: Any) -> str | None:
    """None if ``a`` and ``b`` are the same object graph, else where they first differ.

    Strict: the same Python types everywhere, dicts in the same key order, floats bit
    for bit (any NaN equals any NaN), tensors by their facts and their storages' bytes,
    globals by identity, and the same sharing: two places hold one object (one storage)
    on one side exactly where they do on the other."""
    pair_a: dict[int, int] = {}
    pair_b: dict[int, int] = {}
    storage_a: dict[int, int] = {}
    storage_b: dict[int, int] = {}
    keep: list[Any] = []  # ids stay unique while compared
    work: list[tuple[Any, Any, str]] = [(a, b, "$")]
    steps = 0
    while work:
        x, y, path = work.pop()
        steps += 1
        if steps > _MAX_STEPS:
            return None  # too large to compare; counted equal
        tx = type(x)
        if tx is not type(y):
            return f"{path}: {tx.__qualname__} vs {type(y).__qualname__}"
        if tx in _ATOMS:
            if x != y:
                return f"{path}: {x!r} vs {y!r}"
            continue
        if tx is float:
            if not _same_float(x, y):
                return f"{path}: {x!r} vs {y!r}"
            continue
        if tx is complex:
            if not (_same_float(x.real, y.real) and _same_float(x.imag, y.imag)):
                return f"{path}: {x!r} vs {y!r}"
            continue
        if isinstance(x, _IDENTITY) or tx.__name__ == "StorageType":
            if x is not y:
                return f"{path}: {x!r} is not {y!r}"
            continue
        if not isinstance(x, tuple | frozenset) and not _empty_storage(x):
            # mutable: the sharing must match (torch does not share empty storages)
            ia, ib = id(x), id(y)
            if ia in pair_a or ib in pair_b:
                if pair_a.get(ia) != ib or pair_b.get(ib) != ia:
                    return f"{path}: shared differently"
                continue
            pair_a[ia], pair_b[ib] = ib, ia
            keep += (x, y)
        if isinstance(x, torch.Tensor):
            fx, fy = _tensor_facts(x), _tensor_facts(y)
            if fx != fy:
                bad = [k for k in fx if fx.get(k) != fy.get(k)]
                return f"{path}: tensor {bad[0]} {fx.get(bad[0])} vs {fy.get(bad[0])}"
            for (name, px), (_, py) in zip(_tensor_parts(x), _tensor_parts(y), strict=True):
                if px[0] != py[0]:
                    return f"{path}.{name}: {px} vs {py}"
                if px[0] == "ok":
                    work.append((px[1], py[1], f"{path}.{name}"))
            continue
        if isinstance(x, torch.storage.TypedStorage):
            dx, dy = _probe(lambda x=x: x.dtype), _probe(lambda y=y: y.dtype)
            if dx != dy:
                return f"{path}: storage dtype {dx[1]} vs {dy[1]}"
            ux, uy = _probe(lambda x=x: x._untyped_storage), _probe(lambda y=y: y._untyped_storage)
            if ux[0] != uy[0]:
                return f"{path}: storage {ux} vs {uy}"
            if ux[0] == "ok":
                work.append((ux[1], uy[1], f"{path}._untyped_storage"))
            continue
        if isinstance(x, torch.UntypedStorage):
            if (x.nbytes(), x.device) != (y.nbytes(), y.device):
                return f"{path}: storage {x.nbytes()}@{x.device} vs {y.nbytes()}@{y.device}"
            if x.nbytes():
                ca, cb = x._cdata, y._cdata
                if (ca in storage_a or cb in storage_b) and (
                    storage_a.get(ca) != cb or storage_b.get(cb) != ca
                ):
                    return f"{path}: storage shared differently"
                storage_a[ca], storage_b[cb] = cb, ca
            if _storage_bytes(x) != _storage_bytes(y):
                return f"{path}: storage bytes differ"
            continue
        if isinstance(x, tuple | list):
            if len(x) != len(y):
                return f"{path}: length {len(x)} vs {len(y)}"
            work += [(p, q, f"{path}[{i}]") for i, (p, q) in enumerate(zip(x, y, strict=True))]
            if hasattr(x, "__dict__"):
                work.append((vars(x), vars(y), f"{path}.__dict__"))
            continue
        if isinstance(x, dict):
            if len(x) != len(y):
                return f"{path}: {len(x)} keys vs {len(y)}"
            for n, ((ka, va), (kb, vb)) in enumerate(zip(x.items(), y.items(), strict=True)):
                work.append((va, vb, f"{path}[{ka!r}]" if type(ka) in _ATOMS else f"{path}[{n}]"))
                work.append((ka, kb, f"{path}.key{n}"))
            if tx is not dict and hasattr(x, "__dict__"):
                work.append((vars(x), vars(y), f"{path}.__dict__"))
            continue
        if isinstance(x, set | frozenset):
            if len(x) != len(y):
                return f"{path}: {len(x)} items vs {len(y)}"
            sx, sy = sorted(x, key=_canon), sorted(y, key=_canon)
            work += [(p, q, f"{path}{{{i}}}") for i, (p, q) in enumerate(zip(sx, sy, strict=True))]
            continue
        if isinstance(x, bytearray):
            if x != y:
                return f"{path}: {bytes(x)[:40]!r} vs {bytes(y)[:40]!r}"
            continue
        state_x, state_y = _probe(lambda x=x: vars(x)), _probe(lambda y=y: vars(y))
        slots = [s for k in tx.__mro__ for s in getattr(k, "__slots__", ()) if s != "__dict__"]
        if state_x[0] == "ok" or slots:
            if state_x[0] != state_y[0]:
                return f"{path}: __dict__ {state_x[0]} vs {state_y[0]}"
            if state_x[0] == "ok":
                work.append((state_x[1], state_y[1], f"{path}.__dict__"))
            for s in slots:
                work.append(
                    (
                        _probe(lambda s=s, x=x: getattr(x, s)),
                        _probe(lambda s=s, y=y: getattr(y, s)),
                        f"{path}.{s}",
                    )
                )
            continue
        eq = _probe(lambda x=x, y=y: bool(x == y))
        if eq != ("ok", True):
            return f"{path}: {tx.__qualname__} not equal ({eq})"
    return None


def footprint(obj: Any) -> int:
    """Bytes of distinct CPU storages (and bytearrays) reachable from ``obj``."""
    seen: set[int] = set()
    cdatas: set[int] = set()
    total = 0
    work = [obj]
    keep = []
    steps = 0
    while work and steps < _MAX_STEPS:
        steps += 1
        x = work.pop()
        if id(x) in seen or type(x) in _ATOMS or isinstance(x, _IDENTITY):
            continue
        seen.add(id(x))
        keep.append(x)
        if isinstance(x, torch.Tensor):
            parts = _tensor_parts(x)
            work += [p[1] for _, p in parts if p[0] == "ok"]
        elif isinstance(x, torch.storage.TypedStorage):
            found = _probe(lambda x=x: x._untyped_storage)
            if found[0] == "ok":
                work.append(found[1])
        elif isinstance(x, torch.UntypedStorage):
            if x._cdata not in cdatas and x.device.type == "cpu" and x.data_ptr():
                cdatas.add(x._cdata)
                total += x.nbytes()
        elif isinstance(x, bytearray):
            total += len(x)
        elif isinstance(x, tuple | list | set | frozenset):
            work += list(x)
        elif isinstance(x, dict):
            work += list(x.keys()) + list(x.values())
        elif hasattr(x, "__dict__"):
            with contextlib.suppress(Exception):
                work.append(vars(x))
    return total


# --- globals and side effects -----------------------------------------------------------


def canary_objects() -> dict[str, Any]:
    """Every object a pickle can name and so might change: torch's allowed globals (and
    their types), DCP's metadata classes, pathlib's classes, cloudckpt's boundary module."""
    import pathlib

    from torch import _weights_only_unpickler as wo

    found: dict[str, Any] = {}
    for name, value in wo._get_allowed_globals().items():
        found[name] = value
        found[f"type({name})"] = type(value)
    for name, value in metadata_globals().items():
        found[f"dcp:{name}"] = value
    from torch.distributed.checkpoint import filesystem, metadata, planner

    for module in (metadata, planner):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    found["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    for module in (torch, getattr(torch, "cuda", None)):  # the storage classes themselves
        for name in dir(module):
            value = getattr(module, name, None)
            if name.endswith("Storage") and isinstance(value, type):
                found[f"class {module.__name__}.{name}"] = value
    for name in ("PurePath", "Path", "PurePosixPath", "PosixPath", "PureWindowsPath"):
        found[f"pathlib.{name}"] = getattr(pathlib, name)
    found["pathlib.WindowsPath"] = pathlib.WindowsPath
    try:
        from cloudckpt.format.torch import unpickle

        found["module cloudckpt.format.torch.unpickle"] = unpickle
    except ImportError:
        pass
    found["module torch._utils"] = torch._utils
    found["module copyreg"] = sys.modules["copyreg"]
    # what allowed calls return and every load shares: enum members (DCP's among them),
    # dtypes, layouts, memory formats, qschemes
    found.update(shared_objects())
    return found


def _contents(v: Any) -> list[int] | None:
    """The identities of a container's contents (a change in place shows)."""
    if type(v) in (list, set, bytearray):
        return [id(x) for x in v] if type(v) is not bytearray else list(v)
    if type(v) is dict:
        return [id(x) for kv in v.items() for x in kv]
    return None


def snapshot(objects: dict[str, Any]) -> dict[str, Any]:
    """Each object's ``__dict__`` (keys, values, and the contents of container values),
    ``__defaults__``, ``__kwdefaults__``, ``__code__``, ``__class__`` and ``__bases__``.
    The snapshot holds the values, so identities stay meaningful."""
    snap: dict[str, Any] = {}
    for name, obj in objects.items():
        state: dict[str, Any] = {}
        d = _probe(lambda obj=obj: obj.__dict__)
        if d[0] == "ok" and d[1] is not None:
            items = [(k, v) for k, v in list(d[1].items()) if k != "__warningregistry__"]
            values = [v for _, v in items]
            nested = {k: c for k, v in items if (c := _contents(v)) is not None}
            state["__dict__"] = ([k for k, _ in items], values, list(map(id, values)), nested)
        for attr in ("__defaults__", "__kwdefaults__", "__code__", "__class__", "__bases__"):
            v = _probe(lambda obj=obj, attr=attr: getattr(obj, attr))
            if v[0] == "ok":
                state[attr] = (v[1], id(v[1]), _contents(v[1]))
        snap[name] = state
    return snap


def snapshot_diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed between two snapshots of the same objects."""
    changed = []
    for name, state in before.items():
        now = after.get(name, {})
        for attr, value in state.items():
            new = now.get(attr)
            if attr == "__dict__":
                if new is None or value[0] != new[0] or value[2] != new[2] or value[3] != new[3]:
                    keys = set(value[0]) ^ set(new[0] if new else ())
                    if new is not None:
                        old_map = dict(zip(value[0], value[2], strict=True))
                        new_map = dict(zip(new[0], new[2], strict=True))
                        keys |= {k for k in old_map if new_map.get(k, -1) != old_map[k]}
                        keys |= {k for k in value[3] if value[3][k] != new[3].get(k)}
                        keys |= set(new[3]) - set(value[3])
                    changed += [f"{name}.{k}" for k in sorted(keys, key=str)] or [
                        f"{name}.__dict__"
                    ]
            elif new is None or value[1:] != new[1:]:
                changed.append(f"{name}.{attr}")
        changed += [f"{name}.{attr}" for attr in set(now) - set(state)]
    return sorted(changed)


def side_state() -> tuple[Any, ...]:
    import copyreg

    return (
        len(sys.modules),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        len(torch.serialization.get_safe_globals()),
        len(copyreg._extension_registry),  # type: ignore[attr-defined]
        os.getcwd(),
    )


def side_effects(before: tuple[Any, ...], modules: set[str]) -> list[str]:
    found = []
    if torch._utils._sparse_tensors_to_validate:
        found.append("torch._utils._sparse_tensors_to_validate left filled")
        torch._utils._sparse_tensors_to_validate.clear()
    now = side_state()
    if now[0] != before[0]:
        new = sorted(
            m for m in set(sys.modules) - modules if not m.startswith(("encodings.", "torch."))
        )
        if new:
            found.append(f"imported {new[:5]}")
        modules.update(sys.modules)
    names = ["", "default dtype", "grad mode", "safe globals", "copyreg extensions", "cwd"]
    found += [f"{names[i]} changed" for i in range(1, len(now)) if now[i] != before[i]]
    return found


# --- the corpus -------------------------------------------------------------------------


def _states() -> dict[str, Any]:
    """Real checkpoints of many kinds (the seeds of the mutations)."""
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3)
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4, generator=g)).sum().backward()
    opt.step()
    base = torch.randn(4, 6, generator=g)
    tagged = torch.randn(3, generator=g)
    tagged.note = "tagged"  # type: ignore[attr-defined]
    states: dict[str, Any] = {
        "state_dict": model.state_dict(),
        "adamw": opt.state_dict(),
        "parameters": {
            "p": torch.nn.Parameter(torch.randn(3, generator=g)),
            "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        },
        "objects": {
            "int": 3,
            "neg": -70000,
            "big": 2**70,
            "float": 1.5,
            "nan": float("nan"),
            "inf": float("-inf"),
            "bool": True,
            "none": None,
            "str": "s\u00e9",
            "bytes": b"\x00\xff",
            "bytearray": bytearray(b"ab"),
            "complex": 1 + 2j,
            "tuple": (1, "x", (2.0,)),
            "list": [1, [2, [3]]],
            "set": {1, 2, 3},  # ints: the same order in every process
            "ordered": OrderedDict(b=1, a=2),
            "counter": Counter("aab"),
            "size": torch.Size([2, 3]),
            "device": torch.device("cpu"),
            "dtypes": [torch.bfloat16, torch.int8, torch.bool, torch.complex64],
        },
        "views": {
            "base": base,
            "row": base[1],
            "column": base[:, 2],
            "transposed": base.t(),
            "strided": base.view(-1)[1::3],
            "offset": base.view(-1)[5:9],
            "again": base,
        },
        "requires_grad": {"x": torch.randn(3, generator=g, requires_grad=True)},
        "empty": {"e": torch.empty(0), "e2": torch.empty(0, 4), "scalar": torch.tensor(1.5)},
        "dtypes": {
            str(d): torch.arange(6).to(d)
            for d in (
                torch.float64,
                torch.float16,
                torch.bfloat16,
                torch.int8,
                torch.uint8,
                torch.int16,
                torch.int32,
                torch.int64,
                torch.bool,
                torch.complex64,
                torch.complex128,
                torch.float8_e4m3fn,
                torch.uint16,
            )
        },
        "quantized": {
            "q": torch.quantize_per_tensor(torch.randn(4, generator=g), 0.1, 3, torch.quint8),
            "qc": torch.quantize_per_channel(
                torch.randn(2, 3, generator=g),
                torch.tensor([0.1, 0.2], dtype=torch.float64),
                torch.tensor([0, 1]),
                0,
                torch.qint8,
            ),
        },
        "sparse": {
            "coo": torch.randn(4, 4, generator=g).relu().to_sparse(),
            "csr": torch.randn(3, 3, generator=g).relu().to_sparse_csr(),
        },
        "conj_neg": {
            "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
            "neg": torch.randn(3, dtype=torch.complex64, generator=g).conj().imag,
        },
        "tensor_attribute": {"t": tagged},
        "meta": {"m": torch.empty(2, 3, device="meta")},
        "nested": {"a": [{"b": (torch.ones(2), {"c": [torch.zeros(1)]})}], "n": 1},
        "list_top": [torch.arange(3), 1, "x"],
        "tensor_top": torch.arange(4.0),
        "nested_tensor": torch.nested.nested_tensor(
            [torch.randn(2, generator=g), torch.randn(3, generator=g)]
        ),
    }
    return states


@dataclass
class Corpus:
    archives: list[tuple[str, bytes, dict[str, bytes]]] = field(default_factory=list)
    metadata: list[tuple[str, bytes]] = field(default_factory=list)


def build_corpus() -> Corpus:
    corpus = Corpus()
    for name, state in _states().items():
        buf = io.BytesIO()
        torch.save(state, buf)
        found = craft.read_archive(buf.getvalue())
        data = craft.torch_archive(found.pkl, found.storages)
        try:
            load_torch(data)
        except Exception:  # torch cannot read it back: not a seed
            continue
        corpus.archives.append((name, found.pkl, found.storages))
    corpus.metadata = _metadata_seeds()
    return corpus


def _metadata_seeds() -> list[tuple[str, bytes]]:
    """DCP ``.metadata`` of torch's writer and cloudckpt's, re-pickled in protocols 2-5."""
    import torch.distributed.checkpoint as dcp

    states = {
        "tensors": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "mixed": {"w": torch.ones(4), "extra": {"note": "x", "step": 3}, "i": torch.tensor(2)},
    }
    seeds: list[tuple[str, bytes]] = []
    root = tempfile.mkdtemp(prefix="cloudckpt-fuzz-dcp-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, state in states.items():
                writers: list[tuple[str, Any]] = [
                    ("torch", dcp.FileSystemWriter(os.path.join(root, f"t-{name}")))
                ]
                with contextlib.suppress(ImportError):
                    from cloudckpt.dcp import CloudStorageWriter

                    writers.append(("cloudckpt", CloudStorageWriter(os.path.join(root, name))))
                for who, writer in writers:
                    try:
                        dcp.save(state, storage_writer=writer, no_dist=True)
                    except Exception:
                        continue
                    path = getattr(writer, "path", None) or os.path.join(root, name)
                    with open(os.path.join(str(path), ".metadata"), "rb") as f:
                        raw = f.read()
                    seeds.append((f"{who}-{name}", raw))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = []
    for name, raw in seeds:
        obj = pickle.loads(raw)  # our own writers' output, in this process
        meta = getattr(obj, "storage_meta", None)
        if meta is not None:  # a random save id and a temporary path: made fixed
            for attr in ("save_id", "checkpoint_id"):
                if hasattr(meta, attr):
                    setattr(meta, attr, f"fixed-{attr}")
        for proto in (2, 3, 4, 5):
            out.append((f"{name}-p{proto}", pickle.dumps(obj, protocol=proto)))
    return out


# --- mutation ---------------------------------------------------------------------------

INTS = [0, 1, 2, 3, 4, 7, 8, 16, 255, 256, 65535, 65536, -1, -2, 2**31 - 1, -(2**31)]
BIG_INTS = [2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64, 10**30]
FLOATS = [0.0, -0.0, 1.0, 0.5, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324]
STRINGS = [
    "0", "1", "2", "3", "9", "", "storage", "cpu", "cuda", "meta", "cuda:0", "cpu:0",
    "latin1", "utf-8", "ascii", "x", "_metadata", "__dict__", "__defaults__", "_dtype",
    "dtype", "_untyped_storage", "step", "params", "weight", "\u00e9\u00e9",
    "torch.sparse_coo", "torch.sparse_csr", "torch.strided", "a" * 300, "0/../0", "../x",
]  # fmt: skip


def _allowed_names() -> list[tuple[str, str]]:
    from torch import _weights_only_unpickler as wo

    # sorted: torch builds its list from sets, in an order that changes between processes
    return [tuple(k.rsplit(".", 1)) for k in sorted(wo._get_allowed_globals())]  # type: ignore[misc]


ALLOWED = _allowed_names()
#: Globals a pickle may name that no policy allows (harmless if called by mistake).
OTHER_GLOBALS = [
    ("builtins", "getattr"), ("builtins", "setattr"), ("builtins", "len"),
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "type"), ("builtins", "object"),
    ("builtins", "frozenset"), ("__builtin__", "set"), ("__builtin__", "bytearray"),
    ("__builtin__", "getattr"), ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
    ("collections", "defaultdict"), ("functools", "partial"), ("torch", "ones"),
    ("torch.nn", "Module"), ("torch.nn.modules.linear", "Linear"), ("pathlib", "PosixPath"),
    ("torch.distributed.checkpoint.metadata", "Metadata"), ("torch.tensor", "Tensor"),
    ("torch.nested._internal.nested_tensor", "NestedTensor"),
    ("torch.distributed.tensor", "DTensor"), ("torch._dynamo.decorators", "_DimRange"),
    ("torch.serialization", "StorageType"), ("torch._utils", "_rebuild_xla_tensor"),
    ("numpy.core.multiarray", "_reconstruct"), ("torch", "layout"),
]  # fmt: skip
NOARG_OPS = [
    b"(", b"0", b"1", b"2", b"N", b"\x88", b"\x89", b")", b"t", b"\x85", b"\x86", b"\x87",
    b"]", b"l", b"a", b"e", b"}", b"d", b"s", b"u", b"\x8f", b"\x90", b"\x91", b"\x93",
    b"R", b"b", b"o", b"\x81", b"\x92", b"Q", b"\x94", b"\x97", b"\x98", b".",
]  # fmt: skip
#: Opcodes that take the same stack shape, swapped for one another.
OP_FAMILIES = [
    [b"N", b"\x88", b"\x89", b")", b"]", b"}", b"\x8f"],
    [b"a", b"s", b"b", b"R", b"\x81", b"\x86", b"\x92", b"\x93"],
    [b"t", b"e", b"u", b"\x90", b"\x91", b"d", b"l", b"o", b"1"],
    [b"\x85", b"Q", b"\x94", b"2", b"0"],
]


def _segments(pkl: bytes) -> list[tuple[int, int, str, Any]] | None:
    """``(start, end, opcode name, argument)`` of each opcode up to STOP (the bytes
    after STOP are left alone), or None if the pickle does not parse."""
    try:
        found = [(pos, op.name, arg) for op, arg, pos in pickletools.genops(pkl)]
    except Exception:
        return None
    if not found:
        return None
    out = []
    for i, (pos, name, arg) in enumerate(found):
        end = found[i + 1][0] if i + 1 < len(found) else pos + 1
        out.append((pos, end, name, arg))
    return out


def _memo_indices(segments: list[tuple[int, int, str, Any]]) -> list[int]:
    found = [arg for _, _, name, arg in segments if name in ("BINPUT", "LONG_BINPUT")]
    count = sum(1 for _, _, name, _ in segments if name == "MEMOIZE")
    return sorted(set(found) | set(range(count))) or [0]


class Mutator:
    """Opcode-aware mutations of a pickle (and a few blind ones)."""

    def __init__(self, rng: random.Random, gen: Gen) -> None:
        self.rng = rng
        self.gen = gen

    def mutate(self, pkl: bytes, others: list[bytes], rounds: int) -> tuple[bytes, list[str]]:
        done = []
        for _ in range(rounds):
            segments = _segments(pkl)
            name = self.rng.choice(
                ["flip", "flip", "truncate"]
                if segments is None
                else ["flip", "delete", "dup", "swap", "insert", "insert", "insert",
                      "replace_arg", "replace_arg", "replace_op", "splice", "truncate"]
            )  # fmt: skip
            pkl = getattr(self, f"m_{name}")(pkl, segments, others)
            done.append(name)
        return pkl, done

    def _at(self, segments: list[tuple[int, int, str, Any]]) -> int:
        return self.rng.randrange(len(segments))

    def m_flip(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        if not pkl:
            return bytes([self.rng.randrange(256)])
        buf = bytearray(pkl)
        i = self.rng.randrange(len(buf))
        if self.rng.random() < 0.5:
            buf[i] ^= 1 << self.rng.randrange(8)
        else:
            buf[i] = self.rng.randrange(256)
        return bytes(buf)

    def m_truncate(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        return pkl[: self.rng.randrange(len(pkl) + 1)]

    def m_delete(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        s, e, _, _ = segments[self._at(segments)]
        return pkl[:s] + pkl[e:]

    def m_dup(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        s, e, _, _ = segments[self._at(segments)]
        return pkl[:e] + pkl[s:e] + pkl[e:]

    def m_swap(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        if len(segments) < 3:
            return self.m_flip(pkl, segments, others)
        i = self.rng.randrange(1, len(segments) - 1)
        j = i + 1 if self.rng.random() < 0.6 else self.rng.randrange(1, len(segments) - 1)
        i, j = min(i, j), max(i, j)
        if i == j:
            return pkl
        (s1, e1, _, _), (s2, e2, _, _) = segments[i], segments[j]
        return pkl[:s1] + pkl[s2:e2] + pkl[e1:s2] + pkl[s1:e1] + pkl[e2:]

    def m_insert(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        s = segments[self.rng.randrange(1, len(segments))][0] if len(segments) > 1 else 0
        self.gen.refs = [(i, "memo") for i in _memo_indices(segments)]
        self.gen.next_memo = max(i for i, _ in self.gen.refs) + 1
        return pkl[:s] + self.gen.snippet() + pkl[s:]

    def m_replace_arg(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        with_arg = [seg for seg in segments if seg[3] is not None]
        if not with_arg:
            return self.m_replace_op(pkl, segments, others)
        s, e, name, arg = self.rng.choice(with_arg)
        rng = self.rng
        new: bytes
        if name in ("BININT1", "BININT2", "BININT", "LONG1", "LONG4", "INT", "LONG"):
            n = rng.choice(INTS + BIG_INTS) if rng.random() < 0.5 else arg + rng.choice([-1, 1])
            new = ops.int_(n) if rng.random() < 0.7 else ops.LONG1(n)
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "SHORT_BINSTRING"):
            new = self.gen.str_code(rng.choice(STRINGS))
            if name == "SHORT_BINUNICODE" and rng.random() < 0.5:
                new = ops.SHORT_BINUNICODE(rng.choice(STRINGS)[:255])
        elif name in ("GLOBAL", "INST"):
            module, attr = self.gen.global_name()
            new = ops.GLOBAL(module, attr) if name == "GLOBAL" else ops.INST(module, attr)
        elif name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"):
            i = rng.choice([*_memo_indices(segments), 255, 256, 2**31 - 1, 2**32 - 1])
            short = name.startswith("BIN") and i < 256
            get = "GET" in name
            new = (
                (ops.BINGET if get else ops.BINPUT)(i)
                if short
                else (ops.LONG_BINGET if get else ops.LONG_BINPUT)(i)
            )
        elif name == "BINFLOAT":
            new = ops.BINFLOAT(rng.choice(FLOATS))
        elif name == "PROTO":
            new = ops.PROTO(rng.choice([0, 1, 2, 3, 4, 5, 255]))
        elif name == "FRAME":
            new = ops.FRAME(rng.choice([0, 1, arg + 1, max(arg - 1, 0), 2**63]))
        elif name in ("SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
            new = ops.SHORT_BINBYTES(rng.randbytes(rng.randrange(8)))
        else:
            return self.m_flip(pkl, segments, others)
        return pkl[:s] + new + pkl[e:]

    def m_replace_op(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        plain = [seg for seg in segments if seg[1] - seg[0] == 1 and seg[2] != "STOP"]
        if not plain:
            return self.m_flip(pkl, segments, others)
        s, e, _, _ = self.rng.choice(plain)
        op = pkl[s:e]
        family = next((f for f in OP_FAMILIES if op in f), NOARG_OPS)
        if self.rng.random() < 0.2:
            family = NOARG_OPS
        return pkl[:s] + self.rng.choice(family) + pkl[e:]

    def m_splice(self, pkl: bytes, segments: Any, others: Any) -> bytes:
        other = self.rng.choice(others)
        theirs = _segments(other)
        if not theirs:
            return self.m_flip(pkl, segments, others)
        cut = segments[self.rng.randrange(len(segments))][0]
        start = theirs[self.rng.randrange(len(theirs))][0]
        return pkl[:cut] + other[start:]


# --- generation -------------------------------------------------------------------------


def _storage_table() -> dict[str, tuple[str, int]]:
    """Storage class names a persistent id may hold -> (module, element size)."""
    from torch import _weights_only_unpickler as wo

    table: dict[str, tuple[str, int]] = {}
    for key, value in sorted(wo._get_allowed_globals().items()):
        module, name = key.rsplit(".", 1)
        if name.endswith("Storage") and "cuda" not in module:
            dtype = getattr(value, "_dtype", None) or getattr(value, "dtype", torch.uint8)
            size = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
            table[name] = (module, size)
    return table


STORAGE_TABLE = _storage_table()
#: Allowed globals that can be called (REDUCE) or instantiated (NEWOBJ).
CALLABLE = [
    tuple(k.rsplit(".", 1))
    for k, v in sorted(__import__("torch")._weights_only_unpickler._get_allowed_globals().items())
    if callable(v) and "cuda" not in k
]
REBUILDS = [
    "_rebuild_tensor_v2", "_rebuild_tensor_v2", "_rebuild_tensor_v2", "_rebuild_tensor",
    "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state",
    "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_cpu_tensor",
    "_rebuild_device_tensor_from_numpy", "_rebuild_nested_tensor", "_rebuild_from_type_v2",
]  # fmt: skip
DTYPE_NAMES = [
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "qint8", "quint8", "qint32", "float8_e4m3fn", "uint16",
]  # fmt: skip
LAYOUTS = ["torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.strided", "x"]


class Gen:
    """Opcode sequences: statements that each push one value and memoize it, some
    building values (constants, containers, storages from persistent ids, tensors by
    each rebuild function, calls of allowed callables with random arguments), some
    mutating earlier ones (BUILD, APPEND(S), SETITEM(S), REDUCE, NEWOBJ on globals,
    containers, tensors, storages); then a tuple of the memoized values."""

    def __init__(self, rng: random.Random, storages: dict[str, bytes], target: str) -> None:
        self.rng = rng
        self.storages = storages
        self.target = target
        self.refs: list[tuple[int, str]] = []
        self.next_memo = 0
        self.used: dict[str, str] = {}  # storage key -> the class first named with it
        self.elements: dict[int, int] = {}  # memoized storage -> its element count
        self._elements = 0
        self.constructive = False  # this program builds values only (no mutations)

    # -- small values
    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def small_int(self) -> int:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.randint(0, 8)
        if r < 0.92:
            return self.rng.randint(-3, 300)
        if r < 0.98:
            return self.rng.choice(INTS)
        return self.rng.choice(BIG_INTS)

    def int_code(self, n: int | None = None) -> bytes:
        n = self.small_int() if n is None else n
        if self.chance(0.1):
            return ops.LONG1(n)
        if self.chance(0.05) and -(2**31) <= n < 2**31:
            return ops.BININT(n)
        return ops.int_(n)

    def str_code(self, s: str | None = None) -> bytes:
        s = self.rng.choice(STRINGS) if s is None else s
        if self.target == "metadata" and self.chance(0.5):
            return ops.SHORT_BINUNICODE(s.encode()[:255])
        if self.chance(0.15) and len(s.encode()) < 256:
            return ops.SHORT_BINSTRING(s)
        return ops.BINUNICODE(s)

    def global_name(self) -> tuple[str, str]:
        if self.target == "metadata" and self.chance(0.8):
            return tuple(self.rng.choice(sorted(metadata_globals())).rsplit(".", 1))  # type: ignore[return-value]
        if self.chance(0.8):
            return self.rng.choice(ALLOWED)
        return self.rng.choice(OTHER_GLOBALS)

    def global_code(self, module: str | None = None, name: str | None = None) -> bytes:
        if module is None or name is None:
            module, name = self.global_name()
        if self.target == "metadata" and self.chance(0.5):
            return ops.SHORT_BINUNICODE(module) + ops.SHORT_BINUNICODE(name) + ops.STACK_GLOBAL
        return ops.GLOBAL(module, name)

    def const(self) -> tuple[bytes, str]:
        r = self.rng.randrange(12)
        if r == 0:
            return ops.NONE, "none"
        if r == 1:
            return ops.bool_(self.chance(0.5)), "bool"
        if r in (2, 3, 4):
            return self.int_code(), "int"
        if r == 5:
            return ops.BINFLOAT(self.rng.choice([*FLOATS, self.rng.random()])), "float"
        if r in (6, 7):
            return self.str_code(), "str"
        if r == 8:
            return ops.call("_codecs", "encode", self.str_code(), ops.str_("latin1")), "bytes"
        if r == 9 and self.target == "metadata":
            return ops.SHORT_BINBYTES(self.rng.randbytes(self.rng.randrange(6))), "bytes"
        return self.rng.choice([ops.EMPTY_TUPLE, ops.EMPTY_LIST, ops.EMPTY_DICT]), "empty"

    def ref(self, kinds: tuple[str, ...] = ()) -> bytes | None:
        if not self.refs:
            return None
        pool = [r for r in self.refs if r[1] in kinds] if kinds else []
        i, _ = self.rng.choice(pool or self.refs)
        return ops.BINGET(i) if i < 256 else ops.LONG_BINGET(i)

    def value(self, depth: int = 0, kinds: tuple[str, ...] = ()) -> bytes:
        r = self.rng.random()
        if r < 0.35 and self.refs:
            found = self.ref(kinds)
            if found is not None:
                return found
        if r < 0.7 or depth > 2:
            return self.const()[0]
        if r < 0.85:
            return self.container(depth + 1)[0]
        return self.rng.choice([self.size, self.dtype, self.storage, self.tensor])(depth + 1)[0]  # type: ignore[operator]

    def values(self, n: int, depth: int = 0) -> list[bytes]:
        return [self.value(depth) for _ in range(n)]

    def args(self, depth: int = 0) -> bytes:
        if self.chance(0.05):
            return self.value(depth)  # not a tuple
        return ops.tuple_(*self.values(self.rng.randrange(4), depth))

    # -- shaped values
    def size(self, depth: int = 0, numel: int | None = None) -> tuple[bytes, str]:
        dims = self.rng.randrange(4)
        if numel is not None and self.chance(0.8):
            sizes = self._split(numel, dims)
        else:
            sizes = [self.small_int() for _ in range(dims)]
        code = ops.tuple_(*(self.int_code(s) for s in sizes))
        if self.chance(0.1):
            code = ops.call("torch", "Size", code)
        elif self.chance(0.05):
            code = ops.list_(*(self.int_code(s) for s in sizes))
        return code, "size"

    def _split(self, numel: int, dims: int) -> list[int]:
        """``dims`` sizes whose product is at most ``numel`` (mostly all of it)."""
        sizes = []
        left = max(numel, 0)
        for i in range(dims):
            last = i == dims - 1 and self.chance(0.7)
            d = left if last else self.rng.randint(0, min(left, 8))
            sizes.append(d)
            left = left // d if d else 0
        return sizes

    def stride(self, sizes: list[int]) -> bytes:
        if self.chance(0.8):
            out, acc = [], 1
            for s in reversed(sizes):
                out.append(acc)
                acc *= max(s, 1)
            return ops.ints(reversed(out))
        return ops.tuple_(*(self.int_code(self.rng.choice([0, 1, 2, -1, 3])) for _ in sizes))

    def dtype(self, depth: int = 0) -> tuple[bytes, str]:
        return self.global_code("torch", self.rng.choice(DTYPE_NAMES)), "dtype"

    def storage(self, depth: int = 0, cls: str | None = None) -> tuple[bytes, str]:
        return self._pid(cls)[0], "storage"

    def _pid(self, cls: str | None = None) -> tuple[bytes, int]:
        """A persistent id naming a storage record (mostly a real one, of its size), and
        the elements it holds (torch keeps the first storage loaded for a key)."""
        keys = list(self.storages)
        key = self.rng.choice(keys) if keys and self.chance(0.9) else self.rng.choice(STRINGS)
        if key in self.used and self.chance(0.85):
            cls = self.used[key]
        if cls is None:
            cls = self.rng.choice(list(STORAGE_TABLE))
        self.used.setdefault(key, cls)
        module, size = STORAGE_TABLE.get(cls, ("torch", 4))
        numel = len(self.storages.get(key, b"")) // size
        if self.chance(0.1):
            numel = self.small_int()
        if self.chance(0.05):
            storage_type = self.rng.choice(
                [ops.GLOBAL("torch", "Tensor") + ops.EMPTY_TUPLE + ops.NEWOBJ, self.dtype()[0]]
                + [self.global_code(*n) for n in OTHER_GLOBALS[:3]]
            )
        else:
            storage_type = ops.GLOBAL(module, cls)
        location = "cpu" if self.chance(0.9) else self.rng.choice(["cuda", "meta", "cpu:0", ""])
        parts = [self.str_code("storage"), storage_type, self.str_code(key)]
        parts += [self.str_code(location), self.int_code(numel)]
        if self.chance(0.03):
            parts = parts[: self.rng.randrange(len(parts))]
        first = STORAGE_TABLE.get(self.used[key], ("", 1))[1]
        self._elements = len(self.storages.get(key, b"")) // first
        return ops.MARK + b"".join(parts) + ops.TUPLE + ops.BINPERSID, self._elements

    def _storage_arg(self, cls: str | None = None) -> tuple[bytes, int]:
        """A storage for a rebuild (a memoized one or a new id) and its element count."""
        if cls is None and self.elements and self.chance(0.3):
            i = self.rng.choice(list(self.elements))
            return (ops.BINGET(i) if i < 256 else ops.LONG_BINGET(i)), self.elements[i]
        return self._pid(cls)

    def tensor(self, depth: int = 0) -> tuple[bytes, str]:
        which = self.rng.choice(REBUILDS)
        if depth > 2:
            which = "_rebuild_tensor_v2"
        code = getattr(self, f"t{which}")(depth)
        return code, "param" if "parameter" in which else "tensor"

    def _geometry(self, numel: int) -> tuple[bytes, bytes, bytes]:
        offset = 0 if self.chance(0.8) else self.small_int()
        sizes = self._split(max(numel - offset, 0), self.rng.randrange(4))
        if self.chance(0.1):
            sizes = [self.small_int() for _ in sizes]
        return (
            self.int_code(offset),
            ops.tuple_(*(self.int_code(s) for s in sizes)),
            self.stride(sizes),
        )

    def _rg(self) -> bytes:
        if self.chance(0.85):
            return ops.NEWFALSE
        return self.rng.choice([ops.NEWTRUE, ops.NONE, ops.int_(2), ops.int_(0)])

    def _hooks(self) -> bytes:
        if self.chance(0.85):
            return ops.ordered_dict()
        return self.rng.choice([ops.EMPTY_DICT, ops.NONE, ops.list_(ops.int_(1))])

    def _tensor_value(self, depth: int) -> bytes:
        found = self.ref(("tensor", "param")) if self.chance(0.4) else None
        return found or self.t_rebuild_tensor_v2(depth + 1)

    def _call(self, name: str, *args: bytes, module: str = "torch._utils") -> bytes:
        return ops.call(module, name, *args)

    def t_rebuild_tensor_v2(self, depth: int) -> bytes:
        storage, numel = self._storage_arg()
        offset, size, stride = self._geometry(numel)
        args = [storage, offset, size, stride, self._rg(), self._hooks()]
        if self.chance(0.1):
            args.append(
                self.rng.choice(
                    [ops.EMPTY_DICT, ops.NONE, ops.dict_((ops.str_("conj"), ops.NEWTRUE))]
                )
            )
        return self._call("_rebuild_tensor_v2", *args)

    def t_rebuild_tensor(self, depth: int) -> bytes:
        storage, numel = self._storage_arg()
        return self._call("_rebuild_tensor", storage, *self._geometry(numel))

    def t_rebuild_tensor_v3(self, depth: int) -> bytes:
        storage, numel = self._storage_arg("UntypedStorage" if self.chance(0.7) else None)
        dtype = self.dtype()[0]
        offset, size, stride = self._geometry(numel // 4)
        return self._call(
            "_rebuild_tensor_v3", storage, offset, size, stride, self._rg(), self._hooks(), dtype
        )

    def t_rebuild_parameter(self, depth: int) -> bytes:
        return self._call(
            "_rebuild_parameter", self._tensor_value(depth), self._rg(), self._hooks()
        )

    def t_rebuild_parameter_with_state(self, depth: int) -> bytes:
        state = self.rng.choice(
            [ops.EMPTY_DICT, ops.dict_((self.str_code(), self.value(depth + 1)))]
        )
        return self._call(
            "_rebuild_parameter_with_state",
            self._tensor_value(depth),
            self._rg(),
            self._hooks(),
            state,
        )

    def t_rebuild_qtensor(self, depth: int) -> bytes:
        cls = self.rng.choice(
            ["QInt8Storage", "QUInt8Storage", "QInt32Storage", "QUInt4x2Storage", "FloatStorage"]
        )
        storage, numel = self._storage_arg(cls)
        offset, size, stride = self._geometry(numel)
        if self.chance(0.6):
            params = ops.tuple_(
                self.global_code("torch", "per_tensor_affine"),
                ops.BINFLOAT(self.rng.choice([0.1, 1.0, 0.0, float("nan")])),
                self.int_code(),
            )
        else:
            params = (
                ops.MARK
                + self.global_code(
                    "torch",
                    self.rng.choice(
                        [
                            "per_channel_affine",
                            "per_channel_affine_float_qparams",
                            "per_tensor_symmetric",
                        ]
                    ),
                )
                + self._tensor_value(depth)
                + self._tensor_value(depth)
                + self.int_code()
                + ops.TUPLE
            )
        return self._call(
            "_rebuild_qtensor", storage, offset, size, stride, params, self._rg(), self._hooks()
        )

    def t_rebuild_sparse_tensor(self, depth: int) -> bytes:
        layout = self._call(
            "_get_layout", self.str_code(self.rng.choice(LAYOUTS)), module="torch.serialization"
        )
        parts = [self._tensor_value(depth) for _ in range(self.rng.choice([2, 3]))]
        parts.append(self.size(depth, None)[0])
        if self.chance(0.5):
            parts.append(self.rng.choice([ops.NEWTRUE, ops.NEWFALSE, ops.NONE]))
        return self._call("_rebuild_sparse_tensor", layout, ops.MARK + b"".join(parts) + ops.TUPLE)

    def t_rebuild_meta_tensor_no_storage(self, depth: int) -> bytes:
        sizes = [self.small_int() for _ in range(self.rng.randrange(4))]
        return self._call(
            "_rebuild_meta_tensor_no_storage",
            self.dtype()[0],
            ops.tuple_(*(self.int_code(s) for s in sizes)),
            self.stride(sizes),
            self._rg(),
        )

    def t_rebuild_wrapper_subclass(self, depth: int) -> bytes:
        cls = self.global_code(
            *self.rng.choice(
                [
                    ("torch", "Tensor"),
                    ("torch.nn.parameter", "Parameter"),
                    ("collections", "OrderedDict"),
                ]
            )
        )
        sizes = [self.small_int() for _ in range(self.rng.randrange(3))]
        layout = self._call(
            "_get_layout", self.str_code("torch.strided"), module="torch.serialization"
        )
        device = self.str_code(self.rng.choice(["meta", "cpu", "cuda"]))
        return self._call(
            "_rebuild_wrapper_subclass",
            cls,
            self.dtype()[0],
            ops.tuple_(*(self.int_code(s) for s in sizes)),
            self.stride(sizes),
            self.int_code(0),
            layout,
            device,
            self._rg(),
        )

    def t_rebuild_device_tensor_from_cpu_tensor(self, depth: int) -> bytes:
        device = self.str_code(self.rng.choice(["cpu", "meta", "cuda"]))
        return self._call(
            "_rebuild_device_tensor_from_cpu_tensor",
            self._tensor_value(depth),
            self.dtype()[0],
            device,
            self._rg(),
        )

    def t_rebuild_device_tensor_from_numpy(self, depth: int) -> bytes:
        return self._call(
            "_rebuild_device_tensor_from_numpy",
            self.value(depth),
            self.dtype()[0],
            self.str_code("cpu"),
            self._rg(),
        )

    def t_rebuild_nested_tensor(self, depth: int) -> bytes:
        return self._call("_rebuild_nested_tensor", *(self._tensor_value(depth) for _ in range(4)))

    def t_rebuild_from_type_v2(self, depth: int) -> bytes:
        func = self.global_code(
            "torch._utils",
            self.rng.choice(["_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_tensor"]),
        )
        new_type = self.global_code(
            *self.rng.choice(
                [
                    ("torch", "Tensor"),
                    ("torch.nn.parameter", "Parameter"),
                    ("collections", "OrderedDict"),
                    ("torch", "Size"),
                ]
            )
        )
        storage, numel = self._storage_arg()
        offset, size, stride = self._geometry(numel)
        args = ops.MARK + storage + offset + size + stride + self._rg() + self._hooks() + ops.TUPLE
        if self.chance(0.3):
            args = self.args(depth + 1)
        state = self.rng.choice(
            [
                ops.EMPTY_DICT,
                ops.NONE,
                ops.dict_((self.str_code(), self.value(depth + 1))),
                ops.tuple_(ops.EMPTY_DICT, ops.dict_((self.str_code(), self.value(depth + 1)))),
            ]
        )
        return (
            ops.GLOBAL("torch._tensor", "_rebuild_from_type_v2")
            + ops.tuple_(func, new_type, args, state)
            + ops.REDUCE
        )

    def container(self, depth: int = 0) -> tuple[bytes, str]:
        r = self.rng.randrange(9)
        items = self.values(self.rng.randrange(4), depth + 1)
        if r == 0:
            return ops.tuple_(*items), "tuple"
        if r in (1, 2):
            return ops.list_(*items), "list"
        if r in (3, 4):
            pairs = [(self.key(depth), v) for v in items]
            return ops.dict_(*pairs), "dict"
        if r == 5:
            return ops.call("builtins", "set", ops.list_(*items)), "set"
        if r == 6:
            pairs = [ops.tuple_(self.str_code(), v) for v in items]
            return ops.call("collections", "OrderedDict", ops.list_(*pairs)), "od"
        if r == 7:
            return ops.call(
                "collections", "Counter", ops.dict_(*[(self.str_code(), v) for v in items])
            ), "counter"
        return ops.EMPTY_SET, "set"

    def call(self, depth: int = 0) -> tuple[bytes, str]:
        """A constructor of an allowed class or callable (or another), random arguments."""
        module, name = self.rng.choice(CALLABLE) if self.chance(0.8) else self.global_name()
        if self.target == "metadata" and self.chance(0.8):
            module, name = self.global_name()
        target = self.global_code(module, name)
        args = self._typed_args(name, depth) if self.chance(0.6) else self.args(depth)
        op = ops.NEWOBJ if self.chance(0.3) else ops.REDUCE
        if self.chance(0.03):
            op = self.rng.choice([ops.NEWOBJ_EX, ops.OBJ])
            if op == ops.NEWOBJ_EX:
                args += ops.dict_((self.str_code("x"), self.value(depth)))
        return target + args + op, "obj"

    def _typed_args(self, name: str, depth: int) -> bytes:
        if name in ("Size",):
            return ops.tuple_(self.size()[0])
        if name == "device":
            return ops.tuple_(
                self.str_code(self.rng.choice(["cpu", "meta", "cuda", "x"])),
                *([self.int_code()] if self.chance(0.3) else []),
            )
        if name in ("OrderedDict", "Counter", "set", "bytearray"):
            return ops.tuple_(self.container(depth + 1)[0])
        if name == "complex":
            return ops.tuple_(ops.BINFLOAT(1.0), ops.BINFLOAT(self.rng.choice(FLOATS)))
        if name == "encode":
            return ops.tuple_(
                self.str_code(),
                self.str_code(self.rng.choice(["latin1", "utf-8", "ascii", "hex", "rot13"])),
            )
        if name == "Parameter":
            return ops.tuple_(self._tensor_value(depth), self._rg())
        if name.endswith("Tensor") or name.endswith("Storage"):
            return ops.tuple_(
                self.rng.choice(
                    [
                        self.size()[0],
                        self._tensor_value(depth),
                        self._storage_arg()[0],
                        ops.list_(ops.BINFLOAT(1.0)),
                        self.int_code(self.rng.randint(0, 4)),
                    ]
                )
            )
        return self.args(depth)

    def mutation(self, depth: int = 0) -> tuple[bytes, str]:
        """A memoized value (or a fresh global) mutated by BUILD, APPEND(S), SETITEM(S),
        REDUCE or NEWOBJ."""
        r = self.rng.randrange(10)
        kinds = (
            ("tensor", "param", "od", "counter", "obj") if r < 4
            else ("list",) if r < 6
            else ("dict", "od", "counter") if r < 8
            else ("global",)
        )  # fmt: skip
        target = self.ref(kinds) if self.chance(0.85) else self.ref()
        if target is None or self.chance(0.1):
            target = self.global_code()
        if r < 4:
            return target + self._state(depth) + ops.BUILD, "obj"
        if r == 4:
            return target + self.value(depth) + ops.APPEND, "list"
        if r == 5:
            items = b"".join(self.values(self.rng.randrange(3), depth))
            return target + ops.MARK + items + ops.APPENDS, "list"
        if r == 6:
            return target + self.key(depth) + self.value(depth) + ops.SETITEM, "dict"
        if r == 7:
            n = self.rng.randrange(3)
            items = b"".join(self.key(depth) + self.value(depth) for _ in range(n))
            if self.chance(0.1):
                items += self.value(depth)
            return target + ops.MARK + items + ops.SETITEMS, "dict"
        if r == 8:
            return target + self.args(depth) + ops.REDUCE, "obj"
        return target + self.args(depth) + ops.NEWOBJ, "obj"

    def key(self, depth: int = 0) -> bytes:
        r = self.rng.random()
        if r < 0.6:
            return self.str_code()
        if r < 0.85:
            return self.int_code()
        return self.value(depth + 1)

    def _state(self, depth: int) -> bytes:
        name = self.rng.choice(
            [
                "__defaults__",
                "_dtype",
                "dtype",
                "x",
                "_untyped_storage",
                "__class__",
                "__dict__",
                "requires_grad",
                "data",
                "_metadata",
                "cloudckpt_poisoned",
            ]
        )
        entry = ops.dict_((self.str_code(name), self.value(depth + 1)))
        r = self.rng.randrange(8)
        if r == 0:
            return entry
        if r == 1:
            return ops.tuple_(ops.NONE, entry)
        if r == 2:
            return ops.tuple_(entry, entry)
        if r == 3:  # a tensor's legacy state: set_(storage, offset, size, stride)
            storage, numel = self._storage_arg()
            return ops.tuple_(storage, *self._geometry(numel))
        if r == 4:
            return ops.tuple_(ops.NEWFALSE, ops.NONE, ops.NONE)
        if r == 5:  # a Parameter's state
            return ops.tuple_(self._rg(), ops.NONE, self._hooks())
        if r == 6:
            return ops.MARK + b"".join(self.values(5, depth + 1)) + ops.TUPLE
        return self.value(depth + 1)

    def noise(self) -> bytes:
        if self.chance(0.5):
            return self.rng.choice(NOARG_OPS)
        return self.rng.choice(
            [
                ops.EXT1(1),
                ops.FRAME(4),
                ops.MEMOIZE,
                ops.POP,
                ops.DUP,
                ops.SHORT_BINBYTES(b"ab"),
                ops.BINBYTES(b"x"),
                ops.LONG_BINPUT(2**32 - 1),
                ops.INT(5),
                ops.STRING("s"),
                ops.PERSID("0"),
            ]
        )

    def memoize(self, kind: str) -> bytes:
        i = self.next_memo
        self.next_memo += 1
        self.refs.append((i, kind))
        if kind == "storage":
            self.elements[i] = self._elements
        if self.target == "metadata" and self.chance(0.3):
            return ops.MEMOIZE if i == len(self.refs) - 1 else ops.BINPUT(i & 0xFF)
        return ops.BINPUT(i) if i < 256 else ops.LONG_BINPUT(i)

    def statement(self) -> bytes:
        r = self.rng.random()
        if self.constructive:  # values only: what torch accepts, mostly
            r = r * 0.58 if r > 0.22 or self.chance(0.5) else 0.1 + r  # no globals, mostly
        if r < 0.1:
            code, kind = self.const()
        elif r < 0.22:
            code, kind = self.global_code(), "global"
        elif r < 0.32:
            code, kind = self.container()
        elif r < 0.4:
            code, kind = self.storage()
        elif r < 0.58:
            code, kind = self.tensor()
        elif r < 0.72:
            code, kind = self.call()
        elif r < 0.97:
            code, kind = self.mutation()
        else:
            return self.noise()
        return code + self.memoize(kind)

    def snippet(self) -> bytes:
        """A few opcodes to insert into a real pickle (memo indices as it has them)."""
        r = self.rng.random()
        if r < 0.3:
            return self.noise()
        if r < 0.5:
            found = self.ref()
            return (
                found
                + self.rng.choice([ops.BUILD, ops.APPEND, ops.REDUCE, ops.NEWOBJ, ops.SETITEM, b""])
                if found
                else self.noise()
            )
        if r < 0.7:
            return self.mutation()[0]
        return self.statement()

    def program(self) -> bytes:
        parts = [ops.PROTO(4 if self.target == "metadata" and self.chance(0.5) else 2)]
        if self.chance(0.03):
            parts = [self.rng.choice([b"", ops.PROTO(5), ops.PROTO(0)])]
        self.constructive = self.chance(0.4)
        for _ in range(self.rng.randint(1, 6)):
            parts.append(self.statement())
        if self.refs and self.chance(0.85):
            chosen = self.rng.sample(self.refs, min(len(self.refs), self.rng.randint(1, 8)))
            parts.append(
                ops.MARK
                + b"".join(ops.BINGET(i) if i < 256 else ops.LONG_BINGET(i) for i, _ in chosen)
                + ops.TUPLE
            )
        parts.append(ops.STOP)
        if self.chance(0.02):
            parts.append(self.noise())
        return b"".join(parts)


# --- attacks (issue 39) ---------------------------------------------------------------------

#: What an integer position holds when it does not hold the right value: bools (an int
#: to Python, not to torch's checks), zero, negatives, and values too large for any size.
HOSTILE_INTS: list[int] = [
    True, False, 0, -1, -2, -(2**31), -(2**63), 2**31 - 1, 2**31, 2**32, 2**40, 2**62,
    2**63 - 1, 2**63, 2**64, 10**30,
]  # fmt: skip
#: Attribute names a BUILD state or a SETITEM may set.
ATTR_NAMES = [
    "_value_", "_name_", "__objclass__", "_sort_order_", "x", "requires_grad", "data",
    "grad", "_backward_hooks", "__class__", "__dict__", "__defaults__", "_dtype", "dtype",
    "_untyped_storage", "_metadata", "state_dict_metadata", "planner_data", "storage_data",
    "fqn", "offset", "index", "type", "properties", "memory_format", "cloudckpt_poisoned",
]  # fmt: skip
#: Storage classes with the dtype their tensors have.
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
}  # fmt: skip
PLAIN_STORAGES = [c for c in STORAGE_DTYPES if c in STORAGE_TABLE]
#: Allowed classes whose constructor, given sizes, allocates: (module, name, itemsize).
SIZE_CLASSES = [
    ("torch", "FloatTensor", 4), ("torch", "DoubleTensor", 8), ("torch", "ByteTensor", 1),
    ("torch", "LongTensor", 8), ("torch", "BoolTensor", 1), ("torch", "HalfTensor", 2),
    ("torch", "BFloat16Tensor", 2), ("torch", "Tensor", 4), ("torch.sparse", "FloatTensor", 4),
    ("builtins", "bytearray", 1),
]  # fmt: skip
_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
#: DCP ``.metadata`` classes made empty by NEWOBJ (as pickle makes a dataclass).
METADATA_CLASSES = [
    (_DCP_MD, "Metadata"), (_DCP_MD, "StorageMeta"), (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"), (_DCP_MD, "TensorProperties"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), (_DCP_PLANNER, "SavePlan"),
    (_DCP_PLANNER, "WriteItem"), (_DCP_PLANNER, "TensorWriteData"),
]  # fmt: skip
#: DCP's enums, and the values of their members (and one that is none).
METADATA_ENUMS = [
    ((_DCP_MD, "_MEM_FORMAT_ENCODING"), [0, 1, 2, 7]),
    ((_DCP_PLANNER, "WriteItemType"), [1, 2, 3, 0]),
]


#: What requires_grad holds when it does not hold a bool.
_HOSTILE_FLAGS = [
    ops.int_(0), ops.int_(1), ops.int_(2), ops.int_(-1), ops.LONG1(2**64), ops.NONE,
    ops.BINFLOAT(1.0),
]  # fmt: skip


def _get(i: int) -> bytes:
    return ops.BINGET(i) if i < 256 else ops.LONG_BINGET(i)


def _is_intlike(args: list[Any]) -> bool:
    return bool(args) and all(type(a) in (int, bool) for a in args)


class Attack(Gen):
    """Programs aimed at what :class:`Gen`'s rarely reach (issue 39): every integer
    position (sizes, strides, offsets, a persistent id's element count, requires_grad)
    sometimes a bool, zero, a negative or a huge value (:meth:`num`); views that reach
    past, share (stride 0) or overlap their storage, also inside the device rebuild
    that copies them; BUILD of states of every length (0-5 items; tuple, list, dict) on
    every kind of object the machine builds (tensors, parameters, containers, instances
    of allowed classes, and what allowed calls return: enum members, dtypes, layouts,
    ``torch.Size``, ``torch.device``); SETITEM(S) and APPEND(S) on what allowed calls
    return; the legacy size constructors with bools among the sizes.

    The program's result is a dict of named values (so ``keys=`` can pick some); under
    the ``.metadata`` policy a ``Metadata`` that holds them in an attribute of its own.
    ``expect``: set where the program holds what cloudckpt must refuse although torch
    runs it (a size constructor: docs/security.md, "Constructors")."""

    def __init__(
        self, rng: random.Random, storages: dict[str, bytes], target: str, budget: int
    ) -> None:
        super().__init__(rng, storages, target)
        self.p_bad = rng.choice([0.0, 0.03, 0.1, 0.25])
        self.budget = budget  # bytes a device rebuild may copy a view into
        self.expect: str | None = None
        self.classes = {
            k: "FloatStorage" if len(v) > 4096 and self.chance(0.6) else rng.choice(PLAIN_STORAGES)
            for k, v in storages.items()
        }
        self.memo_of: dict[str, int] = {}
        self.top: list[tuple[str, int]] = []
        self.last_key: str | None = None  # the storage of the last view made

    # -- integers
    def encode(self, value: int) -> bytes:
        if value is True or value is False:
            return ops.bool_(value)
        if self.chance(0.08):
            return ops.LONG1(value)
        return ops.int_(value)

    def num(self, right: int) -> bytes:
        """An integer position: ``right``, or (at this program's rate) a hostile value."""
        value = right
        if self.chance(self.p_bad):
            if self.chance(0.6):
                value = self.rng.choice(HOSTILE_INTS)
            else:
                value = self.rng.choice([right + 1, right - 1, 2 * right, 16 * right + 1, -right])
        return self.encode(value)

    def nums(self, values: list[int]) -> bytes:
        code = ops.tuple_(*(self.num(v) for v in values))
        if self.chance(0.03):
            code = ops.list_(*(self.num(v) for v in values))
        elif self.chance(0.03):
            code = ops.call("torch", "Size", code)
        return code

    def rg(self) -> bytes:
        if self.chance(self.p_bad):
            return self.rng.choice(_HOSTILE_FLAGS)
        return ops.NEWTRUE if self.chance(0.04) else ops.NEWFALSE

    def hooks(self) -> bytes:
        if self.chance(0.9):
            return ops.ordered_dict()
        return self.rng.choice([ops.EMPTY_DICT, ops.NONE])

    # -- storages and views
    def storage_ref(self, key: str | None = None) -> tuple[bytes, int, str]:
        """A storage (its memoized object, or a persistent id naming its record), its
        element count, its class."""
        if not self.storages:
            return ops.storage("FloatStorage", "0", "cpu", 4), 4, "FloatStorage"
        key = key if key is not None else self.rng.choice(list(self.storages))
        cls = self.classes[key]
        itemsize = STORAGE_TABLE[cls][1]
        numel = len(self.storages[key]) // itemsize
        if key in self.memo_of and self.chance(0.85):
            return _get(self.memo_of[key]), numel, cls
        named = cls if not self.chance(self.p_bad / 2) else self.rng.choice(PLAIN_STORAGES)
        location = "cpu"
        if self.chance(self.p_bad / 2):
            location = self.rng.choice(["cuda", "cuda:0", "meta"])
        code = (
            ops.MARK
            + self.str_code("storage")
            + ops.GLOBAL(STORAGE_TABLE[named][0], named)
            + self.str_code(key)
            + self.str_code(location)
            + self.num(numel)
            + ops.TUPLE
            + ops.BINPERSID
        )
        if key not in self.memo_of:
            self._elements = numel
            code += self.memoize("storage")
            self.memo_of[key] = self.next_memo - 1
        return code, numel, cls

    def shape(self, numel: int, kind: str | None = None) -> tuple[int, list[int], list[int]]:
        """A view of ``numel`` elements: (offset, size, stride); ``kind`` as named below."""
        rng = self.rng
        kind = kind or rng.choice(
            ["full", "full", "split", "part", "transposed", "stride0", "stride0", "overlap",
             "beyond", "grow", "empty", "scalar"]
        )  # fmt: skip
        n = max(numel, 1)
        if kind == "full":
            return 0, [numel], [1]
        if kind == "split":
            a = rng.choice([d for d in (2, 4, 8, 64, 256) if numel % d == 0] or [1])
            return 0, [a, numel // a], [numel // a, 1]
        if kind == "part":
            offset = rng.randrange(n)
            return offset, [rng.randint(0, max(numel - offset, 0))], [1]
        if kind == "transposed":
            a = rng.choice([d for d in (2, 4, 8, 16) if numel % d == 0] or [1])
            return 0, [numel // a, a], [1, numel // a]
        if kind == "stride0":  # one element (a row) repeated: much more than the storage
            offset = rng.randrange(n)
            row = min(rng.randint(1, 8), max(numel - offset, 1))
            count = rng.choice([2, 2**10, 2**16, max(self.budget // (8 * row), 2)])
            return rng.choice(
                [
                    (offset, [count], [0]),
                    (offset, [row, count], [1, 0]),
                    (offset, [count, row], [0, 1]),
                ]
            )
        if kind == "overlap":  # rows that share elements
            m = max(min(numel, 16), 1)
            rows = max(numel - m + 1, 1)
            return 0, [rows, m], [1, 1] if self.chance(0.5) else [max(m // 2, 1), 1]
        if kind == "beyond":
            return rng.choice(
                [(0, [numel + 1], [1]), (numel, [1], [1]), (0, [2, numel], [numel, 1])]
            )
        if kind == "grow":  # what set_ would resize the storage to
            return 0, [numel * rng.choice([2, 16, 256, 4096]) + rng.choice([0, 1])], [1]
        if kind == "empty":
            return rng.choice([(0, [0], [1]), (numel, [0], [1]), (0, [3, 0], [0, 1])])
        return rng.randrange(n), [], []  # a scalar

    def view(self, key: str | None = None, kind: str | None = None) -> bytes:
        """A tensor over a storage, by one of the rebuilds over a storage."""
        if key is None and self.storages:
            key = self.rng.choice(list(self.storages))
        self.last_key = key  # a BUILD of the tensor mostly names the same storage
        storage, numel, cls = self.storage_ref(key)
        offset, size, stride = self.shape(numel, kind)
        which = self.rng.choice(["v2"] * 6 + ["v1", "v3"]) if kind is None else "v2"
        geometry = [self.num(offset), self.nums(size), self.nums(stride)]
        if which == "v1":
            return self._call("_rebuild_tensor", storage, *geometry)
        if which == "v3":
            dtype = self.global_code("torch", STORAGE_DTYPES.get(cls, "uint8"))
            return self._call(
                "_rebuild_tensor_v3", storage, *geometry, self.rg(), self.hooks(), dtype
            )
        args = [storage, *geometry, self.rg(), self.hooks()]
        if self.chance(0.04):
            args.append(self.rng.choice([ops.EMPTY_DICT, ops.NONE]))
        return self._call("_rebuild_tensor_v2", *args)

    def device_rebuild(self) -> bytes:
        """``_rebuild_device_tensor_from_cpu_tensor`` of a view (stride 0 mostly: what
        ``.to`` copies into a tensor of its full size), to a dtype (another: a copy)."""
        if self.chance(0.15) and any(k in ("tensor", "param") for _, k in self.refs):
            data = self.ref(("tensor", "param")) or b""
        else:
            data = self.view(kind="stride0" if self.chance(0.7) else None)
        dtype = self.rng.choice(["float64", "int64", "float32", "float16", "bfloat16", "uint8"])
        device = self.rng.choice(["cpu"] * 6 + ["cuda", "cuda:0", "meta"])
        return self._call(
            "_rebuild_device_tensor_from_cpu_tensor",
            data,
            self.global_code("torch", dtype),
            self.str_code(device),
            self.rg(),
        )

    def parameter(self) -> bytes:
        data = self.view()
        r = self.rng.randrange(4)
        if r == 0:
            return self._call("_rebuild_parameter", data, self.rg(), self.hooks())
        if r == 1:
            state = ops.dict_((self.str_code(self.rng.choice(ATTR_NAMES)), self.item(1)))
            return self._call("_rebuild_parameter_with_state", data, self.rg(), self.hooks(), state)
        target = ops.GLOBAL("torch.nn.parameter", "Parameter")
        args = ops.tuple_(data, self.rg()) if self.chance(0.7) else ops.tuple_(data)
        return target + args + (ops.NEWOBJ if r == 2 else ops.REDUCE)

    def size_constructor(self) -> bytes:
        """A legacy size constructor (``FloatTensor(32768, 16384, True)``: 2 GiB from
        a few bytes under torch); a few MiB here, so that the oracle stays cheap."""
        module, name, _ = self.rng.choice(SIZE_CLASSES)
        rng = self.rng
        r = rng.random()
        args: list[Any]
        if r < 0.4:
            args = [rng.choice([256, 1024, 2048]), rng.choice([256, 1024]), True]
        elif r < 0.55:
            args = [rng.choice([True, False])]
        elif r < 0.7:
            args = [rng.choice([0, 1, 3, 1024, 65536])]
        elif r < 0.8:
            args = [True, rng.choice([1024, 65536])]
        elif r < 0.9:
            args = [rng.choice([-1, 2**63, 2**31])] + [True] * rng.randint(0, 1)
        else:
            args = ["size", rng.choice([[1024, True], [True], [512, 512]])]
        if args and args[0] == "size":
            code = ops.tuple_(ops.call("torch", "Size", ops.tuple_(*map(self.encode, args[1]))))
            intlike = True
        else:
            code = ops.tuple_(*map(self.encode, args))
            intlike = _is_intlike(args)
        op = ops.NEWOBJ if self.chance(0.3) else ops.REDUCE
        if intlike and not (name == "bytearray" and op == ops.NEWOBJ):  # (__new__ ignores them)
            self.expect = f"the size constructor {module}.{name}{tuple(args)}"
        return ops.GLOBAL(module, name) + code + op

    # -- what allowed calls return, and what BUILD fills
    def call_result(self) -> tuple[bytes, str]:
        """A call of an allowed callable that returns an object: a new one, or one every
        load shares (an enum member, a layout, the tensor it was given)."""
        rng = self.rng
        if self.target == "metadata":
            r = rng.randrange(9)
            if r < 3:
                (module, name), values = rng.choice(METADATA_ENUMS)
                op = ops.NEWOBJ if self.chance(0.3) else ops.REDUCE
                value = rng.choice(values)
                return self.global_code(module, name) + ops.tuple_(
                    self.encode(value)
                ) + op, "member"
            if r < 5:
                module, name = rng.choice(METADATA_CLASSES)
                return self.global_code(module, name) + ops.EMPTY_TUPLE + ops.NEWOBJ, "obj"
            if r == 5:
                return ops.call("torch", "Size", self.nums([2, 3])), "size"
            if r == 6:
                return ops.call("collections", "OrderedDict"), "od"
            if r == 7:
                path = rng.choice(["PosixPath", "PurePosixPath"])
                return ops.call("pathlib", path, self.str_code("x")), "path"
            layout = self.str_code(rng.choice(["torch.strided", "torch.sparse_coo"]))
            return ops.call("torch.serialization", "_get_layout", layout), "layout"
        r = rng.randrange(13)
        if r == 0:
            return ops.call("torch", "Size", self.nums([2, 3])), "size"
        if r == 1:
            return ops.call("torch", "device", self.str_code(rng.choice(["cpu", "meta"]))), "device"
        if r == 2:
            return ops.ordered_dict(), "od"
        if r == 3:
            return ops.call("collections", "Counter"), "counter"
        if r == 4:
            return ops.call("builtins", "set", ops.list_(self.encode(1))), "set"
        if r == 5:
            return ops.call("builtins", "complex", ops.BINFLOAT(1.0), ops.BINFLOAT(2.0)), "complex"
        if r == 6:
            data = ops.call("_codecs", "encode", self.str_code("ab"), self.str_code("latin1"))
            return ops.call("builtins", "bytearray", data), "bytearray"
        if r == 7:
            return ops.call(
                "_codecs", "encode", self.str_code(""), self.str_code("latin1")
            ), "bytes"
        if r == 8:
            layout = self.str_code(rng.choice(["torch.strided", "torch.sparse_coo"]))
            return ops.call("torch.serialization", "_get_layout", layout), "layout"
        if r == 9:  # returns the tensor it was given where dtype and device are its own
            return self._call(
                "_rebuild_device_tensor_from_cpu_tensor",
                self.ref(("tensor",)) or self.view(),
                self.global_code("torch", "float32"),
                self.str_code("cpu"),
                ops.NEWFALSE,
            ), "tensor"
        if r == 10:
            return ops.GLOBAL("torch", "Tensor") + ops.EMPTY_TUPLE + ops.NEWOBJ, "tensor"
        if r == 11:
            return ops.call(
                "torch", rng.choice(["FloatTensor", "DoubleTensor", "Tensor"])
            ), "tensor"
        return self.global_code("torch", rng.choice(["float32", "int8", "bool"])), "global"

    def build_target(self) -> tuple[bytes, str]:
        r = self.rng.randrange(10)
        if self.target != "metadata" and r < 3:
            return self.view(kind="full" if self.chance(0.5) else None), "tensor"
        if self.target != "metadata" and r == 3:
            return self.parameter(), "param"
        if r == 4 and self.refs:
            i, kind = self.rng.choice(self.refs)
            return _get(i), kind
        if r == 5:
            return self.rng.choice([(ops.EMPTY_DICT, "dict"), (ops.EMPTY_LIST, "list")])
        return self.call_result()

    def _numel(self, key: str) -> int:
        return len(self.storages[key]) // STORAGE_TABLE[self.classes[key]][1]

    def positional(self, n: int) -> list[bytes]:
        """A tensor's legacy state, ``set_``'s arguments: (storage, offset, size,
        stride, ...) cut to ``n`` items; the storage sometimes a tensor instead. (Only
        the items kept are generated: a memo entry made in one dropped would dangle.)"""
        if n == 0:
            return []
        key = self.rng.choice(list(self.storages)) if self.storages else None
        if self.last_key is not None and self.chance(0.75):
            key = self.last_key
        if self.chance(0.2):
            first = self.view() if self.chance(0.5) else (self.ref(("tensor", "param")) or ops.NONE)
            numel = self._numel(key) if key is not None else 4
        else:
            first, numel, _ = self.storage_ref(key)
        offset, size, stride = self.shape(numel, "grow" if self.chance(0.5) else None)
        makers: list[Callable[[], bytes]] = [
            lambda: self.num(offset),
            lambda: self.nums(size),
            lambda: self.nums(stride),
            lambda: self.item(1),
        ]
        return [first] + [make() for make in makers[: n - 1]]

    def state(self, kind: str) -> bytes:
        """A BUILD state: a tuple or list of 0 to 5 items, a dict, or one value."""
        rng = self.rng
        n = rng.randint(0, 5)
        form = rng.choice(["tuple", "tuple", "tuple", "list", "dict", "dict", "value"])
        tensor = kind in ("tensor", "param") and self.target != "metadata"
        if tensor and form in ("tuple", "list"):
            n = rng.choice([0, 1, 2, 3, 3, 3, 4, 4, 5])  # set_'s own lengths most
        if form == "dict":
            return ops.dict_(
                *[(self.str_code(rng.choice(ATTR_NAMES)), self.item(1)) for _ in range(n)]
            )
        if form == "value":
            return self.item(1)
        if tensor and self.chance(0.75):
            items = self.positional(n)
        elif kind == "param" and self.chance(0.5):
            makers: list[Callable[[], bytes]] = [
                self.rg,
                lambda: ops.NONE,
                self.hooks,
                lambda: self.item(1),
                lambda: self.item(1),
            ]
            items = [make() for make in makers[:n]]
        elif n == 2 and self.chance(0.5):  # (dict state, slot state)
            items = [
                rng.choice(
                    [ops.NONE, ops.EMPTY_DICT, ops.dict_((self.str_code("x"), self.item(1)))]
                ),
                ops.dict_((self.str_code(rng.choice(ATTR_NAMES)), self.item(1))),
            ]
        else:
            items = [self.item(1) for _ in range(n)]
        return ops.tuple_(*items) if form == "tuple" else ops.list_(*items)

    def item(self, depth: int = 0) -> bytes:
        """A value inside a state or a container."""
        r = self.rng.randrange(11)
        archive = self.target != "metadata"
        if r == 0 and archive:
            return self.storage_ref()[0]
        if r in (0, 1):
            return self.num(self.rng.choice([0, 1, 2, 7, 64]))
        if r == 2:
            return self.nums([self.rng.randint(0, 4) for _ in range(self.rng.randrange(3))])
        if r == 3:
            return ops.NONE
        if r == 4:
            return ops.bool_(self.chance(0.5))
        if r == 5:
            return self.str_code()
        if r == 6:
            return self.rng.choice([ops.EMPTY_DICT, ops.ordered_dict(), ops.EMPTY_LIST])
        if r == 7 and depth < 2:
            return self.view() if archive else self.call_result()[0]
        if r == 8 and self.refs:
            return _get(self.rng.choice(self.refs)[0])
        if depth < 2:
            return self.call_result()[0]
        return ops.NONE

    def build(self) -> tuple[bytes, str]:
        target, kind = self.build_target()
        code = target + self.state(kind) + ops.BUILD
        if self.chance(0.15):
            code += self.state(kind) + ops.BUILD
        return code, kind

    def mutate(self) -> tuple[bytes, str]:
        """SETITEM(S), APPEND(S) or BUILD on what an allowed call returned (or an
        earlier value)."""
        if self.refs and self.chance(0.2):
            i, kind = self.rng.choice(self.refs)
            code = _get(i)
        else:
            code, kind = self.call_result()
        for _ in range(self.rng.randint(1, 2)):
            r = self.rng.randrange(5)
            if r == 0:
                code += self.state(kind) + ops.BUILD
            elif r == 1:
                code += self.str_code(self.rng.choice(ATTR_NAMES)) + self.item(1) + ops.SETITEM
            elif r == 2:
                pairs = b"".join(
                    self.str_code(self.rng.choice(ATTR_NAMES)) + self.item(1)
                    for _ in range(self.rng.randrange(3))
                )
                code += ops.MARK + pairs + ops.SETITEMS
            elif r == 3:
                code += self.item(1) + ops.APPEND
            else:
                items = b"".join(self.item(1) for _ in range(self.rng.randrange(3)))
                code += ops.MARK + items + ops.APPENDS
        return code, kind

    def attack(self) -> tuple[bytes, str]:
        r = self.rng.random()
        if self.target == "metadata":
            if r < 0.4:
                return self.build()
            if r < 0.8:
                return self.mutate()
            if r < 0.9:
                return self.call_result()
            code, kind = self.container()
            return code, kind
        if r < 0.12:
            return self.view(), "tensor"
        if r < 0.27:
            return self.device_rebuild(), "tensor"
        if r < 0.62:
            return self.build()
        if r < 0.74:
            return self.mutate()
        if r < 0.82:
            return self.size_constructor(), "tensor"
        if r < 0.9:
            return self.parameter(), "param"
        if r < 0.95:
            return self.call_result()
        return self.tensor()  # Gen's rebuilds (sparse, quantized, nested...)

    def program(self, attacks: int = -1, plain: list[str] | None = None) -> bytes:  # type: ignore[override]
        """PROTO, ``plain`` (storage keys: a tensor over each, as torch.save writes
        it), ``attacks`` attack statements (-1: 1 to 5), each value memoized and most
        put in the dict the pickle returns (or in the ``Metadata``)."""
        metadata = self.target == "metadata"
        parts = [ops.PROTO(4 if metadata and self.chance(0.5) else 2)]
        for n, key in enumerate(plain or []):
            parts.append(self.view(key, "full" if self.chance(0.85) else "split"))
            parts.append(self.memoize("tensor"))
            self.top.append((f"w{n}", self.next_memo - 1))
        for n in range(self.rng.choice([1, 1, 2, 3, 5]) if attacks < 0 else attacks):
            code, kind = self.attack()
            parts.append(code + self.memoize(kind))
            if self.chance(0.85):
                self.top.append((f"x{n}", self.next_memo - 1))
        pairs = b"".join(self.str_code(name) + _get(i) for name, i in self.top)
        top = ops.EMPTY_DICT + (ops.MARK + pairs + ops.SETITEMS if pairs else b"")
        if metadata:
            state = ops.dict_(
                (self.str_code("state_dict_metadata"), ops.EMPTY_DICT),
                (self.str_code("fuzz_values"), top),  # an attribute nothing checks
            )
            top = (
                self.global_code(_DCP_MD, "Metadata")
                + ops.EMPTY_TUPLE
                + ops.NEWOBJ
                + state
                + ops.BUILD
            )
        return b"".join(parts) + top + ops.STOP


# --- cases ------------------------------------------------------------------------------


@dataclass
class Case:
    index: int
    target: str  # "archive" | "metadata"
    source: str
    data: bytes  # the whole archive, or the .metadata pickle
    pkl: bytes
    undamaged: bytes | None = None  # the archive before its zip bytes were damaged
    #: "classic" (mutated and generated, small records, one entry point), "attack"
    #: (:class:`Attack`'s programs, small records) or "records" (large records, every
    #: path of cloudckpt.load).
    mode: str = "classic"
    #: What cloudckpt must refuse in it although torch runs it (docs/security.md).
    expect: str | None = None
    keys: list[str] = field(default_factory=list)  # for the "keys" entries
    #: cloudckpt's loads of a "records" case: "file", "keys" (the file with keys=),
    #: "s3", "s3-keys" (the object on the run's moto server).
    entries: list[str] = field(default_factory=list)


#: The fuzzer's targets: "all" is the "classic" cases (archives and DCP metadata, 80:20)
#: with a share of each new kind mixed in.
TARGETS = ("all", "classic", "archive", "metadata", "attack", "records")
#: In "all", the share of cases of each new kind (issue 39; the rest are classic cases).
RECORDS_SHARE = 0.004
ATTACK_SHARE = 0.1
#: Seconds a batch may take per case of each kind (on top of 30).
_COST = {"classic": 0.5, "attack": 0.5, "records": 4.0}


def case_mode(seed: int, index: int, target: str) -> str:
    """Which kind of case ``index`` of run ``seed`` is (drawn apart from the case
    itself, so that the classic cases of "all" are those of "classic")."""
    if target in ("attack", "records"):
        return target
    if target != "all":
        return "classic"
    k = random.Random(f"cloudckpt-fuzz/{seed}/{index}/kind").random()
    if k < RECORDS_SHARE:
        return "records"
    return "attack" if k < RECORDS_SHARE + ATTACK_SHARE else "classic"


def make_case(corpus: Corpus, seed: int, index: int, target: str) -> Case:
    """Case ``index`` of run ``seed``: a function of those alone (and the corpus)."""
    mode = case_mode(seed, index, target)
    rng = random.Random(f"cloudckpt-fuzz/{seed}/{index}")
    if mode == "attack":
        return _attack_case(rng, index)
    if mode == "records":
        return _records_case(rng, index)
    if target in ("all", "classic"):
        target = "archive" if rng.random() < 0.8 else "metadata"
    if target == "metadata":
        return _metadata_case(corpus, rng, index)
    r = rng.random()
    if r < 0.5:
        name, pkl, storages = rng.choice(corpus.archives)
        storages = dict(storages)
        gen = Gen(rng, storages, "archive")
        pkl, done = Mutator(rng, gen).mutate(pkl, [p for _, p, _ in corpus.archives], _rounds(rng))
        source = f"mutate({name}):{'+'.join(done)}"
    else:
        storages = {
            "0": rng.randbytes(64),
            "1": rng.randbytes(16),
            "2": b"",
            "3": rng.randbytes(8),
        }
        gen = Gen(rng, storages, "archive")
        pkl = gen.program()
        source = "generate"
        if r > 0.9:
            pkl, done = Mutator(rng, Gen(rng, storages, "archive")).mutate(pkl, [pkl], 1)
            source += f"+mutate:{'+'.join(done)}"
    if rng.random() < 0.04:
        storages, what = _damage_storages(rng, storages)
        source += f"+storages:{what}"
    data = undamaged = craft.torch_archive(pkl, storages)
    if rng.random() < 0.03:
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        data = bytes(buf)
        source += "+zip"
    return Case(index, "archive", source, data, pkl, undamaged if data != undamaged else None)


def _attack_case(rng: random.Random, index: int) -> Case:
    """An :class:`Attack` program: a DCP ``.metadata`` (a quarter), or an archive over
    small records loaded by the run's entry point."""
    if rng.random() < 0.25:
        pkl = Attack(rng, {}, "metadata", 0).program()
        return Case(index, "metadata", "attack-metadata", pkl, pkl, mode="attack")
    storages = {
        "0": rng.randbytes(64),
        "1": rng.randbytes(16),
        "2": b"",
        "3": rng.randbytes(8),
        "4": rng.randbytes(rng.choice([256, 4096])),
    }
    gen = Attack(rng, storages, "archive", rng.choice([1 << 16, 1 << 20, 16 << 20]))
    pkl = gen.program(plain=rng.sample(["0", "1", "4"], rng.randint(0, 2)))
    source, expect = "attack", gen.expect
    if rng.random() < 0.15:
        pkl, done = Mutator(rng, Gen(rng, storages, "archive")).mutate(pkl, [pkl], 1)
        source, expect = source + f"+mutate:{'+'.join(done)}", None
    data = craft.torch_archive(pkl, storages)
    keys = [name for name, _ in gen.top]
    return Case(index, "archive", source, data, pkl, mode="attack", expect=expect, keys=keys)


def _filler(rng: random.Random, n: int) -> bytes:
    """``n`` bytes of a record (a random 4 KiB repeated: cheap to make)."""
    pattern = rng.randbytes(4096)
    return (pattern * (n // 4096 + 1))[:n]


def _records_case(rng: random.Random, index: int) -> Case:
    """An archive of realistic size: 1 to 3 records of 1 to 8 MiB (read straight into
    their storages by the reader threads while data.pkl is unpickled), often one about
    the small-record threshold, a few small ones; its data.pkl a tensor over most
    records, as torch.save writes it, and none to four :class:`Attack` statements
    (or that, mutated). Loaded by cloudckpt.load of a file, of the file with ``keys=``
    and (a quarter) of an ``s3://`` object on the run's moto server."""
    storages: dict[str, bytes] = {}
    total = 0
    for n in range(rng.randint(1, 3)):
        size = rng.choice([1, 2, 3, 4, 6, 8]) << 20
        if total + size > 12 << 20:
            break
        storages[str(n)] = _filler(rng, size + rng.choice([0, 16, 4096]))
        total += size
    if rng.random() < 0.5:  # about engine/records.py's SMALL_RECORD (256 KiB)
        storages["m"] = _filler(rng, (256 << 10) + rng.choice([-64, 0, 64]))
    for n in range(rng.randint(0, 3)):
        storages[f"s{n}"] = rng.randbytes(rng.choice([16, 64, 4096]))
    # a device rebuild's copy: large enough that two of them show over one
    gen = Attack(rng, storages, "archive", rng.choice([64 << 20, 128 << 20, 1 << 20]))
    plain = [k for k in storages if rng.random() < 0.8]
    r = rng.random()
    expect = None
    if r < 0.25:
        gen.p_bad = 0.0
        pkl, source = gen.program(0, plain), "records-plain"
    elif r < 0.75:
        pkl, source = gen.program(rng.randint(1, 4), plain), "records-attack"
        expect = gen.expect
    else:
        pkl = gen.program(rng.randint(0, 2), plain)
        pkl, done = Mutator(rng, Gen(rng, storages, "archive")).mutate(pkl, [pkl], _rounds(rng))
        source = f"records-mutate:{'+'.join(done)}"
    names = [name for name, _ in gen.top] or ["w0"]
    keys = rng.sample(names, min(len(names), rng.randint(1, 2)))
    entries = ["file", "keys"]
    if rng.random() < 0.25:  # (moto takes 5 times as long as a file)
        entries.append(rng.choice(["s3", "s3", "s3-keys"]))
    data = craft.torch_archive(pkl, storages)
    return Case(
        index,
        "archive",
        source,
        data,
        pkl,
        mode="records",
        expect=expect,
        keys=keys,
        entries=entries,
    )


def _rounds(rng: random.Random) -> int:
    r = rng.random()
    return 1 if r < 0.5 else 2 if r < 0.8 else rng.randint(3, 5)


def _damage_storages(
    rng: random.Random, storages: dict[str, bytes]
) -> tuple[dict[str, bytes], str]:
    storages = dict(storages)
    if not storages:
        storages["0"] = rng.randbytes(8)
        return storages, "added"
    key = rng.choice(list(storages))
    what = rng.choice(["drop", "short", "long", "rename", "extra"])
    if what == "drop":
        del storages[key]
    elif what == "short":
        storages[key] = storages[key][: max(len(storages[key]) - rng.randint(1, 8), 0)]
    elif what == "long":
        storages[key] += rng.randbytes(rng.randint(1, 8))
    elif what == "rename":
        storages[rng.choice(["99", "../0", "0/x", key + "0"])] = storages.pop(key)
    else:
        storages[str(len(storages) + 10)] = rng.randbytes(4)
    return storages, what


def _metadata_case(corpus: Corpus, rng: random.Random, index: int) -> Case:
    gen = Gen(rng, {}, "metadata")
    if rng.random() < 0.7 and corpus.metadata:
        name, pkl = rng.choice(corpus.metadata)
        pkl, done = Mutator(rng, gen).mutate(pkl, [p for _, p in corpus.metadata], _rounds(rng))
        source = f"metadata-mutate({name}):{'+'.join(done)}"
    else:
        pkl = gen.program()
        source = "metadata-generate"
    return Case(index, "metadata", source, pkl, pkl)


# --- running one case ---------------------------------------------------------------------

VERDICTS = ("both-refused", "both-accepted-equal", "stricter", "failure")


@dataclass
class Options:
    seed: int
    target: str
    entry: str
    ours: bool = True
    theirs: bool = True


def _attempt(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except RecursionError as exc:
        return False, exc
    except Exception as exc:
        return False, exc
    except BaseException as exc:  # a pickle must not be able to raise these
        if isinstance(exc, KeyboardInterrupt):
            raise
        return False, exc


_FILE_URL = re.compile(r"(s3://|file://)?/\S*?/case\.pt")


def _err(exc: BaseException) -> str:
    text = str(exc).replace(URL + "/.metadata", "<url>").replace(URL, "<url>")
    text = _FILE_URL.sub("<url>", text)
    return f"{type(exc).__name__}: {text[:300]}"


def _reason(exc: BaseException) -> str:
    """A refusal's message, shortened and with numbers blanked (to group them)."""
    text = str(exc).replace(URL + "/.metadata", "").replace(URL, "")
    text = _FILE_URL.sub("", text).lstrip(": ")
    text = re.sub(r"0x[0-9a-f]+|\d+", "N", text.split("\n")[0])
    return f"{type(exc).__name__}: {text[:90]}"


def _memory_limit() -> None:
    """At most 3 GiB more address space than now: an oracle that allocates what a file
    asks fails instead of taking the machine."""
    with contextlib.suppress(Exception), open("/proc/self/status") as f:
        size = int(re.search(r"VmSize:\s+(\d+)", f.read()).group(1)) * 1024  # type: ignore[union-attr]
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30), hard))


def run_case(case: Case, opts: Options, modules: set[str]) -> dict[str, Any]:
    """Load one case both ways and judge it; a dict with ``verdict`` and details."""
    out: dict[str, Any] = {"index": case.index, "source": case.source, "target": case.target}
    if case.mode == "records":
        return _run_records(case, opts, modules, out)
    measure = case.mode == "attack"  # peak memory, both sides
    peak_ours = peak_theirs = None
    torch._utils._sparse_tensors_to_validate.clear()
    ok_ours, ours = True, None
    if opts.ours:
        before = side_state()
        base = peak_reset() if measure else None
        if case.target == "archive":
            ok_ours, ours = _attempt(lambda: load_ours(case.data, opts.entry))
        else:
            ok_ours, ours = _attempt(lambda: decode_ours(case.data))
        peak_ours = peak_since(base)
        effects = side_effects(before, modules)
        if effects:
            return _fail(out, "side-effect", "; ".join(effects))
    if not opts.theirs:
        return _ours_only(out, {"": (ok_ours, ours, None)})
    torch._utils._sparse_tensors_to_validate.clear()
    base = peak_reset() if measure else None
    if case.target == "archive":
        ok_theirs, theirs = _attempt(lambda: load_torch(case.data))
    else:
        ok_theirs, theirs = _attempt(lambda: decode_oracle(case.data))
    peak_theirs = peak_since(base)
    torch._utils._sparse_tensors_to_validate.clear()
    if not opts.ours:
        out["verdict"] = "theirs-only"
        return out
    if case.target == "archive":
        again = functools.partial(load_ours, case.data, opts.entry)
    else:
        again = functools.partial(decode_ours, case.data)
    peak_ours = _confirmed_peak(peak_ours, peak_theirs, len(case.data), again)
    return judge(out, case, ok_ours, ours, ok_theirs, theirs, (peak_ours, peak_theirs))


def _ours_only(out: dict[str, Any], results: dict[str, tuple[bool, Any, Any]]) -> dict[str, Any]:
    """The verdict of a run of cloudckpt's side alone (to tell which side broke)."""
    out["verdict"] = "ours-only"
    said = []
    for entry, (ok, result, _) in results.items():
        name = f"{entry}: " if entry else ""
        if ok:
            footprint(result)  # touches every storage of the result: a bad one crashes here
            said.append(f"{name}accepted")
        elif isinstance(result, errors.CloudCkptError):
            said.append(f"{name}refused ({_err(result)})")
        else:
            said.append(f"{name}wrong error ({_err(result)})")
    out["ours"] = "accepted" if any(ok for ok, _, _ in results.values()) else "; ".join(said)
    return out


def _run_records(
    case: Case, opts: Options, modules: set[str], out: dict[str, Any]
) -> dict[str, Any]:
    """A "records" case: cloudckpt.load by each of the case's entries (reader threads
    running), each judged against torch's load, each with its peak memory."""
    entries = [e for e in case.entries if _S3 or not e.startswith("s3")]
    out["entries"] = entries
    path = _case_file(case.data) if opts.ours else ""
    s3key = _s3_put(case) if opts.ours and any(e.startswith("s3") for e in entries) else None
    try:
        return _judge_records(case, opts, modules, out, entries, path, s3key)
    finally:
        if s3key is not None:
            _s3_delete(s3key)


def _judge_records(
    case: Case,
    opts: Options,
    modules: set[str],
    out: dict[str, Any],
    entries: list[str],
    path: str,
    s3key: str | None,
) -> dict[str, Any]:
    results: dict[str, tuple[bool, Any, int | None]] = {}
    torch._utils._sparse_tensors_to_validate.clear()
    for entry in entries if opts.ours else []:
        before = side_state()
        base = peak_reset()
        ok, result = _attempt(lambda entry=entry: _load_entry(case, entry, path, s3key))
        peak = peak_since(base)
        effects = side_effects(before, modules)
        if effects:
            return _fail(out, "side-effect", f"{entry}: {'; '.join(effects)}")
        results[entry] = (ok, result, peak)
    if not opts.theirs:
        return _ours_only(out, results)
    torch._utils._sparse_tensors_to_validate.clear()
    base = peak_reset()
    ok_theirs, theirs = _attempt(lambda: load_torch(case.data))
    peak_theirs = peak_since(base)
    torch._utils._sparse_tensors_to_validate.clear()
    if not opts.ours:
        out["verdict"] = "theirs-only"
        return out
    verdicts = []
    for entry, (ok, result, peak) in results.items():
        peak = _confirmed_peak(
            peak,
            peak_theirs,
            len(case.data),
            lambda entry=entry: _load_entry(case, entry, path, s3key),
        )
        expected_ok, expected = ok_theirs, theirs
        if entry.endswith("keys") and ok_theirs:
            if isinstance(theirs, dict) and all(k in theirs for k in case.keys):
                expected = {k: theirs[k] for k in case.keys}
            else:
                expected_ok, expected = False, KeyError(f"torch's result has no keys {case.keys}")
        verdict = judge(
            dict(out, entry=entry), case, ok, result, expected_ok, expected, (peak, peak_theirs)
        )
        if verdict["verdict"] == "failure":
            verdict["detail"] = f"{entry}: {verdict['detail']}"
            return verdict
        if "reason" in verdict:
            verdict["reason"] = f"{entry}: {verdict['reason']}"
        verdicts.append(verdict)
    rank = ["stricter", "lenient-zip", "both-accepted-equal", "both-refused"]
    return min(verdicts, key=lambda v: rank.index(v["verdict"]))


def _confirmed_peak(
    peak: int | None, peak_theirs: int | None, size: int, again: Callable[[], Any]
) -> int | None:
    """``peak``; or, where it is over what :func:`judge` allows, the least of it and of
    two more runs of ``again`` (cloudckpt's load, its result dropped): a process's peak
    also counts what its other threads did meanwhile (a load's reads cancelled and still
    finishing, the I/O pool growing), which a second run rarely meets again; what a
    load itself allocates, it allocates each time."""
    if peak is None or peak_theirs is None:
        return peak
    for _ in range(2):
        if peak <= peak_theirs + size + PEAK_SLACK:
            break
        base = peak_reset()
        _attempt(again)
        found = peak_since(base)
        if found is not None:
            peak = min(peak, found)
    return peak


def _case_file(data: bytes) -> str:
    """``data`` written to this process's temporary file; its path."""
    if not _tmpdir:
        _tmpdir.append(tempfile.mkdtemp(prefix="cloudckpt-fuzz-", dir=(_TMP_ROOT or [None])[0]))
    path = os.path.join(_tmpdir[0], "case.pt")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _load_entry(case: Case, entry: str, path: str, s3key: str | None) -> Any:
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
    if entry.endswith("keys"):
        kwargs["keys"] = list(case.keys)
    if entry.startswith("s3"):
        url = f"s3://{_S3['bucket']}/{s3key}"
        return cloudckpt.load(url, storage_options=_S3["options"], **kwargs)
    return cloudckpt.load(path, **kwargs)


# --- the run's S3 server ------------------------------------------------------------------

#: The run's moto server, where one is up: ``bucket`` and ``options`` (storage options).
#: Set before the batches are forked, so each inherits it; each makes its own client.
_S3: dict[str, Any] = {}
_S3_STORE: list[tuple[int, Any]] = []
_S3_SEEN: list[str] = []  # the run had a server


def start_s3(log: Callable[[str], None]) -> Callable[[], None]:
    """Start a moto server for the run's "records" cases (its S3 entries); return what
    stops it. Where moto is not there, those entries are left out (said in ``log``)."""
    os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
    try:
        from cloudckpt.testing import stop
        from cloudckpt.testing.s3 import launch

        server = launch("moto")
    except Exception as exc:
        log(f"no moto server ({_err(exc)}): records cases load local files only")
        return lambda: None
    try:
        bucket = server.make_bucket("cloudckpt-fuzz")
    except Exception as exc:
        stop(server)
        log(f"no bucket on the moto server ({_err(exc)}): records cases load local files only")
        return lambda: None
    _S3.update(bucket=bucket, options=server.storage_options())
    _S3_SEEN.append(server.endpoint_url)

    def done() -> None:
        _S3.clear()
        stop(server)

    return done


def _s3_store() -> Any:
    if not _S3_STORE or _S3_STORE[0][0] != os.getpid():
        from cloudckpt.store.s3 import S3Store

        _S3_STORE[:] = [(os.getpid(), S3Store(_S3["bucket"], _S3["options"]))]
    return _S3_STORE[0][1]


def _s3_put(case: Case) -> str:
    key = f"{os.getpid()}-{case.index}/case.pt"
    _s3_store().put(key, case.data)
    return key


def _s3_delete(key: str) -> None:
    with contextlib.suppress(Exception):
        _s3_store().delete(key)


# --- memory ---------------------------------------------------------------------------------

#: What cloudckpt may hold at its peak beyond torch's peak and the file's size (its
#: threads, read buffers, the objects of a second unpickle).
PEAK_SLACK = 32 << 20
_LIBC: list[Any] = []


def _status_bytes(name: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{name}:\s+(\d+) kB", f.read(), re.M)
    if found is None:
        raise ValueError(name)
    return int(found.group(1)) * 1024


def peak_reset() -> int | None:
    """Give malloc's free memory back, reset the kernel's high-water mark of this
    process's resident memory to what is resident now (``clear_refs``), and return
    that (bytes); None where that cannot be done."""
    try:
        if _LIBC:
            _LIBC[0].malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except (OSError, ValueError):
        return None


def peak_since(base: int | None) -> int | None:
    """How far resident memory rose above ``base`` (from :func:`peak_reset`)."""
    if base is None:
        return None
    try:
        return max(_status_bytes("VmHWM") - base, 0)
    except (OSError, ValueError):
        return None


def _crc_refusal(exc: Any) -> bool:
    return isinstance(exc, errors.ChecksumError) or (
        isinstance(exc, errors.CloudCkptError) and "CRC" in str(exc)
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def judge(
    out: dict[str, Any],
    case: Case,
    ok_ours: bool,
    ours: Any,
    ok_theirs: bool,
    theirs: Any,
    peaks: tuple[int | None, int | None] = (None, None),
) -> dict[str, Any]:
    if not ok_ours and not isinstance(ours, errors.CloudCkptError):
        detail = _err(ours)
        if not ok_theirs:
            detail += f" (the oracle: {_err(theirs)})"
        return _fail(out, "wrong-error", detail)
    if not ok_ours and case.undamaged is None and _crc_refusal(ours):
        # every record's CRC-32 is right: the bytes checked are not the bytes read
        return _fail(out, "false-checksum", _err(ours))
    if ok_ours and case.expect:
        return _fail(out, "size-constructor", f"cloudckpt ran {case.expect}")
    peak_ours, peak_theirs = peaks
    if peak_ours is not None and peak_theirs is not None:
        allowed = peak_theirs + len(case.data) + PEAK_SLACK
        if peak_ours > allowed:
            return _fail(
                out,
                "peak-memory",
                f"cloudckpt's peak {_mib(peak_ours)} over torch's {_mib(peak_theirs)} "
                f"+ the file's {_mib(len(case.data))} ("
                + ("accepted" if ok_ours else f"refused: {_err(ours)[:120]}")
                + ")",
            )
    oracle = "torch" if case.target == "archive" else "restricted pickle"
    if not ok_theirs:
        if ok_ours and case.undamaged is not None:
            # torch's zip reader refuses a field cloudckpt does not read (a flag, a name's
            # encoding): allowed if what cloudckpt loaded is exactly what torch loads from
            # the undamaged archive.
            ok_clean, clean = _attempt(lambda: load_torch(case.undamaged or b""))
            if ok_clean and diff(ours, clean) is None:
                out["verdict"] = "lenient-zip"
                out["reason"] = _reason(theirs)
                return out
        if ok_ours:
            return _fail(out, "looser", f"{oracle} refused ({_err(theirs)}), cloudckpt accepted")
        out["verdict"] = "both-refused"
        return out
    if not ok_ours:
        out["verdict"] = "stricter"
        out["reason"] = _reason(ours)
        return out
    if case.target == "metadata":
        from torch.distributed.checkpoint.metadata import Metadata

        if not isinstance(ours, Metadata):
            return _fail(out, "wrong-result", f"decode_metadata returned {type(ours).__name__}")
    size = footprint(ours)
    # in proportion to the file, or no more than torch's result and the file
    if size > 16 * len(case.data) + (1 << 20) and size > footprint(theirs) + len(case.data):
        return _fail(
            out, "allocation", f"{size} bytes of storage from a {len(case.data)}-byte file"
        )
    found = _attempt(lambda: diff(ours, theirs))
    if not found[0]:
        return _fail(out, "harness", f"comparing: {_err(found[1])}")
    if found[1] is not None and case.undamaged is not None:
        # torch's zip reader, given a damaged directory, can return what the records do
        # not hold (memory it never filled): what counts is that cloudckpt read the
        # archive's true content, that of the undamaged archive.
        ok_clean, clean = _attempt(lambda: load_torch(case.undamaged or b""))
        if ok_clean and diff(ours, clean) is None:
            out["verdict"] = "lenient-zip"
            out["reason"] = f"torch read the damaged zip differently ({found[1][:60]})"
            return out
    if found[1] is not None:
        return _fail(out, "result-differs", found[1])
    out["verdict"] = "both-accepted-equal"
    return out


def _fail(out: dict[str, Any], kind: str, detail: str) -> dict[str, Any]:
    out.update(verdict="failure", kind=kind, detail=detail)
    return out


# --- processes --------------------------------------------------------------------------

_CORPUS: list[Corpus] = []


def _malloc_perturb() -> None:
    """glibc fills every allocation not made by calloc with one byte value (``mallopt``
    ``M_PERTURB``), so what both sides leave uninitialized compares equal; and serves
    every allocation over 256 KiB by a mapping of its own (a fixed ``M_MMAP_THRESHOLD``),
    given back when freed: resident memory then says what a load holds (and a write
    into a freed storage faults instead of landing in the heap)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(Exception):
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-6, 0x5A)  # M_PERTURB
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD
        _LIBC[:] = [libc]


def _setup_process() -> None:
    _malloc_perturb()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)  # uninitialized memory is filled: comparable
    warnings.simplefilter("ignore")
    sys.setrecursionlimit(10_000)


def _child(conn: Any, job: tuple[str, list[int]], opts: Options) -> None:
    """Runs the cases of ``job`` in this (forked) process; sends the results back."""
    _, indices = job
    if _file_mode(opts):  # its lazy state, before the snapshot
        _, pkl, storages = _CORPUS[0].archives[0]
        with contextlib.suppress(Exception):
            load_ours(craft.torch_archive(pkl, storages), opts.entry)
    if opts.ours and any(case_mode(opts.seed, i, opts.target) == "records" for i in indices):
        _records_warm_up()
    _memory_limit()  # after the warm-ups: their threads' stacks and arenas are made
    objects = canary_objects()
    baseline = snapshot(objects)
    modules = set(sys.modules)
    results = []
    corpus = _CORPUS[0]
    for index in indices:
        case = make_case(corpus, opts.seed, index, opts.target)
        try:
            results.append(run_case(case, opts, modules))
        except Exception as exc:  # the harness's own fault: reported, not hidden
            results.append(
                _fail(
                    {"index": index, "source": case.source, "target": case.target},
                    "harness",
                    traceback.format_exc(limit=3)[-600:] or _err(exc),
                )
            )
    changed = snapshot_diff(baseline, snapshot(objects))
    conn.send({"results": results, "canary": changed})
    conn.close()
    if _tmpdir:
        shutil.rmtree(_tmpdir[0], ignore_errors=True)
    os._exit(0)


def _records_warm_up() -> None:
    """Load a benign archive with a large record by every entry of a records case, so
    that what each path makes once (imports, the I/O threads, the S3 client) is made
    before the snapshot of globals and modules."""
    n = 1 << 17  # 512 KiB of float32: a large record
    tensor = ops.tensor_v2(ops.storage("FloatStorage", "0", "cpu", n), size=(n,))
    small = ops.tensor_v2(ops.storage("FloatStorage", "1", "cpu", 4))
    pkl = craft.assemble(ops.dict_((ops.str_("w0"), tensor), (ops.str_("w1"), small)))
    data = craft.torch_archive(pkl, {"0": bytes(4 * n), "1": bytes(16)})
    case = Case(-1, "archive", "warm-up", data, pkl, mode="records", keys=["w0"])
    case.entries = ["file", "keys", "s3", "s3-keys"]
    with contextlib.suppress(Exception):
        run_case(case, Options(0, "records", "file"), set(sys.modules))
    torch._utils._sparse_tensors_to_validate.clear()


@dataclass
class Job:
    kind: str  # "batch", "single", "ours", "theirs"
    indices: list[int]
    why: str = ""


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    stricter: Counter[str] = field(default_factory=Counter)
    stricter_examples: dict[str, int] = field(default_factory=dict)
    lenient: Counter[str] = field(default_factory=Counter)
    cases: int = 0


def run_jobs(
    opts: Options,
    cases: int,
    jobs: int,
    batch: int,
    case_timeout: float,
    log: Callable[[str], None],
) -> Tally:
    ctx = multiprocessing.get_context("fork")
    tally = Tally()
    pending: list[Job] = [
        Job("batch", list(range(s, min(s + batch, cases)))) for s in range(0, cases, batch)
    ]
    pending.reverse()
    running: dict[Any, tuple[Any, Job, float]] = {}
    attribution: dict[int, dict[str, Any]] = {}  # single cases being attributed

    def start(job: Job) -> None:
        job_opts = Options(
            opts.seed, opts.target, opts.entry, job.kind != "theirs", job.kind != "ours"
        )
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(w, (job.kind, job.indices), job_opts), daemon=True)
        p.start()
        w.close()
        running[r] = (p, job, time.monotonic())

    def limit(job: Job) -> float:
        if job.kind != "batch":
            return case_timeout
        return 30.0 + sum(_COST[case_mode(opts.seed, i, opts.target)] for i in job.indices)

    broke: list[tuple[list[int], str]] = []  # batches that broke: named in the end if
    # no case in them is (a race may not show when its cases run again)

    def broken(job: Job, why: str) -> None:
        if job.kind == "batch":
            broke.append((job.indices, why))
        if job.kind == "batch" and len(job.indices) > 10:  # tenths first, then one by one
            log(f"batch {job.indices[0]}-{job.indices[-1]}: {why}; running it again in parts")
            step = -(-len(job.indices) // 10)
            parts = [job.indices[i : i + step] for i in range(0, len(job.indices), step)]
            pending.extend(Job("batch", part, why) for part in reversed(parts))
            return
        if job.kind == "batch":
            log(f"cases {job.indices[0]}-{job.indices[-1]}: {why}; running them one by one")
            pending.extend(Job("single", [i], why) for i in reversed(job.indices))
            return
        index = job.indices[0]
        if job.kind == "single":
            attribution[index] = {"why": why}
            pending.append(Job("ours", [index], why))
            pending.append(Job("theirs", [index], why))
            return
        attribution.setdefault(index, {"why": why})[job.kind] = why
        _attribute(index)

    def _attribute(index: int) -> None:
        info = attribution[index]
        if "ours" not in info or "theirs" not in info:
            return
        ours_bad, theirs_bad = info["ours"], info["theirs"]
        case = make_case(_CORPUS[0], opts.seed, index, opts.target)
        record = {
            "index": index,
            "source": case.source,
            "target": case.target,
            "verdict": "failure",
        }
        if ours_bad:
            record.update(kind=_kind(ours_bad), detail=f"cloudckpt: {ours_bad}")
        elif theirs_bad:
            verdict = info.get("ours_result", "")
            if verdict == "accepted":
                record.update(kind="looser", detail=f"the oracle {theirs_bad}; cloudckpt accepted")
            else:
                tally.counts["both-refused"] += 1
                tally.counts["oracle-broke"] += 1
                tally.cases += 1
                log(f"case {index}: the oracle {theirs_bad}; cloudckpt refused it ({verdict})")
                return
        else:
            record.update(kind=_kind(info["why"]), detail=f"{info['why']} (not reproduced alone)")
        record["hex"] = case.pkl.hex()
        tally.failures.append(record)
        tally.counts["failure"] += 1
        tally.cases += 1

    def finished(job: Job, msg: dict[str, Any]) -> None:
        if msg["canary"]:
            broken(job, f"changed globals {msg['canary'][:6]}")
            return
        if job.kind in ("ours", "theirs"):
            index = job.indices[0]
            info = attribution.setdefault(index, {})
            info[job.kind] = ""
            if job.kind == "ours" and msg["results"]:
                info["ours_result"] = msg["results"][0].get("ours", "")
            _attribute(index)
            return
        for result in msg["results"]:
            tally.cases += 1
            verdict = result["verdict"]
            tally.counts[verdict] += 1
            if verdict == "lenient-zip":
                tally.lenient[result["reason"]] += 1
            elif verdict == "stricter":
                tally.stricter[result["reason"]] += 1
                tally.stricter_examples.setdefault(result["reason"], result["index"])
            elif verdict == "failure":
                case = make_case(_CORPUS[0], opts.seed, result["index"], opts.target)
                result["hex"] = case.pkl.hex()
                tally.failures.append(result)

    while pending or running:
        while pending and len(running) < jobs:
            start(pending.pop())
        ready = connection.wait(list(running), timeout=0.5)
        for conn in ready:
            p, job, _ = running.pop(conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            conn.close()
            p.join(5)
            if msg is None:
                code = p.exitcode
                why = (
                    f"died by signal {-code}" if code is not None and code < 0 else f"exited {code}"
                )
                broken(job, why)
            else:
                finished(job, msg)
        now = time.monotonic()
        for conn, (p, job, t0) in list(running.items()):
            if now - t0 > limit(job):
                p.kill()
                p.join(5)
                running.pop(conn)
                conn.close()
                broken(job, f"hung (over {limit(job):.0f} s)")
    _unexplained(broke, tally, opts)
    return tally


def _unexplained(broke: list[tuple[list[int], str]], tally: Tally, opts: Options) -> None:
    """A failure for each batch that died, hung or changed a global while none of its
    cases did so again alone (the smallest such batches): a race, or damage one case
    leaves for a later one. Its replay names the batch's first case."""
    named: list[set[int]] = [{r["index"] for r in tally.failures}]
    for indices, why in sorted(broke, key=lambda b: len(b[0])):
        covered = set(indices)
        if any(covered & seen for seen in named):
            continue
        named.append(covered)
        first, last = indices[0], indices[-1]
        case = make_case(_CORPUS[0], opts.seed, first, opts.target)
        tally.failures.append(
            {
                "index": first,
                "source": case.source,
                "target": case.target,
                "verdict": "failure",
                "kind": _kind(why),
                "detail": f"cases {first}-{last} together: {why}; not again when run apart "
                f"(a race, or one case's damage showing in a later one)",
                "hex": case.pkl.hex(),
            }
        )
        tally.counts["failure"] += 1


def _kind(why: str) -> str:
    if why.startswith("died"):
        return "crash"
    if why.startswith("hung"):
        return "hang"
    if why.startswith("changed globals"):
        return "global-changed"
    return "died"


def _file_mode(opts: Options) -> bool:
    """cloudckpt's side goes through cloudckpt.load of a file (which starts an I/O
    thread: never in the process the batches are forked from)."""
    return opts.entry == "file" or not HAS_BOUNDARY


def warm_up(corpus: Corpus, opts: Options) -> None:
    """Load every seed both ways once (and a few cases), so the lazy state of both
    loaders is made before any snapshot is compared."""
    modules = set(sys.modules)
    file_mode = _file_mode(opts)
    for name, pkl, storages in corpus.archives:
        case = Case(-1, "archive", name, craft.torch_archive(pkl, storages), pkl)
        run_case(case, Options(opts.seed, "archive", opts.entry, not file_mode), modules)
    for name, pkl in corpus.metadata:
        run_case(Case(-1, "metadata", name, pkl, pkl), opts, modules)
    for i in range(40):
        if case_mode(opts.seed + 10**6, i, opts.target) == "records":
            continue  # cloudckpt.load starts threads: never in the parent of the batches
        case = make_case(corpus, opts.seed + 10**6, i, opts.target)
        ours = case.target == "metadata" or not file_mode
        with contextlib.suppress(Exception):
            run_case(case, Options(opts.seed, opts.target, opts.entry, ours), modules)
    torch._utils._sparse_tensors_to_validate.clear()


# --- main -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--target",
        choices=TARGETS,
        default="all",
        help="all: the classic cases (archives and DCP metadata) with attack and records "
        "cases mixed in; attack: Attack's programs over small records; records: archives "
        "of 1-8 MiB records through cloudckpt.load of a file, with keys=, and of S3",
    )
    p.add_argument(
        "--no-s3", action="store_true", help="records cases: no moto server, no s3 entries"
    )
    p.add_argument(
        "--entry",
        choices=["bytes", "file"],
        default="bytes",
        help="cloudckpt's side: load_torch_bytes (bytes; cloudckpt.load of a file where "
        "it is absent) or cloudckpt.load of a temporary file",
    )
    p.add_argument("--batch", type=int, help="cases per process (100; 20 for --target records)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a case may take")
    p.add_argument("--case", type=int, help="run this one case here and print it")
    p.add_argument("--report", help="write the results as JSON here")
    p.add_argument("--show", type=int, default=10, help="failures printed in full")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_process()
    t0 = time.monotonic()
    corpus = build_corpus()
    _CORPUS[:] = [corpus]
    opts = Options(args.seed, args.target, args.entry)
    log = functools.partial(print, flush=True)
    stop_s3: Callable[[], None] = lambda: None  # noqa: E731
    if args.target in ("all", "records") and not args.no_s3:
        wanted = [args.case] if args.case is not None else range(args.cases)
        if any(case_mode(args.seed, i, args.target) == "records" for i in wanted):
            stop_s3 = start_s3(log)
    try:
        if args.case is not None:
            return _replay(corpus, opts, args.case)
        warm_up(corpus, opts)
        ready = time.monotonic()
        _TMP_ROOT[:] = [tempfile.mkdtemp(prefix="cloudckpt-fuzz-run-")]
        batch = args.batch or (20 if args.target == "records" else 100)
        try:
            tally = run_jobs(opts, args.cases, max(1, args.jobs), max(1, batch), args.timeout, log)
        finally:
            shutil.rmtree(_TMP_ROOT[0], ignore_errors=True)
    finally:
        stop_s3()
    elapsed = time.monotonic() - ready
    tally.failures.sort(key=lambda r: r["index"])
    for record in tally.failures[: args.show]:
        print(_describe(record, args.seed, args.target, args.entry))
    if len(tally.failures) > args.show:
        print(f"... {len(tally.failures) - args.show} more failures (--report for all)")
    kinds = Counter(f"{r['kind']}" for r in tally.failures)
    if tally.stricter:
        print("stricter than the oracle (allowed), most common reasons:")
        for reason, n in tally.stricter.most_common(8):
            print(f"  {n:6d}  {reason}  (e.g. case {tally.stricter_examples[reason]})")
    if tally.lenient:
        print(
            f"damaged zips torch's reader refuses and cloudckpt reads right "
            f"(allowed): {sum(tally.lenient.values())}: {dict(tally.lenient.most_common(3))}"
        )
    c = tally.counts
    entry = args.entry if HAS_BOUNDARY else "file"
    rate = tally.cases / max(elapsed, 1e-9)
    modes = Counter(case_mode(args.seed, i, args.target) for i in range(args.cases))
    s3 = "" if not modes["records"] else " s3=no" if args.no_s3 or not _S3_SEEN else " s3=moto"
    summary = (
        f"fuzz seed={args.seed} target={args.target} entry={entry}{s3}: "
        f"cases={tally.cases} ({', '.join(f'{k}={n}' for k, n in sorted(modes.items()))}) "
        f"both-refused={c['both-refused']} "
        f"both-accepted-equal={c['both-accepted-equal']} stricter={c['stricter']} "
        f"failures={c['failure']}"
        + (f" ({', '.join(f'{k}={n}' for k, n in kinds.most_common())})" if kinds else "")
        + f" in {elapsed:.1f} s ({rate:.0f} cases/s; setup {ready - t0:.1f} s)"
    )
    print(summary, flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(
                {
                    "seed": args.seed,
                    "target": args.target,
                    "entry": args.entry,
                    "has_boundary": HAS_BOUNDARY,
                    "cases": tally.cases,
                    "modes": dict(modes),
                    "s3": bool(_S3_SEEN),
                    "counts": dict(c),
                    "failures": tally.failures,
                    "failure_kinds": dict(kinds),
                    "stricter": dict(tally.stricter),
                    "lenient_zip": dict(tally.lenient),
                    "seconds": elapsed,
                    "setup_seconds": ready - t0,
                },
                f,
                indent=1,
            )
    if tally.cases != args.cases:
        print(f"error: {args.cases - tally.cases} cases not accounted for", flush=True)
        return 2
    return 1 if c["failure"] else 0


def _describe(record: dict[str, Any], seed: int, target: str, entry: str) -> str:
    hexed = record.get("hex", "")
    shown = hexed if len(hexed) <= 1200 else hexed[:1200] + f"... ({len(hexed) // 2} bytes)"
    return (
        f"FAILURE {record['kind']} case {record['index']} (seed {seed}, target {target}, "
        f"{record['source']}): {record['detail']}\n"
        f"  replay: python -X faulthandler tests/security/fuzz.py --seed {seed} "
        f"--target {target} --entry {entry} --case {record['index']}\n  pickle hex: {shown}"
    )


def _replay(corpus: Corpus, opts: Options, index: int) -> int:
    warm_up(corpus, Options(opts.seed, opts.target, "bytes"))  # as the batches' parent
    if _file_mode(opts):  # as a batch's process does (format/torch/unpickle's lazy state)
        _, pkl, storages = corpus.archives[0]
        load_ours(craft.torch_archive(pkl, storages), opts.entry)
    case = make_case(corpus, opts.seed, index, opts.target)
    if case.mode == "records":  # as a batch's process does
        _records_warm_up()
    print(f"case {index} ({case.mode} {case.target}, {case.source}), {len(case.data)} bytes")
    if case.mode != "classic":
        print(f"keys {case.keys}, entries {case.entries}, expect {case.expect}")
    print(f"pickle hex: {case.pkl.hex()}")
    with contextlib.suppress(Exception):
        pickletools.dis(case.pkl, out=sys.stdout)
    objects = canary_objects()
    before = snapshot(objects)
    result = run_case(case, opts, set(sys.modules))
    changed = snapshot_diff(before, snapshot(objects))
    if changed:
        result = _fail(result, "global-changed", str(changed[:10]))
    print(json.dumps(result, indent=1, default=str))
    return 1 if result.get("verdict") == "failure" else 0


if __name__ == "__main__":
    sys.exit(main())
