"""The one switch over every fast path, and the opt-in that lets a GC pause freeze.

``CLOUDCKPT_FAST_PATHS=0`` (or :func:`set_fast_paths` ``(False)``) turns off every trick
in ``_runtime/`` and every torch-internal shortcut: no GC pause, no GIL-held copy, no
view made from a raw address, no ``madvise``, no archive built without ``torch.save``,
no fast rebuild of tensors. The library then takes its plain path, with the same
results (docs/runtime.md lists each trick and its plain path).

``CLOUDCKPT_GC_FREEZE=1`` (or :func:`set_gc_freeze` ``(True)``) lets the pause around a
load or a snapshot move what it built (and every other tracked object of the program)
to the oldest generation when the collector resumes, with ``gc.freeze()`` then
``gc.unfreeze()``. That changes the host program's GC generations, so it is never done
unasked.

Each variable is read once, the first time it is needed; the functions override it.
"""

from __future__ import annotations

import os

from ..errors import ConfigError

__all__ = [
    "FAST_PATHS_ENV",
    "GC_FREEZE_ENV",
    "fast_paths",
    "gc_freeze",
    "set_fast_paths",
    "set_gc_freeze",
]

FAST_PATHS_ENV = "CLOUDCKPT_FAST_PATHS"
GC_FREEZE_ENV = "CLOUDCKPT_GC_FREEZE"

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})

#: The settings in force: None until read from the environment (or set).
_fast: bool | None = None
_freeze: bool | None = None


def _flag(name: str, default: bool) -> bool:
    """A boolean environment variable: ``1/true/yes/on`` or ``0/false/no/off``."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ConfigError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), not {text!r}")


def fast_paths() -> bool:
    """Whether the fast paths are on (the default): :func:`set_fast_paths`'s choice, else
    ``CLOUDCKPT_FAST_PATHS``'s, read once."""
    global _fast
    found = _fast
    if found is None:
        found = _fast = _flag(FAST_PATHS_ENV, True)
    return found


def set_fast_paths(on: bool | None) -> None:
    """Turn every fast path on or off for this process; None: follow
    ``CLOUDCKPT_FAST_PATHS`` again (read anew). A save or load already running keeps
    the paths it chose."""
    global _fast
    _fast = None if on is None else bool(on)


def gc_freeze() -> bool:
    """Whether a GC pause may move what it built to the oldest generation (off unless
    asked for): :func:`set_gc_freeze`'s choice, else ``CLOUDCKPT_GC_FREEZE``'s."""
    global _freeze
    found = _freeze
    if found is None:
        found = _freeze = _flag(GC_FREEZE_ENV, False)
    return found


def set_gc_freeze(on: bool | None) -> None:
    """Opt in (True) or out (False) of the freeze at the end of a GC pause; None: follow
    ``CLOUDCKPT_GC_FREEZE`` again (read anew)."""
    global _freeze
    _freeze = None if on is None else bool(on)
