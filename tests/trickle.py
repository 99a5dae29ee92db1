"""An S3 endpoint on 127.0.0.1 that answers every request's headers at once, then sends
its body at ``bytes_per_second`` (0: never): the endpoint that a stall timer resetting on
each byte never gives up on. Its objects are all ``size`` bytes of zeros; a listing
(``GET /bucket?list-type=2``) names one object, ``run1/x.pt``; a PUT's body is drained
and never answered.
"""

from __future__ import annotations

import socket

from silent import LoopbackServer


class TrickleServer(LoopbackServer):
    def __init__(self, size: int = 100_000, bytes_per_second: float = 1.0) -> None:
        self.size = size
        self.bytes_per_second = bytes_per_second
        super().__init__()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
        }

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        try:
            while not self._stopped.is_set():  # requests on one connection, in turn
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                raw, _, data = data.partition(b"\r\n\r\n")
                if not self._answer(conn, raw.decode("latin-1")):
                    return
        except OSError:
            return

    def _answer(self, conn: socket.socket, head: str) -> bool:
        """Answer one request; False when the connection is done with."""
        line = head.split("\r\n", 1)[0]
        with self._lock:
            self.requests.append(line)
        method, target = line.split(" ")[:2]
        if method == "HEAD":
            conn.sendall(
                b'HTTP/1.1 200 OK\r\nETag: "e"\r\n'
                b"Last-Modified: Sun, 06 Dec 2026 00:00:00 GMT\r\n"
                + f"Content-Length: {self.size}\r\n\r\n".encode()
            )
            return True
        if method != "GET":
            while conn.recv(65536):  # drain, never answer
                pass
            return False
        if "list-type=2" in target:
            body = (
                '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                "<Name>bkt</Name><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated>"
                f"<Contents><Key>run1/x.pt</Key><Size>{self.size}</Size>"
                '<ETag>"e"</ETag><LastModified>2026-12-06T00:00:00.000Z</LastModified>'
                "</Contents></ListBucketResult>"
            ).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
        else:
            start, end = 0, self.size - 1
            for header in head.split("\r\n")[1:]:
                name, _, value = header.partition(":")
                if name.strip().lower() == "range":
                    first, _, last = value.strip().removeprefix("bytes=").partition("-")
                    start, end = int(first), min(int(last), self.size - 1)
            body = bytes(end - start + 1)
            conn.sendall(
                b'HTTP/1.1 206 Partial Content\r\nETag: "e"\r\n'
                + f"Content-Range: bytes {start}-{end}/{self.size}\r\n".encode()
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
        for i in range(len(body)):
            if self.bytes_per_second <= 0 or self._stopped.wait(1.0 / self.bytes_per_second):
                self._stopped.wait()
                return False
            conn.sendall(body[i : i + 1])
        return True
