"""A store wrapper that injects faults into chosen requests (unit tests only).

Real servers cover protocol behaviour; this wrapper exists to put a specific fault at
a specific moment (the third part upload, every head, ...), which a server cannot.
It sits at the store's seam: the public methods are the real ones (key checks,
retries by the store's policy, error mapping), and every backend primitive is counted
under its public name, may raise the fault chosen for that call, then runs on the real
store's primitive. So an injected ``TransientError`` is retried exactly as a real one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cloudckpt.store import Store

#: Public name -> the backend primitive that serves it (every one of them).
PRIMITIVES = {
    "head": "_head",
    "get": "_get",
    "get_range": "_get_range",
    "read_into": "_read_into",
    "put": "_put",
    "delete": "_delete",
    "list": "_list_page",
    "create_multipart": "_create_multipart",
    "upload_part": "_upload_part",
    "upload_part_views": "_upload_part_views",
    "complete_multipart": "_complete_multipart",
    "abort_multipart": "_abort_multipart",
    "list_multipart": "_list_multipart",
}


class FaultyStore(Store):
    """Delegates to ``inner``; ``faults[name]`` decides per request whether to raise.

    ``calls[name]`` counts requests (attempts) by public name. Copies made by
    ``with_retry`` share the inner store, the counts and the faults.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.root_url = inner.root_url
        self.retry = inner.retry
        self.calls: dict[str, int] = {}
        self.faults: dict[str, Callable[[int], BaseException | None]] = {}
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def _map_error(self, exc: Exception, key: str | None, op: str) -> Exception:
        return self.inner._map_error(exc, key, op)

    def _hit(self, name: str) -> None:
        with self._lock:
            n = self.calls[name] = self.calls.get(name, 0) + 1
        rule = self.faults.get(name)
        exc = rule(n) if rule else None
        if exc is not None:
            raise exc

    def _primitive(name: str) -> Any:
        primitive = PRIMITIVES[name]

        def call(self: FaultyStore, *args: Any) -> Any:
            self._hit(name)
            return getattr(self.inner, primitive)(*args)

        call.__name__ = primitive
        return call

    _head = _primitive("head")
    _get = _primitive("get")
    _get_range = _primitive("get_range")
    _read_into = _primitive("read_into")
    _put = _primitive("put")
    _delete = _primitive("delete")
    _list_page = _primitive("list")
    _create_multipart = _primitive("create_multipart")
    _upload_part = _primitive("upload_part")
    _upload_part_views = _primitive("upload_part_views")
    _complete_multipart = _primitive("complete_multipart")
    _abort_multipart = _primitive("abort_multipart")
    _list_multipart = _primitive("list_multipart")
    del _primitive

    def opener(self) -> Callable[..., Any]:
        """A stand-in for ``cloudckpt.store.open_target`` that serves this store, retrying
        by each call's options (for ``monkeypatch.setattr(module, "open_target", ...)``)."""
        from cloudckpt.options import resolve_options
        from cloudckpt.store import RetryPolicy, Target

        def open_target(url: Any, options: Any = None, **overrides: Any) -> Target:
            opts = resolve_options(options, url=str(url), **overrides)
            store = self.with_retry(RetryPolicy.from_options(opts))
            return Target(str(url), store, str(url), opts)

        return open_target
