"""Progress bars on stderr (rich) for long transfers; a no-op when disabled."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``, safe to call from I/O threads."""
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    lock = threading.Lock()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total or None)

        def advance(n: int) -> None:
            with lock:
                bar.advance(task, n)

        yield advance
        with lock:
            done = bar.tasks[0].completed
            bar.update(task, total=max(done, total or 0), completed=done)
