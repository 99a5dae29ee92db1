"""Pass files' bytes between ranks over a gloo group: a local tier's peer copy.

Each rank sends at most one list of files to one rank and receives at most one list
from one rank, the lists' names and sizes known on both sides beforehand (the caller
shares them with one ``agree``). The bytes go in chunks of :data:`CHUNK` as uint8
tensors: each step posts the send of this rank's next chunk (``isend``), receives the
next incoming chunk, then waits for its send, so a ring of ranks (each sending to the
next) never waits on itself. A rank whose reading or writing fails keeps the exchange
going (zeros out, what comes in dropped) and returns its error: no rank is left waiting
for bytes that will not come, and the caller settles the outcome on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHUNK", "pass_files"]

#: Bytes per message; two buffers of it per rank (one out, one in).
CHUNK = 16 * 1024 * 1024

#: ``read(name, offset, view)`` fills ``view`` with the file's bytes from ``offset``.
Reader = Callable[[str, int, memoryview], None]
#: ``write(name, offset, view, last)``: ``view`` holds the file's bytes from ``offset``;
#: ``last`` on its final chunk (also for an empty file, with an empty view).
Writer = Callable[[str, int, memoryview, bool], None]


def _chunks(files: Sequence[tuple[str, int]]) -> Iterator[tuple[str, int, int, bool]]:
    """(name, offset, length, last) of every chunk of ``files``, in order."""
    for name, size in files:
        offset = 0
        while True:
            n = min(CHUNK, size - offset)
            yield name, offset, n, offset + n >= size
            offset += n
            if offset >= size:
                break


def pass_files(
    group: Any,
    *,
    send_to: int | None,
    outgoing: Sequence[tuple[str, int]],
    read: Reader,
    recv_from: int | None,
    incoming: Sequence[tuple[str, int]],
    write: Writer,
) -> BaseException | None:
    """Send ``outgoing`` (name, size) to global rank ``send_to`` and receive ``incoming``
    from ``recv_from`` (either may be None: nothing that way); this rank's first error,
    or None. Every rank of the pairs must call it with matching lists."""
    out = _chunks(outgoing) if send_to is not None else iter(())
    into = _chunks(incoming) if recv_from is not None else iter(())
    send_buf = torch.empty(CHUNK, dtype=torch.uint8)
    recv_buf = torch.empty(CHUNK, dtype=torch.uint8)
    error: BaseException | None = None
    while True:
        sending, receiving = next(out, None), next(into, None)
        if sending is None and receiving is None:
            return error
        work = None
        if sending is not None:
            name, offset, n, _ = sending
            chunk = send_buf[:n]
            if error is None:
                try:
                    read(name, offset, chunk.numpy().data)
                except Exception as exc:
                    error = exc
            if error is not None:
                chunk.zero_()
            if n:
                work = dist.isend(chunk, send_to, group=group)
        if receiving is not None:
            name, offset, n, last = receiving
            chunk = recv_buf[:n]
            if n:
                dist.recv(chunk, recv_from, group=group)
            if error is None:
                try:
                    write(name, offset, chunk.numpy().data, last)
                except Exception as exc:
                    error = exc
        if work is not None:
            work.wait()
