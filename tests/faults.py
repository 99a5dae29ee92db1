"""A store wrapper that injects faults into chosen calls (unit tests only).

Real servers cover protocol behaviour; this wrapper exists to put a specific fault at
a specific moment (the third part upload, every head, ...), which a server cannot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cloudckpt.store import Store


class FaultyStore(Store):
    """Delegates to ``inner``; ``faults[method]`` decides per call whether to raise."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.root_url = inner.root_url
        self.calls: dict[str, int] = {}
        self.faults: dict[str, Callable[[int], BaseException | None]] = {}
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def _hit(self, name: str) -> None:
        with self._lock:
            n = self.calls[name] = self.calls.get(name, 0) + 1
        rule = self.faults.get(name)
        exc = rule(n) if rule else None
        if exc is not None:
            raise exc

    def __getattribute__(self, name: str) -> Any:
        if name in {
            "head",
            "get_range",
            "read_into",
            "put",
            "delete",
            "list",
            "create_multipart",
            "upload_part",
            "complete_multipart",
            "abort_multipart",
            "list_multipart",
        }:
            inner_method = getattr(object.__getattribute__(self, "inner"), name)

            def call(*args: Any, **kwargs: Any) -> Any:
                object.__getattribute__(self, "_hit")(name)
                return inner_method(*args, **kwargs)

            return call
        return object.__getattribute__(self, name)

    # Abstract methods are served by __getattribute__; these satisfy the ABC.
    head = get_range = read_into = put = delete = list = None  # type: ignore[assignment]
    create_multipart = upload_part = complete_multipart = None  # type: ignore[assignment]
    abort_multipart = list_multipart = None  # type: ignore[assignment]
