"""The ceiling: the transport alone (botocore) moving pre-built bytes, no serialization.

PUT: one multipart upload of the state's bytes in parts of at most 64 MiB, 10 at a time,
each part handed to urllib3 as a bare memoryview (no copy, no hashing). GET: ranged GETs
of at most 32 MiB, 15 at a time, each object's GET signed once by the client's signer
and every range sent straight to the client's connection pool with the signed headers
and a Range header (the cheapest request botocore's parts can make, as cloudckpt's
reads do), read with ``readinto`` straight into one preallocated buffer. These are
cloudckpt's default part size, chunk size and concurrencies; the ceiling evens the
sizes out so that the number of requests is a multiple of the concurrency (no last
wave with a few streams idle), as a best case should.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import botocore.session
import torch
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from urllib3.util import parse_url
from urllib3.util.retry import Retry

from .common import Ctx

READ_CHUNK = 32 * 1024 * 1024
READ_CONCURRENCY = 15
KEY = "ceiling.bin"


class _ViewBody:
    """File-like around a memoryview so botocore accepts it; swapped out before sending."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._pos = 0

    def __len__(self) -> int:
        return self.view.nbytes

    def read(self, n: int = -1) -> memoryview:
        end = self.view.nbytes if n is None or n < 0 else min(self._pos + n, self.view.nbytes)
        out, self._pos = self.view[self._pos : end], end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self.view.nbytes}[whence] + pos
        return self._pos

    def tell(self) -> int:
        return self._pos


def _swap_body(request: Any, **_kwargs: Any) -> None:
    if isinstance(request.body, _ViewBody):
        request.body = request.body.view
        request.headers.pop("Expect", None)


_CLIENTS: dict[int, Any] = {}


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create the clients (botocore loads its service model, ~0.1 s)."""
    _client(ctx, ctx.concurrency)
    _client(ctx, READ_CONCURRENCY)


def _client(ctx: Ctx, pool: int) -> Any:
    if pool in _CLIENTS:
        return _CLIENTS[pool]
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=ctx.endpoint,
        region_name=ctx.region,
        aws_access_key_id=ctx.access_key,
        aws_secret_access_key=ctx.secret_key,
        config=Config(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=pool,
            signature_version="s3v4",
        ),
    )
    client.meta.events.register("before-send.s3.UploadPart", _swap_body)
    _CLIENTS[pool] = client
    return client


def balanced(size: int, largest: int, streams: int, smallest: int = 1024 * 1024) -> int:
    """A request size <= ``largest`` that splits ``size`` into full waves of ``streams``."""
    waves = max(1, -(-size // (largest * streams)))
    return max(smallest, -(-size // (waves * streams)))


def prepare(state: dict[str, torch.Tensor]) -> bytearray:
    """The pre-built bytes: every tensor's bytes back to back (built before the clock)."""
    out = bytearray(nbytes(state))
    pack(state, out)
    return out


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def pack(state: dict[str, torch.Tensor], out: Any) -> None:
    """Every tensor's bytes back to back into ``out`` (a writable buffer of ``nbytes``)."""
    flat = torch.frombuffer(out, dtype=torch.uint8)
    pos = 0
    for t in state.values():
        n = t.numel() * t.element_size()
        flat[pos : pos + n] = t.contiguous().view(-1).view(torch.uint8)
        pos += n


def save(data: bytearray, ctx: Ctx) -> None:
    put(ctx, f"{ctx.prefix}/{KEY}", memoryview(data))


def put(ctx: Ctx, key: str, view: memoryview) -> None:
    """One multipart upload of ``view``: balanced parts, ``ctx.concurrency`` at once."""
    client = _client(ctx, ctx.concurrency)
    part = balanced(view.nbytes, ctx.part_size, ctx.concurrency, smallest=5 * 1024 * 1024)
    ranges = [(a, min(a + part, view.nbytes)) for a in range(0, view.nbytes, part)]
    up = client.create_multipart_upload(Bucket=ctx.bucket, Key=key)["UploadId"]

    def one(i: int) -> dict[str, Any]:
        a, b = ranges[i]
        r = client.upload_part(
            Bucket=ctx.bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=_ViewBody(view[a:b])
        )
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(ctx.concurrency) as pool:
        parts = list(pool.map(one, range(len(ranges))))
    client.complete_multipart_upload(
        Bucket=ctx.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts}
    )


def _readinto(raw: Any, dest: memoryview) -> None:
    fp = raw._fp  # urllib3 response; its _fp is the http.client response
    got = 0
    for _ in range(dest.nbytes + 1):  # bounded: each pass reads something or stops
        if got == dest.nbytes:
            break
        k = fp.readinto(dest[got:])
        if not k:
            break
        got += k
    if got != dest.nbytes:
        raw.close()
        raise OSError(f"short read {got}/{dest.nbytes}")
    raw.release_conn() if fp.isclosed() else raw.close()


def load(ctx: Ctx, size: int) -> mmap.mmap:
    """Into anonymous memory the kernel zeroes on first touch (``bytearray(n)`` would
    memset it all first, a pass over cold memory that no real reader needs)."""
    out = mmap.mmap(-1, size)
    view = memoryview(out)
    get(ctx, [(f"{ctx.prefix}/{KEY}", 0, view)])
    view.release()
    return out


def get(ctx: Ctx, spans: list[tuple[str, int, memoryview]]) -> None:
    """Fill each ``(key, start, dest)`` by ranged GETs of balanced chunks, 15 at once."""
    client = _client(ctx, READ_CONCURRENCY)
    chunk = balanced(sum(v.nbytes for _, _, v in spans), READ_CHUNK, READ_CONCURRENCY)
    requests = [
        (key, start + a, dest[a : a + chunk])
        for key, start, dest in spans
        for a in range(0, dest.nbytes, chunk)
    ]

    pools = client._endpoint.http_session._manager  # the client's pools (no proxy here)
    signed = {}
    for key, _, _ in spans:  # the object's URL as the client addresses it, signed once
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": ctx.bucket, "Key": key}, ExpiresIn=60
        ).split("?", 1)[0]
        request = AWSRequest(method="GET", url=url)
        signer = client._request_signer.get_auth_instance("s3", ctx.region, "s3v4")
        signer.add_auth(request)
        signed[key] = (parse_url(url), dict(request.headers.items()))
    no_retries = Retry(False)

    def one(request: tuple[str, int, memoryview]) -> None:
        key, a, dest = request
        url, headers = signed[key]
        answer = pools.connection_from_host(url.host, url.port, url.scheme).urlopen(
            "GET",
            url.request_uri,
            headers={**headers, "Range": f"bytes={a}-{a + dest.nbytes - 1}"},
            retries=no_retries,
            assert_same_host=False,
            preload_content=False,
            decode_content=False,
        )
        if answer.status not in (200, 206):
            raise OSError(f"ceiling GET {key}: status {answer.status}")
        _readinto(answer, dest)

    with ThreadPoolExecutor(READ_CONCURRENCY) as pool:
        list(pool.map(one, requests))


def same(loaded: mmap.mmap, data: bytearray) -> bool:
    """Whether the GET returned the PUT's bytes (compared in slices, untimed)."""
    step = 64 * 1024 * 1024
    return len(loaded) == len(data) and all(
        loaded[a : a + step] == data[a : a + step] for a in range(0, len(data), step)
    )
