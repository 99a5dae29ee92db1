"""The ``cloudckpt`` command line: ls, info, cp, verify, rm, latest, gc, bench.

``main(argv)`` returns the exit code (documented in ``cloudckpt --help`` and
docs/cli.md); ``python -m cloudckpt`` and the installed ``cloudckpt`` script call it.
"""

from __future__ import annotations

from .main import EXIT_CODES, main

__all__ = ["EXIT_CODES", "main"]
