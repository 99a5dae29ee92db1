"""Module attributes made on first use: a module's ``__getattr__`` and ``__dir__``.

``import cloudckpt`` and its integration modules stay fast and import without torch or
the framework: a name is imported (``cloudckpt.load``) or a class is built on the
framework's base (``cloudckpt.hf.CloudCheckpointCallback``) when first used, then kept
in the module like any other attribute.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["imported", "lazy_attributes"]


def imported(module: str, package: str, name: str) -> Callable[[], Any]:
    """What makes ``name`` of ``module`` (relative to ``package``) when first used."""
    return lambda: getattr(importlib.import_module(module, package), name)


def lazy_attributes(
    namespace: MutableMapping[str, Any],
    makers: Mapping[str, Callable[[], Any]],
    public: Sequence[str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__``: a name of ``makers`` is made by its
    maker when first used and kept in ``namespace`` (the module's ``globals()``); any
    other name is an AttributeError naming the module. ``public``: its ``__all__``."""
    module = namespace["__name__"]

    def getattr_(name: str) -> Any:
        make = makers.get(name)
        if make is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = namespace[name] = make()
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(public))

    return getattr_, dir_
