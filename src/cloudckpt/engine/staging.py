"""Snapshots for async save: the object's structure pickled now, tensor bytes copied now.

``snapshot(obj)`` pickles ``obj`` in the caller's thread and copies every tensor storage
it references into host buffers taken from a reusable pool (pinned memory, filled on a
side CUDA stream, for CUDA tensors). The result is independent of the live object:
training may mutate its tensors, dicts and scalars the moment ``snapshot`` returns.
``Snapshot.materialize()`` rebuilds the object over the staged buffers (in the
background), with views and shared storages exactly as they were.

The caller's thread pays per tensor, so that part is kept short (docs/async.md,
"Many small tensors"):

- a ``reducer_override`` reduces a plain CPU or CUDA tensor to ``(storage index,
  offset, size, stride, requires_grad, dtype)`` itself; anything else (subclasses,
  ``Parameter``, tensors with Python state or hooks, sparse, quantized, nested, other
  devices) goes through torch's own ``__reduce_ex__``, whose storages come back here;
- CPU storages of at most ``SMALL_MAX`` bytes are copied (one ``memmove`` that keeps the
  GIL each, _runtime/memview.py) into shared slabs of ``SLAB_BYTES`` from the pool, not
  into a pool entry each; larger and CUDA storages get a pool buffer each, as before.
  With that copy off (the fast paths off), every storage gets a buffer of its own,
  copied by torch.

``materialize`` gives every staged storage a ``torch.UntypedStorage`` of its own, over its
part of the slab (no copy; the part keeps the slab alive), so ``torch.save`` writes one
record per original storage, as it would for the live object.

Staged tensors are CPU tensors, so an async-saved archive records CPU as every
storage's location (``map_location`` is not needed to load it on a CPU-only host).

``stage_tensors(tensors)`` is the same copy for a list of tensors (Megatron's async
save): each into a pool buffer of its own, CUDA ones pinned and on the side stream,
waited for once. The pool (``StagingPool``) is io/buffers.py's ``BufferPool``, keyed by
``(nbytes, pinned)``.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._runtime.memview import copy_memory, copy_on
from ..format.torch.tensors import plain_strided
from ..io.buffers import BufferPool

__all__ = [
    "SLAB_BYTES",
    "SMALL_MAX",
    "Snapshot",
    "StagedTensors",
    "StagingPool",
    "get_pool",
    "snapshot",
    "stage_tensors",
]

#: Size of one slab: the pool buffer that small CPU storages share.
SLAB_BYTES = 4 << 20
#: CPU storages up to this size are staged into slabs (at most 1/16 of a slab is lost
#: at a slab's end); larger ones get a pool buffer of their own.
SMALL_MAX = 256 << 10
_ALIGN = 64  # each part of a slab starts on a 64-byte boundary, as torch's allocator does

_Tensor = torch.Tensor


def _host_buffer(key: tuple[int, bool]) -> torch.UntypedStorage:
    """A host buffer of ``nbytes``, pinned (for copies from CUDA) when asked."""
    nbytes, pinned = key
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    return torch.UntypedStorage(nbytes)


def _key_bytes(key: tuple[int, bool]) -> int:
    """The size of a staging buffer, from its key."""
    return key[0]


class StagingPool(BufferPool[tuple[int, bool], torch.UntypedStorage]):
    """Host buffers reused across saves, keyed by ``(nbytes, pinned)``, none dropped
    until :func:`cloudckpt.release_buffers` (io/buffers.py's one pool class).

    ``make`` makes a buffer for a key (default: plain host memory, pinned if asked).
    """

    def __init__(
        self, make: Callable[[tuple[int, bool]], torch.UntypedStorage] = _host_buffer
    ) -> None:
        super().__init__(make, _key_bytes)

    def give_back_all(self, storages: list[torch.UntypedStorage], pinned: list[bool]) -> None:
        """Give back each of ``storages`` (``pinned`` says which are pinned)."""
        for storage, pin in zip(storages, pinned, strict=True):
            self.give_back(storage, (storage.nbytes(), pin))


_pool = StagingPool()


def get_pool() -> StagingPool:
    """The process's staging pool."""
    return _pool


class _HostCopies:
    """Copies into buffers from a pool, recorded in ``storages`` and ``pinned``.

    A CUDA source is copied without blocking into pinned memory on one side stream
    (after the work already queued on the current stream); :meth:`wait` waits for
    every such copy at once. A CPU source is copied at once.
    """

    def __init__(
        self, pool: StagingPool, storages: list[torch.UntypedStorage], pinned: list[bool]
    ) -> None:
        self.pool = pool
        self.storages = storages
        self.pinned = pinned
        self.stream: Any = None

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        """A pool buffer of ``nbytes``, recorded to be given back."""
        buffer = self.pool.take((nbytes, pinned))
        self.storages.append(buffer)
        self.pinned.append(pinned)
        return buffer

    def copy(self, dst: Any, src: Any, cuda: bool) -> None:
        """``dst.copy_(src)``: on the side stream, without blocking, for a CUDA ``src``."""
        if not cuda:
            dst.copy_(src)
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def wait(self) -> None:
        """Return once every copy has landed (the CUDA ones are asynchronous)."""
        if self.stream is not None:
            self.stream.synchronize()


@dataclass
class StagedTensors:
    """Host copies of tensors (:func:`stage_tensors`) and the pool buffers they lie in."""

    pool: StagingPool
    copies: list[torch.Tensor] = field(default_factory=list)
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)

    def release(self) -> None:
        """Give the buffers back to the pool once nothing reads the copies any more."""
        self.pool.give_back_all(self.storages, self.pinned)
        self.copies, self.storages, self.pinned = [], [], []


def stage_tensors(
    tensors: Sequence[torch.Tensor], pool: StagingPool | None = None
) -> StagedTensors:
    """CPU copies of ``tensors`` (same dtype and shape, each in a pool buffer of its own).

    CUDA tensors are copied into pinned buffers without blocking, and waited for once
    before this returns: the copies are complete, and the sources free to change. The
    caller gives the buffers back with :meth:`StagedTensors.release`; on a failure they
    go back before the error is raised.
    """
    staged = StagedTensors(pool or _pool)
    copies = _HostCopies(staged.pool, staged.storages, staged.pinned)
    try:
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                staged.copies.append(torch.empty(tensor.shape, dtype=tensor.dtype))
                continue
            cuda = tensor.is_cuda
            buffer = copies.take(nbytes, cuda)
            copy = torch.empty(0, dtype=torch.uint8).set_(buffer).view(tensor.dtype)
            copy = copy.view(tensor.shape)
            copies.copy(copy, tensor.detach(), cuda)
            staged.copies.append(copy)
        copies.wait()
    except BaseException:
        staged.release()
        raise
    return staged


#: A staged tensor: (staged storage, storage offset, size, stride, requires_grad, dtype).
_TensorLayout = tuple[int, Any, Any, tuple[int, ...], bool, torch.dtype]


def _staged_tensor(*args: Any) -> Any:
    """Placeholder named in a snapshot's structure; ``Snapshot.materialize`` resolves it."""
    raise pickle.UnpicklingError("a staging snapshot is read by Snapshot.materialize() only")


def _staged_storage(*args: Any) -> Any:
    """Placeholder named in a snapshot's structure; ``Snapshot.materialize`` resolves it."""
    raise pickle.UnpicklingError("a staging snapshot is read by Snapshot.materialize() only")


@dataclass
class Snapshot:
    """A pickled structure plus the staged copies of its storages.

    ``storages`` are the pool buffers (``pinned`` says which are pinned): one per large or
    CUDA storage, and the slabs the small CPU storages share. ``parts[i]`` says where
    staged storage ``i`` (the index the structure names) lies: ``(buffer, offset,
    nbytes)``, with ``offset == -1`` for a whole buffer of its own and ``buffer == -1``
    for an empty storage. ``tensors[k]`` is the tensor the structure names ``k``: (staged
    storage, storage offset, size, stride, requires_grad, dtype).
    """

    structure: bytes
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)
    parts: list[tuple[int, int, int]] = field(default_factory=list)
    tensors: list[_TensorLayout] = field(default_factory=list)
    nbytes: int = 0

    def staged_storages(self) -> list[torch.UntypedStorage]:
        """One storage per staged storage, each over its own bytes (no copy)."""
        slabs: dict[int, Any] = {}
        out: list[torch.UntypedStorage] = []
        for buffer, offset, nbytes in self.parts:
            if buffer < 0:
                out.append(torch.UntypedStorage(0))
                continue
            storage = self.storages[buffer]
            if offset < 0:
                out.append(storage)
                continue
            view = slabs.get(buffer)
            if view is None:
                # A ctypes array over the slab that holds the slab: every part made from it
                # by frombuffer holds the array, so the slab outlives its parts.
                view = (ctypes.c_uint8 * storage.nbytes()).from_address(storage.data_ptr())
                view.owner = storage  # type: ignore[attr-defined]
                slabs[buffer] = view
            part = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
            out.append(part.untyped_storage())
        return out

    def materialize(self) -> Any:
        """The object rebuilt over the staged buffers (views and sharing preserved)."""
        storages = self.staged_storages()
        new_dtypes = torch.storage._new_dtypes()
        rebuild_v2 = torch._utils._rebuild_tensor_v2
        rebuild_v3 = torch._utils._rebuild_tensor_v3
        typed = torch.storage.TypedStorage

        def storage(index: int, dtype: torch.dtype) -> torch.storage.TypedStorage:
            return typed(wrap_storage=storages[index], dtype=dtype, _internal=True)

        def tensor(k: int) -> torch.Tensor:
            index, offset, size, stride, requires_grad, dtype = self.tensors[k]
            # What torch's own reduction of the live tensor would have rebuilt.
            if dtype in new_dtypes:
                return rebuild_v3(
                    storage(index, torch.uint8),
                    offset,
                    size,
                    stride,
                    requires_grad,
                    OrderedDict(),
                    dtype,
                )
            return rebuild_v2(
                storage(index, dtype), offset, size, stride, requires_grad, OrderedDict()
            )

        placeholders = {"_staged_tensor": tensor, "_staged_storage": storage}
        return _SnapshotLoader(self.structure, placeholders).load()

    def release(self, pool: StagingPool | None = None) -> None:
        """Return the buffers to the pool once the save no longer needs them."""
        (pool or _pool).give_back_all(self.storages, self.pinned)
        self.storages, self.pinned, self.parts, self.tensors = [], [], [], []


class _SnapshotLoader(pickle.Unpickler):
    """Unpickles a snapshot's structure, its placeholders resolved by ``placeholders``.

    A module-level class: one defined inside ``materialize`` would be cyclic garbage
    holding the snapshot (and its buffers) until the collector runs."""

    def __init__(self, data: bytes, placeholders: dict[str, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._placeholders = placeholders

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name in self._placeholders:
            return self._placeholders[name]
        return super().find_class(module, name)


class _StagingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pool: StagingPool, snap: Snapshot) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.copies = _HostCopies(pool, snap.storages, snap.pinned)
        self.snap = snap
        self.index: dict[int, int] = {}
        self.tensors = snap.tensors
        self.slab = -1  # index in snap.storages of the slab being filled
        self.slab_address = 0
        self.slab_used = SLAB_BYTES
        self.slabs = copy_on()  # small CPU storages share slabs (else a buffer each)

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object that is not a builtin container or scalar: the common
        # case (a plain dense CPU or CUDA tensor) comes first and stays short, the copy of
        # a small CPU storage inlined (this runs once per tensor while training waits).
        if type(obj) is _Tensor:
            cpu = obj.is_cpu
            if not ((cpu or obj.is_cuda) and plain_strided(obj)):
                return NotImplemented  # torch's reduction; its storages come back below
            storage = obj.untyped_storage()
            index = self.index.get(storage._cdata)
            if index is None:
                index = self._stage(storage, "cpu" if cpu else "cuda")
            # The tensor's layout is kept aside, not pickled (fewer objects through the
            # pickler); the structure names its position.
            tensors = self.tensors
            tensors.append(
                (
                    index,
                    obj.storage_offset(),
                    obj.size(),
                    obj.stride(),
                    obj.requires_grad,
                    obj.dtype,
                )
            )
            return _staged_tensor, (len(tensors) - 1,)
        if isinstance(obj, torch.storage.TypedStorage):
            dtype, storage = obj.dtype, obj._untyped_storage
        elif isinstance(obj, torch.UntypedStorage):
            dtype, storage = torch.uint8, obj
        else:
            return NotImplemented
        index = self.index.get(storage._cdata)
        if index is None:
            index = self._stage(storage, storage.device.type)
        return _staged_storage, (index, dtype)

    def _stage(self, storage: torch.UntypedStorage, device: str) -> int:
        nbytes = storage.nbytes()
        snap = self.snap
        if device == "cpu" and nbytes <= SMALL_MAX and self.slabs:
            part = self._stage_small(storage, nbytes)
        else:
            if device == "cpu" or device == "cuda":
                cuda = device == "cuda"
                self.copies.copy(self.copies.take(nbytes, cuda), storage, cuda)
            else:  # other devices (mps, xla, ...): a plain synchronous copy to host
                snap.storages.append(storage.cpu())
                snap.pinned.append(False)
            part = (len(snap.storages) - 1, -1, nbytes)
        snap.parts.append(part)
        snap.nbytes += nbytes
        index = self.index[storage._cdata] = len(snap.parts) - 1
        return index

    def _stage_small(self, storage: torch.UntypedStorage, nbytes: int) -> tuple[int, int, int]:
        """Copy a small CPU storage into the current slab (a new one when it is full)."""
        if nbytes == 0:
            return (-1, 0, 0)
        offset = self.slab_used
        if offset + nbytes > SLAB_BYTES:
            offset = self._new_slab()
        copy_memory(self.slab_address + offset, storage.data_ptr(), nbytes)
        self.slab_used = (offset + nbytes + _ALIGN - 1) & -_ALIGN
        return (self.slab, offset, nbytes)

    def _new_slab(self) -> int:
        """Take a slab from the pool and make it the current one; returns offset 0."""
        slab = self.copies.take(SLAB_BYTES, False)
        self.slab, self.slab_address = len(self.snap.storages) - 1, slab.data_ptr()
        self.slab_used = 0
        return 0


def snapshot(obj: Any, pool: StagingPool | None = None) -> Snapshot:
    """Copy ``obj`` so that later changes to it do not reach the checkpoint.

    Raises what pickling raises (the caller turns it into ``UnpicklableError``);
    buffers taken before a failure go back to the pool.
    """
    pool = pool or _pool
    buf = io.BytesIO()
    snap = Snapshot(structure=b"")
    pickler = _StagingPickler(buf, pool, snap)
    # async_save pauses the collector around this (_runtime/gcpause.py): the pickler's
    # few small tuples per tensor would set off collections that walk the whole heap.
    try:
        try:
            pickler.dump(obj)
        finally:
            pickler.clear_memo()  # its tuples freed now, not walked by the next collection
        pickler.copies.wait()  # the snapshot is complete only when the copies land
    except BaseException:
        snap.release(pool)
        raise
    snap.structure = buf.getvalue()
    return snap
