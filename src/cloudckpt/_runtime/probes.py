"""Fast paths that check themselves against the plain path once, in one registry.

A trick that could go wrong on another torch, Python or kernel registers a check
(:func:`register`): a function that runs the trick and the plain path on a sample and
raises (or returns False) where they differ. :func:`on` runs it the first time the
trick is wanted, keeps the outcome for the process, and answers False for every trick
while the fast paths are switched off (switch.py). A failed check turns its trick off,
logged once at DEBUG with the reason; the plain path then does the work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .switch import fast_paths

__all__ = ["forget", "on", "outcome", "register", "results"]

log = logging.getLogger("cloudckpt")

_checks: dict[str, Callable[[], object]] = {}
#: Outcomes so far, by name (absent or None: not checked yet).
_results: dict[str, bool | None] = {}
# Reentrant: a check may use another trick (the GIL-held copy checks itself with views).
_lock = threading.RLock()


def register(name: str, check: Callable[[], object]) -> None:
    """Make ``check`` the test of the trick ``name``, run at its first use."""
    with _lock:
        _checks[name] = check
        _results.pop(name, None)


def on(name: str) -> bool:
    """Whether the trick ``name`` may be used: the fast paths are on and its check
    passed (run now if it has not run yet)."""
    if not fast_paths():
        return False
    found = _results.get(name)
    if found is None:
        found = _check(name)
    return found


def _check(name: str) -> bool:
    with _lock:
        found = _results.get(name)
        if found is not None:
            return found
        check = _checks[name]  # a name never registered is a bug: KeyError
        try:
            passed = check() is not False
            reason = "its check answered False"
        except Exception as exc:  # any surprise: the plain path does the work
            passed, reason = False, f"{type(exc).__name__}: {exc}"
        if not passed:
            log.debug("cloudckpt: fast path %r is off, its plain path runs (%s)", name, reason)
        _results[name] = passed
        return passed


def outcome(name: str) -> bool | None:
    """``name``'s check's outcome so far (None: not run yet); runs nothing."""
    return _results.get(name)


def results() -> dict[str, bool | None]:
    """Every registered trick and its check's outcome (None: not run yet)."""
    with _lock:
        return {name: _results.get(name) for name in sorted(_checks)}


def forget(name: str | None = None) -> None:
    """Run ``name``'s check again at its next use (every check's with None): after
    changing what a check depends on, such as torch's serialization options."""
    with _lock:
        if name is None:
            _results.clear()
        else:
            _results.pop(name, None)
