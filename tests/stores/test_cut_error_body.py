"""An error answer whose body is cut short (``503 SlowDown`` promising 50 bytes more than
it sends, then the connection closed) is the retryable failure it is: retried, then a
typed error naming the URL, never a raw ``urllib3`` ``ProtocolError`` (F4).

A small HTTP server here gives the canned answers: a HEAD finds an object, every GET (a
ranged read on the fast path, a whole-object read and a listing through the client) is
answered that way.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

import cloudckpt
from cloudckpt import options
from cloudckpt.cli import main
from cloudckpt.errors import CloudCkptError, RetriesExhaustedError
from cloudckpt.manager import CheckpointManager
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from silent import CREDS, LoopbackServer

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class CutErrorServer(LoopbackServer):
    """HEAD: an object of 4096 bytes; anything else: 503 with its body cut short."""

    def __init__(self) -> None:
        self.gets = 0
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            method = data.split(b" ", 1)[0]
            if method == b"HEAD":
                conn.sendall(
                    b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: 4096\r\n'
                    b"Last-Modified: Sun, 06 Dec 2026 00:00:00 GMT\r\n\r\n"
                )
                return
            self.gets += 1
            conn.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(SLOWDOWN) + 50}\r\n\r\n".encode()
                + SLOWDOWN
            )
            conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def cut() -> Iterator[CutErrorServer]:
    server = CutErrorServer()
    yield server
    server.close()


def _options(server: CutErrorServer) -> dict[str, object]:
    return {
        "storage_options": {"endpoint_url": server.url, **CREDS},
        "max_attempts": 3,
        "backoff_base": 0.01,
        "backoff_max": 0.02,
        "adaptive_rate": False,
    }


def test_a_ranged_read_meeting_a_cut_error_body_is_retried_then_named(cut):
    store, key = open_url("s3://bkt/run1/x.pt", resolve_options(**_options(cut)))
    buf = bytearray(100)
    with pytest.raises(RetriesExhaustedError, match=r"s3://bkt/run1/x\.pt") as info:
        store.read_into(key, 0, [memoryview(buf)])
    assert "after 3 attempts" in str(info.value)
    assert cut.gets == 3


def test_a_whole_object_read_and_a_listing_meeting_a_cut_error_body_are_retried(cut):
    store, key = open_url("s3://bkt/run1/x.pt", resolve_options(**_options(cut)))
    with pytest.raises(RetriesExhaustedError, match=r"s3://bkt/run1/x\.pt"):
        store.get(key)
    assert cut.gets == 3
    with pytest.raises(RetriesExhaustedError, match=r"s3://bkt"):
        list(store.list("run1/"))
    assert cut.gets == 6


def test_load_and_a_manager_end_in_typed_errors(cut):
    with pytest.raises(CloudCkptError, match=r"s3://bkt/run1/x\.pt"):
        cloudckpt.load("s3://bkt/run1/x.pt", **_options(cut))
    manager = CheckpointManager("s3://bkt/run1", **_options(cut))
    with pytest.raises(CloudCkptError, match=r"s3://bkt"):
        manager.latest()
    with pytest.raises(CloudCkptError, match=r"s3://bkt"):
        manager.restore()


def test_the_command_line_says_what_failed_without_a_traceback(cut, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", cut.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setattr(options, "_defaults", options.get_defaults())  # restored after
    options.configure(max_attempts=2, backoff_base=0.01, backoff_max=0.02)
    code = main(["info", "--json", "s3://bkt/run1/x.pt"])
    out, err = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in err
    assert "s3://bkt/run1/x.pt" in json.loads(out)["error"]


def test_a_gcs_store_retries_a_cut_error_body_too(cut):
    pytest.importorskip("requests")
    options = {**_options(cut), "storage_options": {"endpoint_url": cut.url, "anonymous": True}}
    store, key = open_url("gs://bkt/run1/x.pt", resolve_options(**options))
    buf = bytearray(100)
    with pytest.raises(RetriesExhaustedError, match=r"gs://bkt/run1/x\.pt"):
        store.read_into(key, 0, [memoryview(buf)])  # a streamed answer: its body read after
    assert cut.gets == 3
    with pytest.raises(RetriesExhaustedError, match=r"gs://bkt/run1/x\.pt"):
        store.head(key)  # a whole answer: cut while requests reads it
    assert cut.gets == 6
