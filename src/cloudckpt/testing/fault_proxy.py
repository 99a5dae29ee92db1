"""An HTTP proxy on 127.0.0.1 that sits in front of a real S3 server and breaks things.

    with FaultProxy(upstream="http://127.0.0.1:9000", rate=0.1, seed=1) as proxy:
        cloudckpt.save(state, url, storage_options={..., "endpoint_url": proxy.url})

Faults are chosen per request, by rate (seeded) or by request number (``schedule``),
among the requests ``match(method, target)`` accepts (all by default):

| kind            | what the client sees                                              | upstream |
|-----------------|-------------------------------------------------------------------|----------|
| ``slowdown``    | 503 with an S3 ``SlowDown`` error body                            | untouched |
| ``internal``    | 500 with an S3 ``InternalError`` error body                       | untouched |
| ``reset``       | the connection closes before any response                         | untouched |
| ``reset_after`` | the request is applied upstream, then the connection closes       | applied |
| ``truncate``    | headers with the full Content-Length, half the body, then a close | applied |
| ``short``       | a Content-Length smaller than the body it stands for, then close  | applied |
| ``slow``        | no answer for ``slow_seconds`` (past the client's timeout)        | untouched |

With ``prefix_rate`` it also enforces a request rate per key prefix, as S3 does per
partitioned prefix: a token bucket of ``prefix_burst`` tokens (default: one second's
worth) refilled at ``prefix_rate`` per second for each prefix; a request finding its
bucket empty gets a 503 ``SlowDown`` and is not forwarded. The prefix of a request is
``prefix_of(target)``, by default the first folder of the key in a path-style target
(``/bucket/run/step-1/x`` -> ``run``; bucket-level requests and top-level keys: ``""``).
``throttled[prefix]`` counts the 503s the limit sent, ``forwarded[prefix]`` the requests
sent upstream (faults injected by kind are counted in ``injected``), ``body_bytes[method]``
the bytes of the answers' bodies upstream sent (what clients fetched). ``stall_ends``
holds the ``time.monotonic()`` at which each ``slow`` stall ended (its time up, or the
proxy stopped): a client that gave up while ``stall_ends`` was still empty did so before
any stalled request was answered, however busy the machine.

Request loops are bounded: the proxy serves at most ``max_requests`` requests and stops
with the context manager.

``port`` chooses the port to listen on (default: any free one): a client made for a
port where nothing listens yet sees its connections refused until a proxy starts there
(a bucket away, then back).
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

KINDS = ("slowdown", "internal", "reset", "reset_after", "truncate", "short", "slow")
_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the test fault proxy</Message></Error>"
)


class FaultProxy:
    """Forward HTTP/1.1 requests to ``upstream``, injecting faults on the way back."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        kinds: tuple[str, ...] = KINDS,
        schedule: dict[int, str] | None = None,
        seed: int = 0,
        slow_seconds: float = 3.0,
        max_requests: int = 100_000,
        match: Callable[[str, str], bool] | None = None,
        prefix_rate: float | None = None,
        prefix_burst: float | None = None,
        prefix_of: Callable[[str], str] | None = None,
        port: int = 0,
    ) -> None:
        unknown = set(kinds) - set(KINDS) | set((schedule or {}).values()) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate = rate
        self.kinds = kinds
        self.schedule = dict(schedule or {})
        self.slow_seconds = slow_seconds
        self.max_requests = max_requests
        self.match = match
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.requests = 0
        self.injected: Counter[str] = Counter()
        self.enabled = True
        self.prefix_rate = prefix_rate
        self.prefix_burst = prefix_burst
        self.prefix_of = prefix_of or first_folder
        self.throttled: Counter[str] = Counter()
        self.forwarded: Counter[str] = Counter()
        #: Bytes of the answers' bodies from upstream, by request method.
        self.body_bytes: Counter[str] = Counter()
        #: ``time.monotonic()`` when each ``slow`` stall ended, in order.
        self.stall_ends: list[float] = []
        self._buckets: dict[str, tuple[float, float]] = {}  # prefix -> (tokens, stamp)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._port = port
        self._stop = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- fault choice ------------------------------------------------------------------
    def _choose(self, method: str, target: str) -> str | None:
        with self._lock:
            self.requests += 1
            n = self.requests
            if n > self.max_requests:
                raise RuntimeError("fault proxy request budget exhausted")
            if not self.enabled or (self.match is not None and not self.match(method, target)):
                return None
            kind = self.schedule.get(n)
            if kind is None and self.rate and self._rng.random() < self.rate:
                kind = self._rng.choice(self.kinds)
            if kind is not None:
                self.injected[kind] += 1
            return kind

    def _admit(self, target: str) -> bool:
        """Take a token from the request's prefix bucket; False: answer SlowDown."""
        if self.prefix_rate is None or not self.enabled:
            return True
        prefix = self.prefix_of(target)
        burst = self.prefix_burst if self.prefix_burst is not None else self.prefix_rate
        with self._lock:
            now = time.monotonic()
            tokens, stamp = self._buckets.get(prefix, (burst, now))
            tokens = min(burst, tokens + (now - stamp) * self.prefix_rate)
            admitted = tokens >= 1
            self._buckets[prefix] = (tokens - 1 if admitted else tokens, now)
            if not admitted:
                self.throttled[prefix] += 1
            return admitted

    # -- one client connection -----------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        try:
            while not self._stop.is_set():
                request = _read_request(reader, sock)
                if request is None:
                    return
                method, target, headers, body = request
                kind = self._choose(method, target)
                if kind is None and not self._admit(target):
                    kind = "limited"
                if kind in ("slowdown", "internal", "limited"):
                    status, code = (
                        (500, "InternalError") if kind == "internal" else (503, "SlowDown")
                    )
                    payload = _ERROR_BODY.format(code=code).encode()
                    if method == "HEAD":  # an answer to HEAD has no body
                        payload = b""
                    _send(sock, status, [("Content-Type", "application/xml")], payload)
                    continue
                if kind == "reset":
                    _reset(sock)
                    return
                if kind == "slow":
                    self._stop.wait(self.slow_seconds)
                    with self._lock:
                        self.stall_ends.append(time.monotonic())
                    _reset(sock)
                    return
                status, resp_headers, resp_body = self._forward(method, target, headers, body)
                if kind == "reset_after":
                    _reset(sock)
                    return
                if kind in ("truncate", "short") and len(resp_body) >= 2:
                    half = len(resp_body) // 2
                    if kind == "short":  # claim fewer bytes than the answer really has
                        _send(sock, status, resp_headers, resp_body[:half])
                    else:
                        _send(sock, status, resp_headers, resp_body[:half], length=len(resp_body))
                    _reset(sock)
                    return
                _send(sock, status, resp_headers, resp_body)
        except (ConnectionError, OSError):
            return
        finally:
            reader.close()

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        with self._lock:
            self.forwarded[self.prefix_of(target)] += 1
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in ("expect", "connection"):
                    conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            with self._lock:
                self.body_bytes[method] += len(data)
            drop: tuple[str, ...] = ("connection", "transfer-encoding")
            if method != "HEAD":  # a HEAD answer's Content-Length describes the object
                drop += ("content-length",)
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in drop]
            return resp.status, out, data
        finally:
            conn.close()


def first_folder(target: str) -> str:
    """The first folder of the key in a path-style request target (``""`` if none)."""
    parts = unquote(urlsplit(target).path).split("/")  # ["", bucket, folder..., name]
    return parts[2] if len(parts) > 3 else ""


def _read_request(reader, sock: socket.socket):
    line = reader.readline(65537)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    for _ in range(200):
        h = reader.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        k, v = h.decode("latin-1").split(":", 1)
        headers.append((k.strip(), v.strip()))
    lookup = {k.lower(): v for k, v in headers}
    if lookup.get("expect", "").lower() == "100-continue":
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    length = int(lookup.get("content-length", "0") or 0)
    body = reader.read(length) if length else b""
    return method, target, headers, body


def _send(
    sock: socket.socket, status: int, headers, body: bytes, length: int | None = None
) -> None:
    reason = http.client.responses.get(status, "Unknown")
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if not any(k.lower() == "content-length" for k, _ in headers):
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


def _reset(sock: socket.socket) -> None:
    """Close abruptly (RST rather than FIN), as a dropped connection looks to a client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


__all__ = ["KINDS", "FaultProxy", "first_folder"]
