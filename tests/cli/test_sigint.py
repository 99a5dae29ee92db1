"""Ctrl-C during an upload: a real SIGINT to a real process talking to moto.

The process uploads through the fault proxy, which answers the first two parts and
holds every later part (no answer for a few seconds, then a dropped connection; a retry
is held again), so the upload is certainly still running when the signal arrives and
can never finish on its own. The test waits for real progress (the two parts stored
and a third held at the proxy), not for a time, then sends SIGINT. What each command
promises:

* ``cloudckpt cp`` (docs/cli.md): exit code 130, "interrupted"; nothing at the
  destination; the multipart upload left open with its journal; the same command run
  again sends only the missing parts and completes the object.
* ``cloudckpt.save`` (README, "Atomic commits"): Ctrl-C leaves nothing behind, not even
  an open multipart upload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.engine.copy import copy_object
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, unique_bucket_name

SRC = str(Path(__file__).resolve().parents[2] / "src")
PART = 5 * MiB
PARTS = 6  # five whole parts and a short last one
LET_THROUGH = 2  # parts the proxy answers before it holds the rest
#: How long the proxy holds a part before dropping its connection: the longest a
#: process that waits for its requests in flight should need to exit.
HOLD_S = 5.0
#: Generous bounds for things that take a few seconds on a quiet machine; reaching one
#: means a hang, not a slow machine.
PROGRESS_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 120.0


def _is_part(method: str, target: str) -> bool:
    return method == "PUT" and "partNumber=" in target


class _PartsAfter:
    """A proxy ``match``: counts part uploads, selects those after the first ``n``."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0
        self._lock = threading.Lock()

    def __call__(self, method: str, target: str) -> bool:
        if not _is_part(method, target):
            return False
        with self._lock:
            self.seen += 1
            return self.seen > self.n


def _env(server: S3Server, endpoint: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(server.env())
    env["AWS_ENDPOINT_URL"] = endpoint
    return env


def _holding_proxy(server: S3Server) -> tuple[FaultProxy, _PartsAfter]:
    held = _PartsAfter(LET_THROUGH)
    proxy = FaultProxy(
        server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=HOLD_S, match=held
    )
    return proxy, held


def _interrupt(
    command: list[str], env: dict[str, str], progressed: Callable[[], bool]
) -> subprocess.CompletedProcess[str]:
    """Run ``command``, send SIGINT once ``progressed()``, and return how it ended."""
    proc = subprocess.Popen(
        command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        while not progressed():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"it ended before the interrupt ({proc.returncode}): {err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no upload progress within {PROGRESS_TIMEOUT_S:.0f} s")
            time.sleep(0.05)  # polling for the progress above, not waiting for a time
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _cp(src: Path, dst: str, state: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "cloudckpt", "cp", str(src), dst,
        "--part-size", "5MiB", "--concurrency", "2", "--state-dir", str(state), *extra,
    ]  # fmt: skip


def _journal(state: Path) -> dict[str, Any] | None:
    """The upload journal, once one is written (replaced whole by a rename: never torn)."""
    for path in state.glob("upload-*.json"):
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None
    return None


def _parts(state: Path) -> dict[str, Any]:
    """The parts the upload journal records as stored (none before it is written)."""
    journal = _journal(state)
    return dict(journal["parts"]) if journal else {}


def _stored_parts(client: Any, bucket: str, key: str, upload_id: str) -> list[int]:
    listed = client.list_parts(Bucket=bucket, Key=key, UploadId=upload_id)
    return sorted(p["PartNumber"] for p in listed.get("Parts", []))


def test_ctrl_c_stops_cp_and_the_same_command_resumes(
    moto_server: S3Server, tmp_path: Path
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("sigint-cp"))
    data = os.urandom((PARTS - 1) * PART + MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    state = tmp_path / "state"
    key = "copies/big.bin"
    dst = f"s3://{bucket}/{key}"
    client = moto_server.client()

    proxy, held = _holding_proxy(moto_server)
    with proxy:

        def progressed() -> bool:
            journal = _journal(state)
            return bool(journal and len(journal["parts"]) >= LET_THROUGH and held.seen > 2)

        done = _interrupt(_cp(src, dst, state), _env(moto_server, proxy.url), progressed)

    assert done.returncode == 130, (done.returncode, done.stdout, done.stderr)
    assert "cloudckpt cp: interrupted" in done.stderr, done.stderr
    kept = f"interrupted: {LET_THROUGH} of {PARTS} parts kept; run the same command to resume"
    assert kept in done.stderr, done.stderr
    # Nothing committed; the upload the journal names is open, with the parts it records.
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    journal = _journal(state)
    assert journal is not None
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [(key, journal["upload_id"])]
    stored = _stored_parts(client, bucket, key, journal["upload_id"])
    assert stored == list(range(1, LET_THROUGH + 1))
    assert sorted(int(n) for n in journal["parts"]) == stored

    # The same command again, with nothing held: it sends only the missing parts.
    counted = _PartsAfter(0)  # counts every part upload; the proxy injects nothing
    with FaultProxy(moto_server.endpoint_url, match=counted) as proxy:
        again = subprocess.run(
            _cp(src, dst, state, "--json"), env=_env(moto_server, proxy.url), text=True,
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip
    assert again.returncode == 0, (again.stdout, again.stderr)
    summary = json.loads(again.stdout)
    assert summary["resumed_bytes"] == LET_THROUGH * PART
    assert summary["moved_bytes"] == len(data) - LET_THROUGH * PART  # the rate's bytes
    assert counted.seen == PARTS - LET_THROUGH
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert _journal(state) is None  # the finished copy removed its journal


#: A stalled part: no answer for far longer than the client's request timeout (120 s),
#: so a process that waits for it cannot exit before STALLED_EXIT_TIMEOUT_S.
STALL_S = 600.0
STALLED_EXIT_TIMEOUT_S = 60.0


@pytest.mark.parametrize("recursive", [False, True], ids=["object", "prefix"])
def test_ctrl_c_stops_cp_without_waiting_for_a_stalled_part(
    moto_server: S3Server, tmp_path: Path, recursive: bool
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("sigint-stall"))
    data = os.urandom((PARTS - 1) * PART + MiB)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_bytes(b"small, sent in one request")
    (tree / "big.bin").write_bytes(data)
    state = tmp_path / "state"
    if recursive:
        command = _cp(tree, f"s3://{bucket}/copy", state, "-r")
    else:
        command = _cp(tree / "big.bin", f"s3://{bucket}/copy/big.bin", state)
    held = _PartsAfter(LET_THROUGH)
    proxy = FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=STALL_S, match=held
    )
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with proxy, out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            command, env=_env(moto_server, proxy.url), text=True, stdout=stdout, stderr=stderr
        )
        try:
            deadline = time.monotonic() + PROGRESS_TIMEOUT_S
            while not (held.seen > LET_THROUGH and len(_parts(state)) >= LET_THROUGH):
                assert proc.poll() is None, f"it ended before the interrupt: {err.read_text()}"
                assert time.monotonic() < deadline, "no upload progress"
                time.sleep(0.05)  # polling for the progress above, not waiting for a time
            proc.send_signal(signal.SIGINT)
            # Fails (TimeoutExpired) if the process still waits for the stalled part.
            code = proc.wait(timeout=STALLED_EXIT_TIMEOUT_S)
            assert proxy.stall_ends == []  # no stalled request had been answered
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr_text = err.read_text()
    assert code == 130, (code, stderr_text)
    journal = _journal(state)
    assert journal is not None and len(journal["parts"]) == LET_THROUGH
    kept = f"{LET_THROUGH} of {PARTS} parts kept"
    if recursive:
        kept = f"1 of 2 objects copied, {kept} of s3://{bucket}/copy/big.bin"
    assert f"cloudckpt cp: interrupted: {kept}; run the same command to resume" in stderr_text
    client = moto_server.client()
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [journal["upload_id"]]  # kept for the rerun

    again = subprocess.run(
        [*command, "--json"], env=_env(moto_server, moto_server.endpoint_url), text=True,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert again.returncode == 0, (again.stdout, again.stderr)
    summary = json.loads(again.stdout)
    resumed = LET_THROUGH * PART
    assert summary["resumed_bytes"] == resumed
    if recursive:
        assert (summary["copied"], summary["skipped"]) == (1, 1)
    assert summary["moved_bytes"] == len(data) - resumed
    assert client.get_object(Bucket=bucket, Key="copy/big.bin")["Body"].read() == data


DOWNLOAD = textwrap.dedent(
    """
    import pathlib, sys, threading
    from faults import FaultyStore
    from cloudckpt.engine.copy import copy_object
    from cloudckpt.options import MiB, resolve_options
    from cloudckpt.store import open_url

    opts = resolve_options(read_chunk_size=MiB, read_concurrency=2, max_attempts=1)
    src, src_key = open_url(sys.argv[1], opts)
    dst, dst_key = open_url(sys.argv[2], opts)
    held = pathlib.Path(sys.argv[3])

    def stall(n):
        if n == 1:  # the first read: the network never answers it
            held.touch()
            threading.Event().wait()

    faulty = FaultyStore(src)
    faulty.faults["read_into"] = stall
    copy_object(faulty, src_key, dst, dst_key, opts)
    """
)


def test_ctrl_c_stops_a_download_without_waiting_for_a_stalled_read(tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)  # three chunks, two at a time
    (tmp_path / "src.bin").write_bytes(data)
    dst = tmp_path / "dst.bin"
    journal = tmp_path / "dst.bin.cloudckpt-partial.json"
    held = tmp_path / "held"
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([SRC, tests, env.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", DOWNLOAD, str(tmp_path / "src.bin"), str(dst), str(held)]

    def progressed() -> bool:  # one read hangs, and another chunk is on disk
        try:
            return held.exists() and bool(json.loads(journal.read_text())["done"])
        except (OSError, ValueError):
            return False

    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        while not progressed():
            assert proc.poll() is None, "it ended before the interrupt"
            assert time.monotonic() < deadline, "no download progress"
            time.sleep(0.05)  # polling for the progress above, not waiting for a time
        proc.send_signal(signal.SIGINT)
        # Fails (TimeoutExpired) if the process still waits for the read that never ends.
        code = proc.wait(timeout=STALLED_EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    assert code == -signal.SIGINT, (code, stderr)
    assert "KeyboardInterrupt" in stderr, stderr
    assert not dst.exists()  # nothing at the destination; the partial file stays

    opts = resolve_options(read_chunk_size=MiB, max_attempts=1)
    src_store, src_key = open_url(str(tmp_path / "src.bin"), opts)
    dst_store, dst_key = open_url(str(dst), opts)
    result = copy_object(src_store, src_key, dst_store, dst_key, opts)
    assert result.resumed_bytes >= MiB  # the chunks finished before Ctrl-C were kept
    assert dst.read_bytes() == data


SAVE = textwrap.dedent(
    """
    import sys, torch, cloudckpt
    state = {f"t{i}": torch.full((PART // 4,), float(i)) for i in range(PARTS)}
    cloudckpt.save(state, sys.argv[1], part_size=PART, write_concurrency=2)
    """
)


def test_ctrl_c_during_save_leaves_nothing_behind(moto_server: S3Server) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("sigint-save"))
    url = f"s3://{bucket}/run/ckpt.pt"
    client = moto_server.client()
    script = f"PART, PARTS = {PART}, {PARTS}\n{SAVE}"

    proxy, held = _holding_proxy(moto_server)
    with proxy:
        command = [sys.executable, "-c", script, url]
        done = _interrupt(command, _env(moto_server, proxy.url), lambda: held.seen > 2)

    # Python's own answer to an uncaught KeyboardInterrupt: it dies by SIGINT.
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
    assert "KeyboardInterrupt" in done.stderr, done.stderr
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_cp_deadline_stops_without_waiting_for_a_stalled_part(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """``cp --deadline``: the copy stops once it passes, the stalled part abandoned, and
    the parts stored stay for a rerun (exit code 1)."""
    bucket = moto_server.make_bucket(unique_bucket_name("cp-deadline"))
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom((PARTS - 1) * PART + MiB))
    state = tmp_path / "state"
    command = _cp(src, f"s3://{bucket}/big.bin", state, "--deadline", "10s")
    held = _PartsAfter(LET_THROUGH)
    proxy = FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=STALL_S, match=held
    )
    with proxy:
        # Fails (TimeoutExpired) if the copy waits for the part held for STALL_S.
        done = subprocess.run(
            command,
            env=_env(moto_server, proxy.url),
            text=True,
            capture_output=True,
            timeout=10 + STALLED_EXIT_TIMEOUT_S,
            check=False,
        )
        assert proxy.stall_ends == []  # no stalled request had been answered
    assert done.returncode == 1, done.stderr
    assert "cloudckpt cp: deadline passed: " in done.stderr
    assert "parts kept; run the same command to resume" in done.stderr
