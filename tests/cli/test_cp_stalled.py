"""``cloudckpt cp`` against an endpoint that stalls (F8).

A download whose source answers the headers, then stalls: the deadline passes before a
single chunk is on disk, the command says "nothing kept", so nothing may be left (no
``.cloudckpt-partial`` without its journal). A partial file left without a journal (by
an older version) is named once in the warning, with the command's prefix once.

An upload whose parts are never answered: the multipart upload it opened is kept for
the next run (docs/cli.md, "Ctrl-C and deadline": never aborted), so the command says
so and offers the rerun rather than "nothing kept".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cloudckpt.cli import main
from silent import SilentServer
from trickle import TrickleServer

#: Long enough for the first request (a client made, a HEAD answered) on a loaded
#: machine (the suite runs on several processes); the body never comes.
DEADLINE = "6s"


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[TrickleServer]:
    server = TrickleServer(size=100_000, bytes_per_second=0)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    yield server
    server.close()


def test_a_deadline_before_any_chunk_keeps_no_partial_file(
    stalled: TrickleServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["cp", "s3://bkt/run1/x.pt", "dlq.bin", "--deadline", DEADLINE])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "deadline passed: nothing kept" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_partial_without_its_journal_is_named_with_one_prefix(
    stalled: TrickleServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dlq.bin.cloudckpt-partial").write_bytes(bytes(100_000))
    code = main(["cp", "s3://bkt/run1/x.pt", "dlq.bin", "--deadline", DEADLINE])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "cloudckpt cp: not resuming from " in err
    assert "there is no journal" in err
    assert "cloudckpt cp: cloudckpt cp:" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stalled_upload_says_its_open_upload_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    server = SilentServer(answer_uploads=True)
    try:
        for name, value in {
            "AWS_ENDPOINT_URL": server.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
        }.items():
            monkeypatch.setenv(name, value)
        src = tmp_path / "big.bin"
        src.write_bytes(bytes(12 * 1024 * 1024))
        state = tmp_path / "state"
        argv = ["cp", str(src), "s3://b/big.bin", "--state-dir", str(state)]
        code = main([*argv, "--part-size", "5MiB", "--deadline", "3s"])
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 1, err
    assert "nothing kept" not in err
    assert "0 of 3 parts kept, its multipart upload left open" in err
    assert "run the same command to resume" in err
    assert len(list(state.glob("upload-*.json"))) == 1  # the journal naming the upload
