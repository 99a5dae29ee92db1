"""Printing for the command line: rich tables for people, JSON for scripts, bars on stderr."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..io.progress import progress_bar

__all__ = ["Printer", "StderrHandler", "human_age", "human_bytes", "human_time", "progress"]


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def human_age(seconds: float) -> str:
    """An age for people: ``"12 s"``, ``"5.0 min"``, ``"2.3 h"``, ``"3.1 d"``; unknown: ``"?"``."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def human_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    dt = datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc)
    return dt.strftime("%Y-%m-%d %H:%M:%S UTC")


class Printer:
    """Writes either human output (rich) or one JSON document to stdout."""

    def __init__(self, json_mode: bool, prefix: str = "cloudckpt") -> None:
        self.json_mode = json_mode
        #: What every error line starts with: ``cloudckpt COMMAND``.
        self.prefix = prefix
        #: What an interrupted command kept, said once as its last line (exit code 130).
        self.stopped: str | None = None
        from rich.console import Console

        # A terminal gets tables as wide as it is (long names folded, never cut); a file
        # or a pipe gets every name whole, however long the line.
        width = None if sys.stdout.isatty() else 1 << 20
        self.out = Console(highlight=False, soft_wrap=True, width=width)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def json(self, body: Any) -> None:
        sys.stdout.write(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
        sys.stdout.flush()

    def line(self, text: str = "") -> None:
        if not self.json_mode:
            self.out.print(text, markup=False)

    def note(self, text: str) -> None:
        """A remark on stderr (also in JSON mode, where stdout stays machine-readable)."""
        self.err.print(text, markup=False)

    def error(self, text: str) -> None:
        """An error line on stderr: ``cloudckpt COMMAND: text``."""
        self.note(f"{self.prefix}: {text}")

    def table(self, columns: list[str], rows: list[list[str]], title: str | None = None) -> None:
        if self.json_mode:
            return
        from rich.table import Table

        table = Table(title=title, title_justify="left", box=None, pad_edge=False)
        for i, c in enumerate(columns):
            right = i == 0 or c in ("size", "bytes")
            table.add_column(c, justify="right" if right else "left", overflow="fold")
        for r in rows:
            table.add_row(*r)
        self.out.print(table)


class StderrHandler(logging.Handler):
    """Log records as lines on whatever ``sys.stderr`` is when they come: while a progress
    bar runs that is the bar's proxy, which prints them above the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def progress(
    description: str, enabled: bool
) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """Yield ``(advance(n), set_total(n))``; a bar on stderr when ``enabled``."""
    with progress_bar(description, None, enabled) as bar:
        yield bar, bar.set_total
