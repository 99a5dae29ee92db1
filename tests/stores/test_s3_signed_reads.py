"""S3 ranged reads signed once per object (cloudckpt.store.s3_signed_reads), on real servers.

The fast path must be taken (no GetObject through the client) with signatures the
server accepts (rclone checks them, also for keys that need quoting), sign each object
once, go through a configured proxy, hand anything but a body back to the client (which
names errors and refreshes credentials), turn itself off when the server keeps refusing
it, treat throttling as transient without sending the request twice, and never show
credentials in an error.
"""

from __future__ import annotations

import pytest

from cloudckpt.errors import NotFoundError, RetriesExhaustedError, TransientError
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import RetryPolicy, open_url
from cloudckpt.store.s3_signed_reads import MAX_MISSES
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import free_port

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


def _store(server, name: str, *, make: bool = True, **overrides):
    bucket = f"signed-{name}-{server.name}"
    if make:
        server.make_bucket(bucket)
    opts = {**server.storage_options(), **overrides}
    store, key = open_url(f"s3://{bucket}/obj", resolve_options(storage_options=opts))
    return store, key


def _read(store, key: str, start: int, n: int) -> bytes:
    buf = bytearray(n)
    store.read_into(key, start, [memoryview(buf)])
    return bytes(buf)


def _count_client_gets(store) -> list[str]:
    through_client: list[str] = []
    store._client.meta.events.register(
        "before-send.s3.GetObject", lambda request, **kw: through_client.append(request.url)
    )
    return through_client


def test_ranged_reads_skip_the_client_and_sign_once(s3_server, monkeypatch):
    store, key = _store(s3_server, "fast")
    store.put(key, PAYLOAD)
    through_client = _count_client_gets(store)
    signed = []
    real = store._client.generate_presigned_url
    monkeypatch.setattr(
        store._client,
        "generate_presigned_url",
        lambda *a, **kw: signed.append(kw["Params"]["Key"]) or real(*a, **kw),
    )
    for start in (0, 4096, 100_000, MiB - 10):
        assert _read(store, key, start, 10) == PAYLOAD[start : start + 10]
    assert through_client == []
    assert signed == [key]
    assert store._fast_reads.enabled


@pytest.mark.parametrize("name", ["a b+c", "dir/ünï~cödé", "per%cent&amp=?x", "d/" + "x" * 200])
def test_keys_that_need_quoting_are_signed_as_the_server_reads_them(rclone_server, name):
    store, _ = _store(rclone_server, f"quoting{len(name)}")
    store.put(name, PAYLOAD)
    through_client = _count_client_gets(store)
    assert _read(store, name, 1000, 2000) == PAYLOAD[1000:3000]
    assert through_client == []  # rclone checks the signature: a wrong one is a refusal


def test_anonymous_stores_send_unsigned_ranges(moto_server):
    store, key = _store(moto_server, "anon")
    moto_server.client().put_object(Bucket=store.bucket, Key=key, Body=PAYLOAD, ACL="public-read")
    anon, _ = _store(moto_server, "anon", make=False, anonymous=True)
    sent = []
    real = anon._fast_reads._direct
    anon._fast_reads._direct = lambda url, headers: sent.append(headers) or real(url, headers)
    assert _read(anon, key, 7, 70) == PAYLOAD[7:77]
    assert sent == [{"Range": "bytes=7-76"}]


def test_a_configured_proxy_carries_the_ranged_reads(rclone_server, monkeypatch):
    with FaultProxy(rclone_server.endpoint_url) as proxy:
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        store, key = _store(rclone_server, "proxied")
        assert store._fast_reads._pools is None  # the session addresses the proxy
        store.put(key, PAYLOAD)
        before = proxy.requests
        through_client = _count_client_gets(store)
        assert _read(store, key, 4096, 8192) == PAYLOAD[4096 : 4096 + 8192]
        assert through_client == []
        assert proxy.requests == before + 1


def test_refusals_go_through_the_client_then_turn_the_fast_path_off(s3_server, monkeypatch):
    store, key = _store(s3_server, "refused")
    store.put(key, PAYLOAD)
    fast = store._fast_reads
    real = fast._signed_get
    monkeypatch.setattr(fast, "_signed_get", lambda k: real(k + ".missing"))  # answers: 404
    for i in range(MAX_MISSES):
        assert fast.enabled
        assert _read(store, key, i * 1000, 100) == PAYLOAD[i * 1000 : i * 1000 + 100]
    assert not fast.enabled
    assert _read(store, key, 5, 5) == PAYLOAD[5:10]


def test_a_missing_object_is_named_by_the_client(s3_server):
    store, key = _store(s3_server, "missing")
    with pytest.raises(NotFoundError, match="obj"):
        _read(store, key, 0, 10)
    assert store._fast_reads.enabled  # an error the client confirms is not a refusal


def test_throttling_is_transient_and_sent_once(rclone_server):
    store, key = _store(rclone_server, "throttled")
    store.put(key, PAYLOAD)
    with FaultProxy(rclone_server.endpoint_url, schedule={1: "slowdown"}) as proxy:
        store, key = _store(rclone_server, "throttled", make=False, endpoint_url=proxy.url)
        once = store.with_retry(RetryPolicy(max_attempts=1))
        with pytest.raises(RetriesExhaustedError, match="after 1 attempts") as info:
            _read(once, key, 0, 10)
        assert isinstance(info.value.__cause__, TransientError)
        assert "503" in str(info.value.__cause__)
        assert proxy.requests == 1  # classified transient on the fast path, not sent again
        assert _read(store, key, 0, 10) == PAYLOAD[:10]


def test_network_errors_never_show_credentials(moto_server):
    opts = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    store, key = open_url(
        "s3://any-bucket/obj", resolve_options(storage_options=opts, max_attempts=2)
    )
    with pytest.raises(RetriesExhaustedError) as info:
        _read(store, key, 0, 10)
    assert isinstance(info.value.__cause__, TransientError)
    text = f"{info.value} {info.value.__cause__}"
    assert "s3://any-bucket/obj" in text
    secrets = ("Signature", "Credential", opts["aws_access_key_id"], opts["aws_secret_access_key"])
    for secret_part in secrets:
        assert secret_part not in text
