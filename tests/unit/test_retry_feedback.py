"""Retries say what they do: a WARNING per retry with its cause and attempt number, a
short budget for refused connections naming the endpoint, and the command line shows
both on stderr; bucket errors never suggest that running the command again helps."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cloudckpt.cli.main import main
from cloudckpt.cli.output import StderrHandler
from cloudckpt.errors import RetriesExhaustedError, TransientError
from cloudckpt.store.retry import RetryPolicy, refused_endpoint, retry_cause

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _failing(errors: list[BaseException]) -> Callable[[], str]:
    """A request that raises each of ``errors`` in turn, then answers "ok"."""
    todo = list(errors)

    def attempt() -> str:
        if todo:
            raise todo.pop(0)
        return "ok"

    return attempt


def _refused(url: str = "http://127.0.0.1:9/b/k?X-Amz-Signature=abc") -> TransientError:
    """A transient error raised while handling a refused connection, as the S3 store's
    mapping leaves it (the original chained as its context)."""
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as inner:
            raise OSError(f'Could not connect to the endpoint URL: "{url}"') from inner
    except OSError:
        try:
            raise TransientError("put s3://b/k: EndpointConnectionError") from None
        except TransientError as exc:
            return exc


def _quick(**kw: object) -> RetryPolicy:
    return RetryPolicy(backoff_base=0.0, backoff_max=0.0, adaptive_rate=False, **kw)  # type: ignore[arg-type]


def test_each_retry_is_a_warning_with_its_cause_and_attempt_number(caplog):
    faults = [TransientError("put s3://b/k: 503 SlowDown"), TransientError("reset by peer")]
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert _quick(max_attempts=5).run(_failing(faults), "put s3://b/k") == "ok"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "retrying put s3://b/k in 0.0 s (attempt 2 of 5): put s3://b/k: 503 SlowDown",
        "retrying put s3://b/k in 0.0 s (attempt 3 of 5): reset by peer",
    ]


def test_retry_lines_carry_no_query_string_or_secret(caplog):
    fault = TransientError(
        "read https://acct.blob.core.windows.net/c/k?sv=2024&sig=SECRETSIG: timed out "
        "aws_secret_access_key=SECRETKEY"
    )
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        _quick(max_attempts=3).run(_failing([fault]), "read az://c/k?sas=SECRETSAS")
    text = caplog.text
    assert "retrying read az://c/k in" in text
    assert "https://acct.blob.core.windows.net/c/k: timed out" in text
    for secret in ("SECRETSIG", "SECRETKEY", "SECRETSAS", "sv=2024"):
        assert secret not in text


def test_a_refused_connection_gets_a_short_budget_and_names_the_endpoint(caplog):
    calls = []

    def attempt() -> str:
        calls.append(1)
        raise _refused()

    with (
        caplog.at_level(logging.WARNING, logger="cloudckpt"),
        pytest.raises(RetriesExhaustedError) as info,
    ):
        _quick(max_attempts=10).run(attempt, "put s3://b/k")
    assert len(calls) == 3  # connect_attempts, not max_attempts
    message = str(info.value)
    assert "cannot connect to http://127.0.0.1:9: connection refused" in message
    assert "X-Amz-Signature" not in message and "abc" not in message.split("refused")[-1]
    assert "(attempt 3 of 3): connection refused" in caplog.text


def test_the_connect_budget_bounds_the_time_spent_on_refused_connections(monkeypatch):
    calls = []

    def attempt() -> str:
        calls.append(1)
        raise _refused()

    # Every backoff its longest, 10 s: past the 5 s budget, so no wait starts.
    monkeypatch.setattr("cloudckpt.store.retry._JITTER.uniform", lambda low, high: high)
    policy = RetryPolicy(backoff_base=10.0, backoff_max=10.0, adaptive_rate=False)
    with pytest.raises(RetriesExhaustedError, match="cannot connect to"):
        policy.run(attempt, "head s3://b/k")
    assert len(calls) == 1


def test_other_transient_faults_keep_the_full_budget():
    calls = []

    def attempt() -> str:
        calls.append(1)
        raise TransientError("503")

    with pytest.raises(RetriesExhaustedError, match="after 6 attempts"):
        _quick(max_attempts=6).run(attempt, "get s3://b/k")
    assert len(calls) == 6


def test_refused_endpoint_and_cause_read_the_chain():
    assert refused_endpoint(_refused()) == "http://127.0.0.1:9"
    assert retry_cause(_refused()) == "connection refused"
    assert refused_endpoint(TransientError("503 SlowDown")) is None


def test_the_cli_handler_writes_to_the_stderr_of_the_moment():
    """rich's progress bar swaps sys.stderr for a proxy that prints above the bar: the
    handler must follow the swap, not keep the stream it was made with."""
    handler = StderrHandler(logging.WARNING)
    later = io.StringIO()
    with contextlib.redirect_stderr(later):
        handler.emit(logging.LogRecord("cloudckpt", logging.WARNING, "", 0, "retrying x", (), None))
    assert later.getvalue() == "retrying x\n"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_cli_shows_retries_and_fails_fast_on_a_refused_endpoint():
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    keys = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    done = _cli("ls", "--endpoint-url", endpoint, "s3://bucket/run1", env=keys)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    retries = [line for line in lines if line.startswith("cloudckpt ls: retrying head ")]
    assert len(retries) == 2, lines
    assert "(attempt 2 of 3): connection refused" in retries[0]
    assert "(attempt 3 of 3): connection refused" in retries[1]
    assert f"cannot connect to {endpoint}: connection refused" in lines[-1]
    assert "run the same command" not in done.stderr


def test_an_invalid_bucket_name_is_one_line_and_a_usage_error():
    done = _cli("ls", "s3://My_Bucket!/x", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "cloudckpt ls: invalid S3 bucket name 'My_Bucket!': bucket names are letters, digits, "
        "dots, hyphens and underscores (new ones: 3-63 lowercase letters, digits, dots, "
        "hyphens)"
    ]
    assert "regex" not in done.stderr


def test_a_missing_bucket_never_suggests_running_again(rclone_server, tmp_path, monkeypatch):
    src = tmp_path / "state.bin"
    src.write_bytes(b"x" * 1000)
    for key, value in rclone_server.env().items():
        monkeypatch.setenv(key, value)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["cp", str(src), "s3://no-such-bucket-here/run1/state.bin"])
    assert code == 3
    assert "bucket does not exist: s3://no-such-bucket-here" in err.getvalue()
    assert "run the same command" not in err.getvalue()


def test_a_copy_to_a_refused_endpoint_never_suggests_running_again(tmp_path):
    """Nothing was kept, so a rerun would start over: the message does not offer one."""
    src = tmp_path / "state.bin"
    src.write_bytes(b"x" * 1000)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    keys = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    done = _cli("cp", "--endpoint-url", endpoint, str(src), "s3://bucket/x.bin", env=keys)
    assert done.returncode == 1, done.stderr
    assert f"cannot connect to {endpoint}" in done.stderr
    assert "run the same command" not in done.stderr
