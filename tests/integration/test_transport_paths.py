"""The S3 byte path stays copy-free: memoryview bodies out, readinto straight into memory.

These rely on botocore/urllib3 internals (see docs/transport.md); if an upgrade
changes them, these tests fail instead of the library silently copying.
"""

from __future__ import annotations

import http.client

from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url


def test_ranged_reads_fill_the_destination_through_readinto(s3_server, monkeypatch):
    bucket = s3_server.make_bucket(f"readinto-{s3_server.name}")
    store, key = open_url(
        f"s3://{bucket}/blob", resolve_options(storage_options=s3_server.storage_options())
    )
    payload = bytes(range(256)) * 8192  # 2 MiB
    store.put(key, payload)

    calls = []
    real = http.client.HTTPResponse.readinto

    def counting(self, b):
        calls.append(len(b))
        return real(self, b)

    monkeypatch.setattr(http.client.HTTPResponse, "readinto", counting)
    dest = bytearray(MiB)
    store.read_into(key, 4096, [memoryview(dest)])
    assert bytes(dest) == payload[4096 : 4096 + MiB]
    assert calls and calls[0] == MiB  # asked to fill our buffer directly


def test_upload_bodies_are_sent_as_memoryviews(s3_server):
    bucket = s3_server.make_bucket(f"views-{s3_server.name}")
    store, key = open_url(
        f"s3://{bucket}/obj", resolve_options(storage_options=s3_server.storage_options())
    )
    seen = []
    store._client.meta.events.register(
        "before-send.s3.UploadPart", lambda request, **kw: seen.append(type(request.body))
    )
    upload = store.create_multipart(key)
    part = store.upload_part(upload, 1, memoryview(bytearray(5 * MiB)), 0)
    store.complete_multipart(upload, [part])
    assert seen == [memoryview]
    assert store.head(key).size == 5 * MiB
