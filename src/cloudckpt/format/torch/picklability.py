"""Finding *where* a state stops being picklable, so the error can name the key path.

``torch.save`` only says "Can't pickle local object ...". On failure we walk the state
the way pickle does (dict items, list items, object attributes, ``__reduce_ex__``
arguments) and report the deepest piece that still fails, as a path such as
``state['model']['decoder.mlp.weight'].build_fn``. Tensor storages are replaced by a
token while probing, so probing never copies tensor data.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PICKLE_ERRORS", "find_unpicklable", "raise_if_unpicklable"]

#: What pickling raises for an object it cannot handle (torch.save lets them through).
PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)

_MAX_DEPTH = 64


class _Probe(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            return "storage"
        return None


def _fails(obj: Any) -> BaseException | None:
    try:
        _Probe(io.BytesIO(), protocol=2).dump(obj)
    except RecursionError:
        return None
    except Exception as exc:
        return exc
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
        if type(obj) is not dict and getattr(obj, "__dict__", None):
            yield from ((f".{k}", v) for k, v in vars(obj).items())
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
        return
    if isinstance(obj, (set, frozenset)):
        for v in obj:
            yield f"{{{v!r}}}", v
        return
    if isinstance(obj, torch.Tensor):
        # Tensor attributes set by users travel with the tensor (torch pickles __dict__).
        yield from ((f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items())
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        yield from ((f".{k}", v) for k, v in state.items())
        return
    try:
        reduced = obj.__reduce_ex__(2)
    except Exception:
        return
    if isinstance(reduced, tuple):
        if len(reduced) > 1 and reduced[0] is not getattr(copyreg, "__newobj__", None):
            for i, arg in enumerate(reduced[1] or ()):
                yield f".<arg {i}>", arg
        if len(reduced) > 2 and isinstance(reduced[2], dict):
            yield from ((f".{k}", v) for k, v in reduced[2].items())


def _locate(
    obj: Any, path: str, depth: int, seen: set[int]
) -> tuple[str, Any, BaseException] | None:
    error = _fails(obj)
    if error is None:
        return None
    if depth < _MAX_DEPTH and id(obj) not in seen:
        seen.add(id(obj))
        for suffix, child in _children(obj):
            found = _locate(child, path + suffix, depth + 1, seen)
            if found is not None:
                return found
    return path, obj, error


def find_unpicklable(obj: Any, root: str = "state") -> tuple[str, Any, BaseException] | None:
    """``(key path, offending object, pickle's error)`` or None if ``obj`` pickles."""
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(max(limit, 10_000))
        return _locate(obj, root, 0, set())
    finally:
        sys.setrecursionlimit(limit)


def raise_if_unpicklable(obj: Any, exc: BaseException, url: str) -> None:
    """Turn ``exc``, raised while pickling ``obj`` for ``url``, into an UnpicklableError
    naming the key path that cannot be pickled and how to save it instead; return
    quietly when ``exc`` is not such a failure (the caller re-raises it)."""
    from ...errors import SerializationError, UnpicklableError

    if not isinstance(exc, PICKLE_ERRORS) or isinstance(exc, SerializationError):
        return
    found = find_unpicklable(obj)
    if found is None:
        return
    path, bad, error = found
    raise UnpicklableError(
        f"cannot save {url}: {path} ({type(bad).__name__}) cannot be pickled: {error}. "
        "A checkpoint can hold tensors, containers, numbers, strings and importable "
        "classes, but not local functions, lambdas, open files or locks. Resolve "
        "factories into tensors before saving, or save sharded state dicts with "
        "cloudckpt.megatron.save (Megatron's, docs/megatron.md) or with "
        "torch.distributed.checkpoint and cloudckpt.dcp.CloudStorageWriter (docs/dcp.md).",
        path=path,
    ) from exc
