"""Snapshots for async save: the object's structure pickled now, tensor bytes copied now.

``snapshot(obj)`` pickles ``obj`` in the caller's thread with a ``persistent_id`` that
copies every tensor storage into a host buffer taken from a reusable pool (pinned
memory, filled on a side CUDA stream, for CUDA tensors). The result is independent of
the live object: training may mutate its tensors, dicts and scalars the moment
``snapshot`` returns. ``Snapshot.materialize()`` rebuilds the object over the staged
buffers (in the background), with views and shared storages exactly as they were.

Staged tensors are CPU tensors, so an async-saved archive records CPU as every
storage's location (``map_location`` is not needed to load it on a CPU-only host).
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Snapshot", "StagingPool", "get_pool", "snapshot"]


class StagingPool:
    """Host buffers reused across saves, keyed by size (and pinning)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                return free.pop()
            self.allocated_bytes += nbytes
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
        return torch.UntypedStorage(nbytes)

    def give_back(self, storages: list[torch.UntypedStorage], pinned: list[bool]) -> None:
        with self._lock:
            for storage, pin in zip(storages, pinned, strict=True):
                self._free[(storage.nbytes(), pin)].append(storage)

    def clear(self) -> None:
        """Drop every idle buffer (memory held for the next save is released)."""
        with self._lock:
            for free in self._free.values():
                self.allocated_bytes -= sum(s.nbytes() for s in free)
            self._free.clear()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for free in self._free.values() for s in free)


_pool = StagingPool()


def get_pool() -> StagingPool:
    """The process's staging pool."""
    return _pool


@dataclass
class Snapshot:
    """A pickled structure plus the staged copies of its storages."""

    structure: bytes
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)
    nbytes: int = 0

    def materialize(self) -> Any:
        """The object rebuilt over the staged buffers (views and sharing preserved)."""
        storages = self.storages

        class _Loader(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                index, dtype = pid
                return torch.storage.TypedStorage(
                    wrap_storage=storages[index], dtype=dtype, _internal=True
                )

        return _Loader(io.BytesIO(self.structure)).load()

    def release(self, pool: StagingPool | None = None) -> None:
        """Return the buffers to the pool once the save no longer needs them."""
        (pool or _pool).give_back(self.storages, self.pinned)
        self.storages, self.pinned = [], []


class _StagingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pool: StagingPool, snap: Snapshot) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.pool = pool
        self.snap = snap
        self.index: dict[int, int] = {}
        self.stream: Any = None

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            dtype, storage = obj.dtype, obj._untyped_storage
        elif isinstance(obj, torch.UntypedStorage):
            dtype, storage = torch.uint8, obj
        else:
            return None
        index = self.index.get(storage._cdata)
        if index is None:
            index = self.index[storage._cdata] = self._stage(storage)
        return (index, dtype)

    def _stage(self, storage: torch.UntypedStorage) -> int:
        device = storage.device.type
        if device == "cpu" or device == "cuda":
            pinned = device == "cuda"
            copy = self.pool.take(storage.nbytes(), pinned)
            if pinned:
                if self.stream is None:
                    self.stream = torch.cuda.Stream()
                    self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    copy.copy_(storage, non_blocking=True)
            else:
                copy.copy_(storage)
        else:  # other devices (mps, xla, ...): a plain synchronous copy to host
            copy, pinned = storage.cpu(), False
        self.snap.storages.append(copy)
        self.snap.pinned.append(pinned and device == "cuda")
        self.snap.nbytes += storage.nbytes()
        return len(self.snap.storages) - 1


def snapshot(obj: Any, pool: StagingPool | None = None) -> Snapshot:
    """Copy ``obj`` so that later changes to it do not reach the checkpoint.

    Raises what pickling raises (the caller turns it into ``UnpicklableError``);
    buffers taken before a failure go back to the pool.
    """
    pool = pool or _pool
    buf = io.BytesIO()
    snap = Snapshot(structure=b"")
    pickler = _StagingPickler(buf, pool, snap)
    try:
        pickler.dump(obj)
        if pickler.stream is not None:
            pickler.stream.synchronize()  # the snapshot is complete only when copies land
    except BaseException:
        snap.release(pool)
        raise
    snap.structure = buf.getvalue()
    return snap
