"""Throttling, 5xx and dropped connections from a GCS or Azure endpoint are TransientError.

A tiny HTTP server on 127.0.0.1 answers every request with one chosen status (or
closes the connection); the backends must classify it so the store retries it (a
second request), and must not for a 4xx that no retry can fix (one request).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cloudckpt.errors import AccessDeniedError, RetriesExhaustedError, StorageError, TransientError
from cloudckpt.store import RetryPolicy
from cloudckpt.store.azure import AzureStore
from cloudckpt.store.gcs import GCSStore
from servers import AZURITE_ACCOUNT, AZURITE_KEY


class _Answer:
    status = 503
    drop = False


class _Handler(BaseHTTPRequestHandler):
    answer = _Answer()
    requests = 0

    def _reply(self) -> None:
        type(self).requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.answer.drop:
            self.close_connection = True
            self.connection.close()
            return
        body = b'{"error": {"code": %d, "message": "test"}}' % self.answer.status
        self.send_response(self.answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _reply

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _stores(endpoint: str) -> list:
    gcs = GCSStore("b", {"endpoint_url": endpoint, "anonymous": True}, read_timeout=5)
    azure = AzureStore(
        "c",
        {
            "account_url": f"{endpoint}/{AZURITE_ACCOUNT}",
            "account_name": AZURITE_ACCOUNT,
            "account_key": AZURITE_KEY,
        },
        read_timeout=5,
    )
    twice = RetryPolicy(max_attempts=2, backoff_base=0.001, backoff_max=0.002)
    return [gcs.with_retry(twice), azure.with_retry(twice)]


def _retried_then_exhausted(call, store) -> None:
    """``call`` failed transiently on both of its two attempts."""
    before = _Handler.requests
    with pytest.raises(RetriesExhaustedError, match=store.root_url) as info:
        call()
    assert isinstance(info.value.__cause__, TransientError)
    assert _Handler.requests - before >= 2


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_throttling_and_5xx_are_transient(endpoint: str, status: int) -> None:
    _Handler.answer.status, _Handler.answer.drop = status, False
    for store in _stores(endpoint):
        _retried_then_exhausted(lambda s=store: s.put("k", b"data"), store)
        _retried_then_exhausted(lambda s=store: s.get_range("k", 0, 4), store)


def test_dropped_connection_is_transient(endpoint: str) -> None:
    _Handler.answer.drop = True
    try:
        for store in _stores(endpoint):
            _retried_then_exhausted(lambda s=store: s.head("k"), store)
    finally:
        _Handler.answer.drop = False


@pytest.mark.parametrize(("status", "error"), [(403, AccessDeniedError), (400, StorageError)])
def test_client_errors_are_not_transient(endpoint: str, status: int, error: type) -> None:
    _Handler.answer.status, _Handler.answer.drop = status, False
    for store in _stores(endpoint):
        before = _Handler.requests
        with pytest.raises(error) as info:
            store.put("k", b"data")
        assert not isinstance(info.value, (TransientError, RetriesExhaustedError))
        assert _Handler.requests - before == 1  # not retried
