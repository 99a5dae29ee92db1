"""Progress bars on stderr (rich) for long transfers; a no-op when disabled."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["ProgressBar", "progress_bar"]


class ProgressBar:
    """Call it with a byte count to advance; safe from I/O threads. Inert when disabled."""

    def __init__(self, bar: Any = None, task: Any = None) -> None:
        self._bar, self._task = bar, task
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.advance(self._task, n)

    def set_total(self, n: int) -> None:
        """Set (or correct) the total once it is known."""
        if self._bar is not None:
            with self._lock:
                self._bar.update(self._task, total=n)


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[ProgressBar]:
    """A :class:`ProgressBar` for ``total`` bytes (None: unknown yet), drawn on stderr."""
    if not enabled:
        yield ProgressBar()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total or None)
        progress = ProgressBar(bar, task)
        yield progress
        with progress._lock:  # end on a full bar even if the estimate was off
            done = bar.tasks[0].completed
            bar.update(task, total=max(done, total or 0), completed=done)
