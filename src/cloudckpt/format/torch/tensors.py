"""Walking a state for its tensors: sizes for part planning, storages for partial loads."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["iter_tensors", "plain_strided", "referenced_storages", "scan_storages"]

_MAX_DEPTH = 200
_strided = torch.strided
_tensor_metadata = torch._C._get_tensor_metadata  # type: ignore[attr-defined]


def plain_strided(t: torch.Tensor) -> bool:
    """Whether torch reduces ``t`` (a ``torch.Tensor``, not a subclass) to a plain rebuild
    over its storage: dense, not quantized or nested, no hooks (torch warns about those),
    no Python attributes, no conj/neg bits. Checked per tensor where thousands wait."""
    return (
        t.layout is _strided
        and not t.is_quantized
        and not t.is_nested
        and not t._backward_hooks
        and not t.__dict__
        and not _tensor_metadata(t)
    )


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside plain containers and object attributes (a cheap, best-effort walk)."""
    if _depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from iter_tensors(v, _depth + 1)


def scan_storages(
    obj: Any, min_bytes: int
) -> tuple[int, dict[int, tuple[int, torch.UntypedStorage]]]:
    """One walk over ``obj``'s tensors: the bytes of its distinct storages (the archive's
    payload size), and its CPU storages of at least ``min_bytes`` by address, which
    ``torch.save`` will write from that memory (``address -> (nbytes, storage)``)."""
    seen: set[int] = set()
    total = 0
    found: dict[int, tuple[int, torch.UntypedStorage]] = {}
    for t in iter_tensors(obj):
        if t.device.type == "meta" or t.is_sparse or t.layout != torch.strided:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        ident = storage._cdata
        if ident in seen:
            continue
        seen.add(ident)
        nbytes = storage.nbytes()
        total += nbytes
        if t.device.type == "cpu" and nbytes >= min_bytes and storage.data_ptr():
            found[storage.data_ptr()] = (nbytes, storage)
    return total, found


class _StorageScan(pickle.Pickler):
    """Pickles into nowhere, recording which storages the object references."""

    def __init__(self, wanted: dict[int, str]) -> None:
        super().__init__(io.BytesIO(), protocol=2)
        self.wanted = wanted
        self.found: set[str] = set()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            obj = obj._untyped_storage
        if isinstance(obj, torch.UntypedStorage):
            key = self.wanted.get(obj._cdata)
            if key is not None:
                self.found.add(key)
            return "s"
        return None


def referenced_storages(obj: Any, storages: dict[int, str]) -> set[str]:
    """Which of ``storages`` (``_cdata`` -> record key) ``obj`` references, as pickle sees
    it; all of them where ``obj`` nests too deep for pickle to walk (a load may build
    what pickle cannot write back)."""
    scan = _StorageScan(storages)
    try:
        scan.dump(obj)
    except RecursionError:
        return set(storages.values())
    return scan.found
