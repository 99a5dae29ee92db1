"""The C-client ceiling: curl moving the same pre-built bytes as ``ceiling``, in subprocesses.

The bytes are ``ceiling.prepare``'s (every tensor's bytes back to back), written before
the clock into a memfd (tmpfs pages that no file name points to) and, for the multipart
upload, into one memfd per part; curl reads them through ``/dev/fd/N``. curl signs every
request itself (``--aws-sigv4 aws:amz:REGION:s3``, unsigned payload), path-style to the
server's endpoint, and sends a body without waiting for ``100 Continue``
(``--expect100-timeout 0``: curl 7.88 signs an emptied ``Expect:`` header, then leaves
it out). Each operation is done two ways, one after the other, each on its own clock
(wall time, CPU of this process and of its curl children, peak extra RSS, the requests
curl made); the faster way gives the operation's figures, and both are recorded under
``variants``:

- save ``put``: one PUT of the whole object, one curl.
- save ``multipart``: create (POST ``?uploads``) and complete (POST of the parts' XML),
  one curl each; the parts in ``ceiling``'s balanced sizes (at most 64 MiB, whole waves
  of ``ctx.concurrency``), uploaded by ``ctx.concurrency`` curl processes at once, each
  its share of the parts in turn on one kept-alive connection.
- load ``get``: one GET of the whole object (``put``'s), one curl.
- load ``ranged``: ``ceiling``'s balanced chunks (at most 32 MiB, whole waves of 15) as
  ranged GETs of ``multipart``'s object by 15 curl processes at once, each a contiguous
  run of chunks in turn on one kept-alive connection.

Where a load's bytes go: curl's stdout is a memfd of the object's size, opened anew for
each curl (its own file offset) and positioned at the first byte of its run, so every
curl writes its ranges in place; the worker maps the memfd as the clock stops. The
bytes reach this process's memory with one copy out of the socket (curl's buffer) and
one into the memfd's pages, and no Python in between: the leanest delivery a separate
process allows (a pipe into a preallocated buffer adds a copy and Python reading it;
files in /dev/shm are the same tmpfs pages, with names to clean up).

Checked, so that a failing curl cannot look fast: inside the clock, every transfer's
HTTP status and byte count (curl's ``--write-out``) and the complete's answer; after
it, each saved object's size (HEAD), and each loaded buffer against the pre-built bytes
(``get`` reads ``put``'s object and ``ranged`` reads ``multipart``'s, so every byte
saved is read back and compared).
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import torch

from . import ceiling
from .common import Ctx, cpu_seconds, reset_peak, status_kib

T = TypeVar("T")

#: Checked inside (``load`` compares every variant's bytes after its own clock).
SELF_CHECKED = True
#: 7.75 brought ``--aws-sigv4``, 7.84 ``%header{}`` in ``--write-out`` (the parts' ETags).
CURL_MIN = (7, 84)
MIN_PART = 5 * 1024 * 1024
TIMEOUT = 600.0
KEYS = {"put": "ceiling-put.bin", "multipart": "ceiling-multipart.bin"}

#: The pre-built bytes (``prepare``) and the parts' memfds (``warm``): (fd, start, end).
_SOURCE: dict[str, Any] = {}


def configure(ctx: Ctx) -> None:
    """Fail before anything is built where curl is missing or too old."""
    if shutil.which("curl") is None:
        raise FileNotFoundError("ceiling-curl needs curl on PATH")
    first = subprocess.run(["curl", "--version"], capture_output=True, text=True, check=True)
    found = re.match(r"curl (\d+)\.(\d+)", first.stdout)
    if not found or (int(found[1]), int(found[2])) < CURL_MIN:
        version = first.stdout.splitlines()[0] if first.stdout else "no version"
        raise OSError(f"ceiling-curl needs curl >= {CURL_MIN[0]}.{CURL_MIN[1]}: {version}")


def prepare(state: dict[str, torch.Tensor]) -> mmap.mmap:
    """The pre-built bytes (``ceiling``'s layout) in a memfd, mapped."""
    size = ceiling.nbytes(state)
    fd = os.memfd_create("ceiling-curl")
    os.ftruncate(fd, size)
    data = mmap.mmap(fd, size)
    ceiling.pack(state, data)
    _SOURCE.update(fd=fd, data=data)
    return data


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: one memfd per part of the multipart upload, in ``ceiling``'s part sizes."""
    data: mmap.mmap = _SOURCE["data"]
    size = len(data)
    part = ceiling.balanced(size, ctx.part_size, ctx.concurrency, smallest=MIN_PART)
    view = memoryview(data)
    parts: list[tuple[int, int, int]] = []
    for a in range(0, size, part):
        b = min(a + part, size)
        fd = os.memfd_create(f"ceiling-curl-part{len(parts) + 1}")
        done = a
        while done < b:
            done += os.write(fd, view[done:b])
        parts.append((fd, a, b))
    view.release()
    _SOURCE["parts"] = parts


def _timed(fn: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """``fn``'s result and figures, measured as the worker measures a whole call."""
    exact = reset_peak()
    rss0 = status_kib("VmRSS")
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    return out, {
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_extra_rss": (status_kib("VmHWM") - rss0) * 1024,
        "peak_exact": exact,
    }


def _best(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fastest variant's figures as the operation's, every variant's under ``variants``."""
    name = min(variants, key=lambda v: variants[v]["seconds"])
    return {**variants[name], "variant": name, "variants": variants}


def _url(ctx: Ctx, name: str, query: str = "") -> str:
    key = quote(f"{ctx.prefix}/{KEYS[name]}", safe="/")
    return f"{ctx.endpoint}/{ctx.bucket}/{key}" + (f"?{query}" if query else "")


def _auth(ctx: Ctx) -> list[str]:
    return ["--aws-sigv4", f"aws:amz:{ctx.region}:s3", "--user",
            f"{ctx.access_key}:{ctx.secret_key}", "--silent", "--show-error", "--fail",
            "--noproxy", "*"]  # fmt: skip


def _chain(transfers: list[list[str]]) -> list[str]:
    """One curl command line for ``transfers`` in turn (one connection, kept alive)."""
    out = ["curl"]
    for i, t in enumerate(transfers):
        out += (["--next"] if i else []) + t
    return out


def _wait(procs: list[subprocess.Popen[bytes]], what: str) -> list[tuple[str, ...]]:
    """Wait for every curl (killing the rest if one fails); each one's (stdout, stderr)."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            if p.returncode != 0:
                text = (err or b"").decode(errors="replace").strip()[:300]
                raise OSError(f"ceiling-curl {what}: curl exited with {p.returncode}: {text}")
            outs.append(tuple((b or b"").decode(errors="replace") for b in (out, err)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


_UPLOADED = re.compile(r"^(\d{3}) (\d+) (.*)$", re.MULTILINE)
_DOWNLOADED = re.compile(r"^(\d{3}) (\d+)$", re.MULTILINE)


def _uploads(ctx: Ctx, groups: list[list[tuple[int, int, str]]], what: str) -> list[str]:
    """Upload each group's ``(fd, size, url)`` in turn, the groups at once; the ETags."""
    write_out = "%{http_code} %{size_upload} %header{etag}\n"
    procs = []
    for group in groups:
        transfers = [[*_auth(ctx), "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                      "--expect100-timeout", "0", "--upload-file", f"/dev/fd/{fd}", "--output",
                      "/dev/null", "--write-out", write_out, url]
                     for fd, _, url in group]  # fmt: skip
        procs.append(subprocess.Popen(_chain(transfers), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE,
                                      pass_fds=[fd for fd, _, _ in group]))  # fmt: skip
    etags = []
    for group, (out, _) in zip(groups, _wait(procs, what), strict=True):
        lines = _UPLOADED.findall(out)
        if len(lines) != len(group):
            raise OSError(f"ceiling-curl {what}: {len(lines)} answers for {len(group)} PUTs")
        for (code, sent, etag), (_, size, _) in zip(lines, group, strict=True):
            if code != "200" or int(sent) != size:
                raise OSError(f"ceiling-curl {what}: status {code}, {sent}/{size} bytes sent")
            etags.append(etag.strip())
    return etags


def _put(ctx: Ctx) -> int:
    """One PUT of the whole object; the requests made."""
    fd, data = _SOURCE["fd"], _SOURCE["data"]
    _uploads(ctx, [[(fd, len(data), _url(ctx, "put"))]], "PUT")
    return 1


def _post(ctx: Ctx, url: str, body: str, what: str) -> str:
    args = [*_auth(ctx), "-X", "POST", "-H",
            f"x-amz-content-sha256: {hashlib.sha256(body.encode()).hexdigest()}"]  # fmt: skip
    if body:
        args += ["-H", "Content-Type: application/xml", "--data-binary", body]
    proc = subprocess.Popen(_chain([[*args, url]]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    return _wait([proc], what)[0][0]


def _multipart(ctx: Ctx) -> int:
    """Create, ``ctx.concurrency`` curls uploading the parts, complete; the requests made."""
    parts = _SOURCE["parts"]
    created = _post(ctx, _url(ctx, "multipart", "uploads="), "", "create multipart upload")
    found = re.search(r"<UploadId>([^<]+)</UploadId>", created)
    if not found:
        raise OSError(f"ceiling-curl: no UploadId in {created[:200]!r}")
    upload = quote(found[1], safe="")
    streams = min(ctx.concurrency, len(parts))
    groups = [
        [(fd, b - a, _url(ctx, "multipart", f"partNumber={i + 1}&uploadId={upload}"))
         for i, (fd, a, b) in enumerate(parts) if i % streams == w]
        for w in range(streams)
    ]  # fmt: skip
    etags = _uploads(ctx, groups, "upload part")
    numbers = [n for w in range(streams) for n in range(w + 1, len(parts) + 1, streams)]
    by_number = dict(zip(numbers, etags, strict=True))
    body = "<CompleteMultipartUpload>" + "".join(
        f"<Part><PartNumber>{n}</PartNumber><ETag>{by_number[n]}</ETag></Part>"
        for n in sorted(by_number)
    ) + "</CompleteMultipartUpload>"  # fmt: skip
    done = _post(ctx, _url(ctx, "multipart", f"uploadId={upload}"), body, "complete")
    if "<CompleteMultipartUploadResult" not in done:
        raise OSError(f"ceiling-curl: complete answered {done[:200]!r}")
    return len(parts) + 2


def _size(ctx: Ctx, name: str) -> int:
    """The stored object's size (HEAD), after the clock."""
    proc = subprocess.Popen(_chain([[*_auth(ctx), "--head", _url(ctx, name)]]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    head = _wait([proc], "HEAD")[0][0]
    found = re.search(r"^content-length:\s*(\d+)", head, re.IGNORECASE | re.MULTILINE)
    return int(found[1]) if found else -1


def save(data: mmap.mmap, ctx: Ctx) -> dict[str, Any]:
    variants = {}
    for name, fn in (("put", _put), ("multipart", _multipart)):
        requests, figures = _timed(functools.partial(fn, ctx))
        variants[name] = {**figures, "requests": requests}
        stored = _size(ctx, name)
        if stored != len(data):
            raise OSError(f"ceiling-curl {name}: stored {stored} bytes of {len(data)}")
    return _best(variants)


def _downloads(ctx: Ctx, name: str, dest: int, runs: list[list[tuple[int, int]]]) -> int:
    """Each run of ``(start, end)`` ranges by one curl into memfd ``dest`` in place, the
    runs at once; the requests made. A run of one range covering everything: no Range."""
    url = _url(ctx, name)
    size = os.fstat(dest).st_size
    procs = []
    for run in runs:
        out = os.open(f"/proc/self/fd/{dest}", os.O_WRONLY)  # its own file offset
        try:
            os.lseek(out, run[0][0], os.SEEK_SET)
            transfers = [[*_auth(ctx), "--write-out", "%{stderr}%{http_code} %{size_download}\n",
                          *([] if (a, b) == (0, size) else ["--range", f"{a}-{b - 1}"]), url]
                         for a, b in run]  # fmt: skip
            procs.append(subprocess.Popen(_chain(transfers), stdout=out, stderr=subprocess.PIPE))
        finally:
            os.close(out)
    for run, (_, err) in zip(runs, _wait(procs, f"GET {name}"), strict=True):
        lines = _DOWNLOADED.findall(err)
        got = [(code, int(n)) for code, n in lines]
        # rclone answers a ranged GET with 200 and the range's bytes: count the bytes
        if len(got) != len(run) or any(
            code not in ("200", "206") or n != b - a
            for (code, n), (a, b) in zip(got, run, strict=True)
        ):
            raise OSError(f"ceiling-curl GET {name}: answers {got}, expected {run}")
    return sum(len(run) for run in runs)


def _get(ctx: Ctx, name: str, size: int, runs: list[list[tuple[int, int]]]) -> dict[str, Any]:
    """One load variant: into a fresh memfd, timed, then compared with the pre-built bytes."""
    dest = os.memfd_create(f"ceiling-curl-{name}")
    try:
        os.ftruncate(dest, size)

        def run() -> tuple[int, mmap.mmap]:
            requests = _downloads(ctx, name, dest, runs)
            return requests, mmap.mmap(dest, size)  # the bytes, in this process's memory

        (requests, loaded), figures = _timed(run)
        try:
            if not ceiling.same(loaded, _SOURCE["data"]):
                raise AssertionError(f"ceiling-curl GET of {name}'s object: different bytes")
        finally:
            loaded.close()
    finally:
        os.close(dest)
    return {**figures, "requests": requests}


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, Any]:
    size = len(_SOURCE["data"])
    chunk = ceiling.balanced(size, ceiling.READ_CHUNK, ceiling.READ_CONCURRENCY)
    chunks = [(a, min(a + chunk, size)) for a in range(0, size, chunk)]
    streams = min(ceiling.READ_CONCURRENCY, len(chunks))
    n = len(chunks)
    runs = [chunks[w * n // streams : (w + 1) * n // streams] for w in range(streams)]
    return _best({
        "get": _get(ctx, "put", size, [[(0, size)]]),
        "ranged": _get(ctx, "multipart", size, runs),
    })  # fmt: skip
