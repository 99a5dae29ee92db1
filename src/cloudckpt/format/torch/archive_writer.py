"""A ``torch.save`` archive, built without ``torch.save``: the same bytes.

``torch.save`` of a state with thousands of small tensors spends most of its time per
object, not per byte: its ``persistent_id`` (Python) runs for every object the pickler
meets, about twenty per tensor, its tensor reduction builds a ``TypedStorage`` per
tensor, and its zip writer makes several small writes per record. :func:`plan_archive`
pickles the object once with the C pickler, reducing plain CPU tensors itself (to the
very tuple torch's ``__reduce_ex__`` returns) and naming storages as torch's
``persistent_id`` names them; :meth:`ArchivePlan.pieces` then lays the records out as
torch's writer does (:class:`.ziprecords.Layout`), small records copied into shared
chunks and large storages passed as views of their own memory.

:func:`tensor_layout` is the same builder for one plain tensor, the form a DCP writer
calls per item (:mod:`cloudckpt.format.dcp.tensor_archive`): the archive but for the
storage's bytes, pickled and laid out once per dtype, shape and strides
(:class:`.ziprecords.SingleStorage`), its CRC-32 fields filled in per tensor.

The bytes are ``torch.save``'s, record for record (``data.pkl``, the small records, one
``data/N`` per storage in the order the pickle first names them, ``version``, the
serialization id, the directory), so ``torch.load`` and every reader of torch archives
reads them as before. One check (``torch_archive``, _runtime/probes.py) compares both
forms with ``torch.save`` on a probe set at first use; where they differ, both stay off
for the process, as they are with the fast paths off, and ``torch.save`` writes.

``None`` from :func:`plan_archive` or :func:`tensor_layout` means ``torch.save`` must
write the object: a storage that is not in CPU memory (``torch.save`` copies it off the
device first), a fake or meta storage, non-default serialization options, or an archive
of 4 GiB or more (torch writes zip64 fields into its records there).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import io
import logging
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..._runtime import probes
from ..._runtime.memview import buffer_address, copy_memory, copy_on, views_on, writable_view
from ...io.buffers import BufferPool, unshared
from ..checksum import crc32
from .tensors import plain_strided
from .ziprecords import (
    AFTER,
    BEFORE,
    DESCRIPTOR,
    PREFIX,
    ZIP64_FROM,
    Constants,
    Layout,
    SingleStorage,
    defaults,
    read_constants,
    storage_types,
    torch_save,
    v3_dtypes,
)

__all__ = [
    "CHUNK_BYTES",
    "PROBE",
    "ArchivePlan",
    "ChunkPool",
    "builder_on",
    "get_chunk_pool",
    "plan_archive",
    "tensor_layout",
    "writer_on",
]

log = logging.getLogger("cloudckpt")

#: Small records (headers, descriptors, storages under ``borrow_min``) are copied into
#: chunks of this size, each handed on whole.
CHUNK_BYTES = 4 << 20
#: The check that both forms of the builder write ``torch.save``'s bytes.
PROBE = "torch_archive"
_DESCRIPTOR_SIZE = DESCRIPTOR.size
#: Per-record bytes besides the data: local header with padding, descriptor, entry.
_RECORD_OVERHEAD = 30 + 4 + 63 + 16 + 46 + 2 * len(PREFIX + "data/") + 2 * 20
_Tensor = torch.Tensor
_rebuild_v2 = torch._utils._rebuild_tensor_v2
_rebuild_v3 = torch._utils._rebuild_tensor_v3
#: Types ``persistent_id`` answers None for at once (none is, or derives from, a storage).
_NOT_STORAGES = frozenset(
    {int, float, bool, str, bytes, tuple, list, dict, type(None), torch.Tensor, torch.dtype}
    | {collections.OrderedDict, torch.Size, torch.nn.Parameter}
)


class _Unsupported(Exception):
    """The object holds something only ``torch.save`` writes (see the module)."""


class _Ref:
    """A plain tensor's storage as the pickle names it: ``persistent_id`` turns it into
    torch's ``("storage", type, key, "cpu", numel)``."""

    __slots__ = ("key", "numel", "type")

    def __init__(self, storage_type: Any, key: str, numel: int) -> None:
        self.type = storage_type
        self.key = key
        self.numel = numel


class _Hooks:
    """A tensor's (empty) backward hooks: pickled as torch pickles a new ``OrderedDict()``
    (a fresh object each time, as torch's are), without its Python-level reduction."""

    __slots__ = ()


#: What an empty ``OrderedDict`` reduces to, less the empty item iterators (which add
#: nothing to the pickle).
_EMPTY_ORDERED_DICT = (collections.OrderedDict, ())


class _ArchivePickler(pickle.Pickler):
    """The C pickler at ``torch.save``'s protocol, with torch's storage naming."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.keys: dict[int, str] = {}  # storage._cdata -> its record's key
        self.storages: list[torch.UntypedStorage] = []
        self.dtypes: dict[int, torch.dtype] = {}  # data_ptr -> the dtype it is saved as
        self.v3 = v3_dtypes()
        self.types = {dtype: getattr(torch, name) for dtype, name in storage_types().items()}
        self.storage_classes = torch._storage_classes

    def reducer_override(self, obj: Any) -> Any:
        # The common case, a plain dense CPU tensor, reduced here to what torch's
        # Tensor.__reduce_ex__ returns; anything else goes through torch's reduction.
        cls = type(obj)
        if cls is _Hooks:
            return _EMPTY_ORDERED_DICT
        if not (cls is _Tensor and obj.is_cpu and plain_strided(obj)):
            return NotImplemented
        dtype = obj.dtype
        storage = obj.untyped_storage()
        nbytes = storage.nbytes()
        hooks = _Hooks()
        # Fresh tuples, as torch makes them: pickle's memo must see the same objects.
        if dtype in self.v3:
            ref = self._ref(storage, torch.UntypedStorage, torch.uint8, nbytes)
            args: tuple[Any, ...] = (
                ref,
                obj.storage_offset(),
                tuple(obj.size()),
                obj.stride(),
                obj.requires_grad,
                hooks,
                dtype,
            )
            return _rebuild_v3, args
        storage_type = self.types.get(dtype)
        if storage_type is None or nbytes % dtype.itemsize:
            return NotImplemented
        ref = self._ref(storage, storage_type, dtype, nbytes // dtype.itemsize)
        args = (ref, obj.storage_offset(), tuple(obj.size()), obj.stride(), obj.requires_grad)
        return _rebuild_v2, (*args, hooks)

    def persistent_id(self, obj: Any) -> Any:
        # Called for every object the pickle meets: the common ones leave first.
        cls = type(obj)
        if cls is _Ref:
            return ("storage", obj.type, obj.key, "cpu", obj.numel)
        if cls in _NOT_STORAGES:
            return None
        if isinstance(obj, torch.storage.TypedStorage) or cls in self.storage_classes:
            return self._storage_id(obj)
        return None

    def _storage_id(self, obj: Any) -> tuple[Any, ...]:
        """torch's ``persistent_id`` for a storage its own reduction produced."""
        if getattr(obj, "_fake_device", None) is not None:
            raise _Unsupported("a fake tensor's storage")
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        else:
            storage = obj
            dtype = torch.uint8
            storage_type = torch.serialization.normalize_storage_type(type(obj))
            numel = storage.nbytes()
        if storage.device.type != "cpu":
            raise _Unsupported(f"a storage on {storage.device}")
        ref = self._ref(storage, storage_type, dtype, numel)
        return ("storage", ref.type, ref.key, torch.serialization.location_tag(storage), numel)

    def _ref(self, storage: Any, storage_type: Any, dtype: torch.dtype, numel: int) -> _Ref:
        ptr = storage.data_ptr()
        if ptr:
            seen = self.dtypes.setdefault(ptr, dtype)
            if seen != dtype:
                raise RuntimeError(
                    "Cannot save multiple tensors or storages that view the same data as "
                    "different types"
                )
        key = self.keys.get(storage._cdata)
        if key is None:
            key = self.keys[storage._cdata] = str(len(self.keys))
            self.storages.append(storage)
        return _Ref(storage_type, key, numel)


@dataclass
class ArchivePlan:
    """An object's archive, pickled and ready to lay out: ``data.pkl`` and the storages
    it names (CPU memory, in key order)."""

    pickled: bytes
    storages: list[torch.UntypedStorage]
    constants: Constants

    @functools.cached_property
    def size_hint(self) -> int:
        """An upper bound on the archive's size (exact up to the headers' padding)."""
        data = sum(s.nbytes() for s in self.storages) + len(self.pickled)
        return data + _RECORD_OVERHEAD * (len(self.storages) + len(BEFORE) + len(AFTER)) + 128

    def pieces(self, borrow_min: int) -> Iterator[tuple[memoryview, object]]:
        """The archive's bytes in order, as ``(view, owner)``: storages of at least
        ``borrow_min`` bytes as views of their own memory (owner: the storage), the rest
        copied into chunks of about ``CHUNK_BYTES`` (owner: the chunk), ``data.pkl`` as
        its own bytes. A view's memory must stay unchanged until it has been sent."""
        out = _Chunks()
        layout = Layout(self.constants)
        for header, data, tail in layout.opening(self.pickled):
            if len(data) >= borrow_min:
                yield from out.add(header)
                yield from out.send(memoryview(data), data)
                yield from out.add(tail)
            else:
                yield from out.add(header + data + tail)
        for key, storage in enumerate(self.storages):
            nbytes = storage.nbytes()
            header = layout.storage(key, nbytes)
            if nbytes >= borrow_min:
                view = writable_view(storage.data_ptr(), nbytes)
                crc = crc32(view)
                yield from out.add(header)
                yield from out.send(view, storage)
                yield from out.add(layout.stored(crc))
            else:  # header, bytes and descriptor copied into the chunk (the hot path)
                need = len(header) + nbytes + _DESCRIPTOR_SIZE
                if out.fill + need > len(out.chunk):
                    yield from out.flush()
                    out.new_chunk(need)
                at = out.fill
                chunk = out.chunk
                chunk[at : at + len(header)] = header
                at += len(header)
                crc = 0
                if nbytes:
                    copy_memory(out.address + at, storage.data_ptr(), nbytes)
                    crc = crc32(out.view[at : at + nbytes])  # while the bytes are in cache
                    at += nbytes
                tail = layout.stored(crc)
                chunk[at : at + len(tail)] = tail
                out.fill = at + len(tail)
        yield from out.add(layout.closing(len(self.storages)))
        yield from out.flush()


class _Chunks:
    """Copies small pieces into chunks and yields what was copied whenever a piece goes
    out on its own (a large storage) or the chunk fills. A chunk is filled on after
    such a flush (the yielded view covers only the bytes before), so the chunks a save
    uses follow the bytes copied, not the number of large storages."""

    def __init__(self) -> None:
        self.chunk = bytearray(0)
        self.view = memoryview(self.chunk)
        self.address = 0
        self.start = 0  # where the bytes not yet yielded begin
        self.fill = 0

    def new_chunk(self, nbytes: int) -> None:
        """Start a chunk with room for at least ``nbytes`` (after :meth:`flush`)."""
        self.chunk = _pool.take() if nbytes <= CHUNK_BYTES else bytearray(nbytes)
        self.view = memoryview(self.chunk)
        self.address = buffer_address(self.chunk)
        self.start = self.fill = 0

    def add(self, data: bytes) -> Iterator[tuple[memoryview, object]]:
        if self.fill + len(data) > len(self.chunk):
            yield from self.flush()
            self.new_chunk(len(data))
        self.chunk[self.fill : self.fill + len(data)] = data
        self.fill += len(data)

    def send(self, view: memoryview, owner: object) -> Iterator[tuple[memoryview, object]]:
        """Yield what was copied so far, then ``view`` as it lies (not copied)."""
        yield from self.flush()
        yield view, owner

    def flush(self) -> Iterator[tuple[memoryview, object]]:
        if self.fill > self.start:
            yield self.view[self.start : self.fill], self.chunk
            self.start = self.fill


class ChunkPool(BufferPool[int, bytearray]):
    """The chunks small records are copied into, reused within a save and across saves.

    A fresh chunk costs a page fault per 4 KiB on first touch (zero-filled by the
    kernel): for a state of small tensors that is as much CPU as the copy. A chunk is
    handed out again once nothing refers to it but the pool (:func:`unshared`): the sink
    drops its views and owners when the part they went into is stored or abandoned, so a
    chunk whose bytes may still be read is never written. The pool holds as many chunks
    as were ever waiting to be sent at once; :func:`cloudckpt.release_buffers` empties
    it. The pool is io/buffers.py's ``BufferPool`` with a ``reusable`` predicate.
    """

    def __init__(self) -> None:
        super().__init__(bytearray, int, reusable=unshared)

    def take(self, key: int | None = None) -> bytearray:
        """A chunk of ``CHUNK_BYTES`` (or ``key`` bytes) that no one else refers to."""
        return super().take(CHUNK_BYTES if key is None else key)

    @property
    def held_bytes(self) -> int:
        """Bytes of every chunk the pool holds, in use or not."""
        return self.idle_bytes


_pool = ChunkPool()


def get_chunk_pool() -> ChunkPool:
    """The process's chunk pool."""
    return _pool


def plan_archive(obj: Any) -> ArchivePlan | None:
    """Pickle ``obj`` as ``torch.save`` would; None where ``torch.save`` must write it.

    Raises what pickling raises (an unpicklable object, storages viewed as two dtypes),
    before anything is written.
    """
    found = _constants() if writer_on() else None
    if found is None:
        return None
    plan = _plan(obj, found)
    if plan is not None and plan.size_hint >= ZIP64_FROM:
        return None
    return plan


def _plan(obj: Any, found: Constants) -> ArchivePlan | None:
    buffer = io.BytesIO()
    pickler = _ArchivePickler(buffer)
    try:
        try:
            pickler.dump(obj)
        finally:
            # The memo holds every tuple the pickle made: freed now, they are not
            # walked by the collection that resuming the collector sets off.
            pickler.clear_memo()
    except _Unsupported as exc:
        log.debug("cloudckpt: torch.save writes this object (%s)", exc)
        return None
    return ArchivePlan(buffer.getvalue(), pickler.storages, found)


#: One-tensor layouts made so far, by (dtype, shape, strides, storage offset, storage
#: bytes): a model's tensors share a few. Bounded: cleared when it grows past this.
_SINGLE: dict[tuple[Any, ...], SingleStorage] = {}
_MAX_SINGLE = 1024


def tensor_layout(tensor: torch.Tensor, nbytes: int) -> SingleStorage | None:
    """``torch.save(tensor)``'s archive laid out but for the storage's ``nbytes`` bytes
    (the whole of ``tensor.untyped_storage()``, as ``torch.save`` writes it); None
    where ``torch.save`` must write it: a tensor that is not a plain one of CPU memory
    (a subclass, one that requires grad, quantized, sparse, conjugate...), an archive
    of 4 GiB or more, or the builder off.

    Called per tensor, so torch's serialization options are read only until the check
    has run (they cost more than the rest of the call): the caller asks
    :func:`builder_on` once for a batch of tensors.
    """
    found = _single_constants()
    if found is None or nbytes >= ZIP64_FROM:
        return None
    if not (type(tensor) is _Tensor and tensor.is_cpu and not tensor.requires_grad):
        return None
    return _single(tensor, nbytes, found) if plain_strided(tensor) else None


def _single(tensor: torch.Tensor, nbytes: int, found: Constants) -> SingleStorage | None:
    key = (tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset(), nbytes)
    layout = _SINGLE.get(key)
    if layout is None:
        plan = _plan(tensor, found)
        if plan is None or len(plan.storages) != 1:
            return None
        layout = SingleStorage.lay_out(plan.pickled, nbytes, found)
        if len(_SINGLE) >= _MAX_SINGLE:
            _SINGLE.clear()
        _SINGLE[key] = layout
    return layout


# --- the check, and when the builder is on ----------------------------------------------

#: The running torch's constants, once the check has passed.
_found: list[Constants] = []
#: The dtypes of the probe set, where the running torch has them.
_PROBE_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _probe_dtypes() -> list[torch.dtype]:
    found = (getattr(torch, name, None) for name in _PROBE_DTYPES)
    return [dtype for dtype in found if isinstance(dtype, torch.dtype)]


def _of_dtype(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` elements of ``dtype``, from bytes 0 and 1 (valid in every dtype)."""
    raw = torch.arange(numel * dtype.itemsize, dtype=torch.uint8) % 2
    return raw.view(dtype)


def _probe_object() -> dict[str, Any]:
    """An object whose archive takes every path of the whole-object builder."""
    base = torch.arange(12, dtype=torch.float32)
    grad = torch.ones(3, requires_grad=True)
    obj: dict[str, Any] = {str(dtype): _of_dtype(dtype, 3) for dtype in _probe_dtypes()}
    obj.update(
        w=base.view(3, 4),
        view=base[4:8],  # shares base's storage, at an offset
        t=torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),
        f8=torch.ones((), dtype=torch.float8_e4m3fn),  # a _rebuild_tensor_v3 dtype
        empty=torch.empty(0, dtype=torch.int64),
        param=torch.nn.Parameter(torch.zeros(2)),  # torch's own reduction
        grad=grad,
        conj=torch.ones(2, dtype=torch.complex64).conj(),  # torch's, with metadata
        storage=torch.ones(4, dtype=torch.uint8).untyped_storage(),
        big=torch.arange(20000, dtype=torch.int16),  # borrowed in the probe's layout
        meta=[1, 2.5, "x", None, (3, 4)],
    )
    return obj


def _probe_tensors() -> list[torch.Tensor]:
    """Tensors whose one-tensor archives take every path of :func:`tensor_layout`."""
    base = torch.arange(12, dtype=torch.float64)
    return [
        *(_of_dtype(dtype, 5) for dtype in _probe_dtypes()),
        torch.ones((), dtype=torch.float8_e4m3fn),  # a _rebuild_tensor_v3 scalar
        torch.empty(0, dtype=torch.int64),
        torch.empty(3, 0, dtype=torch.float8_e5m2),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),
        base[2:6],  # a view at an offset: the whole storage is written
    ]


def _object_bytes(obj: Any, found: Constants) -> bytes | None:
    """The whole-object builder's archive of ``obj`` in one piece."""
    plan = _plan(obj, found)
    if plan is None:
        return None
    return b"".join(bytes(view) for view, _ in plan.pieces(borrow_min=16 << 10))


def _tensor_bytes(tensor: torch.Tensor, found: Constants) -> bytes | None:
    """The one-tensor builder's archive of ``tensor`` in one piece."""
    storage = tensor.untyped_storage()
    data = ctypes.string_at(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else b""
    layout = _single(tensor, len(data), found)
    if layout is None:
        return None
    return layout.header + data + layout.trailer(crc32(data))


def _check() -> None:
    """Both forms of the builder write ``torch.save``'s bytes for the probe set: the
    whole object (where the memory tricks it uses are on) and each probe tensor."""
    found = read_constants()
    if views_on() and copy_on():  # else the whole-object form is off anyway
        obj = _probe_object()
        if _object_bytes(obj, found) != torch_save(obj):
            raise ValueError("the archive of the probe object differs from torch.save's")
    for tensor in _probe_tensors():
        if _tensor_bytes(tensor, found) != torch_save(tensor):
            raise ValueError(f"the archive of a {tensor.dtype} tensor differs from torch.save's")
    _found[:] = [found]


probes.register(PROBE, _check)


def _constants() -> Constants | None:
    """The running torch's constants once the check has passed; None (builder off)
    otherwise, or with the fast paths off."""
    return _found[0] if probes.on(PROBE) and _found else None


def _single_constants() -> Constants | None:
    """:func:`_constants` for the per-tensor form: the check runs the first time torch's
    serialization options are the defaults (it reads them only until then)."""
    if probes.outcome(PROBE) is None and not defaults():
        return None
    return _constants()


def builder_on() -> bool:
    """Whether the builder writes what ``torch.save`` would write now: torch's
    serialization options are the defaults it copies, and it matched this torch's
    ``torch.save`` on the probe set (checked once per process; off with the fast paths
    off)."""
    return defaults() and probes.on(PROBE)


def writer_on() -> bool:
    """Whether :func:`plan_archive` may build: :func:`builder_on`, and the memory tricks
    its pieces use (views of storages, GIL-held copies) are on."""
    return builder_on() and views_on() and copy_on()
