"""Interpreter, OS and torch-internal speed tricks, in one place behind one switch.

``CLOUDCKPT_FAST_PATHS=0`` or :func:`set_fast_paths` ``(False)`` turns every one off
(switch.py); each that checks itself against the plain path registers its check in
probes.py (:func:`fast_path_checks` reports them); ``CLOUDCKPT_GC_FREEZE=1`` or
:func:`set_gc_freeze` ``(True)`` opts in to the freeze at the end of a GC pause
(gcpause.py). docs/runtime.md lists every trick.
"""

from __future__ import annotations

from .probes import results as fast_path_checks
from .switch import fast_paths, gc_freeze, set_fast_paths, set_gc_freeze

__all__ = ["fast_path_checks", "fast_paths", "gc_freeze", "set_fast_paths", "set_gc_freeze"]
