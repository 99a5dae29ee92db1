"""A server on 127.0.0.1 that accepts connections and never answers: the endpoint that
tests of bounded time (deadlines, metadata timeouts) meet. Its fixture, ``silent``, is in
conftest.py. :func:`run_bounded` runs an operation against it for at most a given time."""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

#: The deadline the bounded tests give an operation against it, and how long past it
#: one may still run: starting the store's client and the scheduler's cancel grace, on a
#: loaded machine. Without the deadline, the first unanswered request alone would take
#: the 10 s metadata timeout and its retries (tens of seconds).
DEADLINE = 3.0
SLACK = 8.0
BOUND = DEADLINE + SLACK

#: Credentials for a store pointed at it (never checked: nothing answers).
CREDS = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}


class LoopbackServer:
    """A TCP server on 127.0.0.1 for the stores under test: it accepts connections, each
    served by :meth:`_serve` on a thread of its own, until :meth:`close`."""

    def __init__(self) -> None:
        self.requests: list[str] = []  # request lines, in arrival order
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, **CREDS}

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stopped.set()
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                conn.close()


class SilentServer(LoopbackServer):
    """Accepts TCP connections on 127.0.0.1 and reads requests; answers none of them,
    except, with ``answer_uploads``, a CreateMultipartUpload (``POST ...?uploads``: a
    store that starts an upload and then goes silent, so the save's abort meets it) and,
    with ``answer_heads``, a HEAD (an object of that many bytes: the load's next request,
    a range read, meets the silence)."""

    def __init__(self, answer_uploads: bool = False, answer_heads: int | None = None) -> None:
        self.answer_uploads = answer_uploads
        self.answer_heads = answer_heads
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        try:
            while not self._stopped.is_set():
                head, sep, rest = data.partition(b"\r\n\r\n")
                if not sep:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                    continue
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                with self._lock:
                    self.requests.append(line)
                method, target = line.split(" ")[:2]
                if self.answer_heads is not None and method == "HEAD":
                    conn.sendall(
                        b'HTTP/1.1 200 OK\r\nETag: "e"\r\n'
                        + f"Content-Length: {self.answer_heads}\r\n\r\n".encode()
                    )
                elif self.answer_uploads and method == "POST" and target.endswith("?uploads"):
                    key = target.split("?")[0].split("/", 2)[-1]
                    body = (
                        '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
                        f"<Bucket>b</Bucket><Key>{key}</Key><UploadId>up-1</UploadId>"
                        "</InitiateMultipartUploadResult>"
                    ).encode()
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                else:
                    while conn.recv(65536):  # drain the body, never answer
                        pass
                    return
                data = rest
        except OSError:
            return


def run_bounded(fn: Callable[[], Any], bound: float = BOUND) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a daemon thread: what it raised and the seconds it took. Fails the
    test, showing where the thread is, if it is still running ``bound`` seconds after it
    started (a request that outlived its deadline)."""
    box: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            fn()
        except BaseException as exc:
            box["error"] = exc
        box["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
        pytest.fail(f"still running {bound:g} s later, in:\n{stack}")
    return box.get("error"), box["seconds"]
