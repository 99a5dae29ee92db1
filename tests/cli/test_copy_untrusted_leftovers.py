"""``cp`` resumes only from leftovers it made itself (issue 29, item 7).

Whoever can write beside the destination (or in the state directory) can plant a
partial file or a journal: a symbolic link, a hard link, another source's journal or
malformed JSON. None of them may be written through or trusted; the copy starts over
and the destination ends as a regular file with the source's bytes. The stores are
real: the filesystem and moto.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.cli import main
from cloudckpt.engine.copy import PARTIAL_SUFFIX, DestinationIsSymlinkError, copy_object
from cloudckpt.errors import StorageError
from cloudckpt.options import MiB, TransferOptions, resolve_options
from cloudckpt.store import Store, open_url
from faults import FaultyStore
from servers import S3Server, unique_bucket_name


def fail_at(call: int) -> Callable[[int], BaseException | None]:
    return lambda n: StorageError(f"injected failure at request {n}") if n == call else None


@dataclass
class Interrupted:
    """A download stopped after chunks 0-2 of 6, its partial file and journal left behind."""

    src: Store
    src_key: str
    dst: Store
    dst_key: str
    opts: TransferOptions
    data: bytes
    dst_path: Path
    partial: Path
    journal: Path

    def resume(self, src: Store | None = None, src_key: str | None = None) -> int:
        """Run the same copy again; the bytes a previous run had copied."""
        result = copy_object(
            src or self.src, src_key or self.src_key, self.dst, self.dst_key, self.opts
        )
        return result.resumed_bytes

    def journal_body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.journal.read_bytes())
        return body


def interrupted_download(tmp_path: Path) -> Interrupted:
    opts = resolve_options(read_chunk_size=1 * MiB, read_concurrency=1, max_attempts=1)
    data = os.urandom(5 * MiB + 123)
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts)
    dst_path = tmp_path / "dst" / "dst.bin"
    dst, dst_key = open_url(str(dst_path), opts)
    faulty = FaultyStore(src)
    faulty.faults["read_into"] = fail_at(4)  # chunks 0-2 land, the 4th read fails
    with pytest.raises(StorageError, match="injected"):
        copy_object(faulty, src_key, dst, dst_key, opts)
    left = Interrupted(
        src,
        src_key,
        dst,
        dst_key,
        opts,
        data,
        dst_path,
        dst_path.with_name(dst_path.name + PARTIAL_SUFFIX),
        dst_path.with_name(dst_path.name + PARTIAL_SUFFIX + ".json"),
    )
    assert left.journal_body()["done"] == [0, 1, 2]  # a genuine run would resume 3 MiB
    return left


def assert_copied(left: Interrupted) -> None:
    """DST is a regular file with the source's bytes, and nothing else is left beside it."""
    st = os.lstat(left.dst_path)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert left.dst_path.read_bytes() == left.data
    assert sorted(p.name for p in left.dst_path.parent.iterdir()) == [left.dst_path.name]


def warned(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(
        r.levelno == logging.WARNING and "not resuming" in r.getMessage() and text in r.getMessage()
        for r in caplog.records
    )


# -- downloads: the partial file ---------------------------------------------------------


def test_symlinked_partial_is_never_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    left = interrupted_download(tmp_path)
    outside = tmp_path / "elsewhere" / "victim.bin"
    outside.parent.mkdir()
    precious = os.urandom(len(left.data))  # the size a partial would have
    outside.write_bytes(precious)
    # A planted link plus a journal that names the link's target: only O_NOFOLLOW stops it.
    body = left.journal_body()
    st = os.stat(outside)
    body["partial"] = {"dev": st.st_dev, "ino": st.st_ino}
    left.journal.write_text(json.dumps(body))
    left.partial.unlink()
    left.partial.symlink_to(outside)

    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert left.resume() == 0
    assert_copied(left)
    assert outside.read_bytes() == precious  # the link's target untouched, not removed
    assert warned(caplog, "symbolic link")


def test_hard_linked_partial_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    left = interrupted_download(tmp_path)
    other = tmp_path / "other-name.bin"
    os.link(left.partial, other)  # the partial's inode now has a second name
    before = other.read_bytes()

    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert left.resume() == 0
    assert_copied(left)
    assert other.read_bytes() == before  # writing the partial would have changed it
    assert os.stat(other).st_nlink == 1
    assert warned(caplog, "2 hard links")


def test_partial_replaced_by_another_file_is_not_trusted(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    # Same name, same size, same owner, but not the file the journal recorded (the
    # filesystem may or may not give it the freed inode number).
    left.partial.unlink()
    left.partial.write_bytes(b"\0" * len(left.data))
    assert left.resume() == 0
    assert_copied(left)


def test_a_reused_inode_number_does_not_make_a_planted_partial_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file made in the partial's place that gets its inode number (as ext4 and tmpfs
    often hand out a freed one): the recorded CRC-32s of the finished chunks refuse it."""
    left = interrupted_download(tmp_path)
    left.partial.unlink()
    left.partial.write_bytes(b"\0" * len(left.data))
    body = left.journal_body()
    st = os.stat(left.partial)
    body["partial"] = {"dev": st.st_dev, "ino": st.st_ino}  # as if the number were reused
    left.journal.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert left.resume() == 0
    assert_copied(left)
    assert warned(caplog, "not the bytes it recorded")


def test_truncated_partial_is_not_trusted(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    os.truncate(left.partial, 1 * MiB)  # chunks 1 and 2, recorded as done, are gone
    assert left.resume() == 0
    assert_copied(left)


def test_fifo_partial_does_not_hang_or_crash(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    left.partial.unlink()
    os.mkfifo(left.partial)
    assert left.resume() == 0
    assert_copied(left)


def test_a_directory_at_the_partial_name_is_refused_and_kept(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    left.partial.unlink()
    left.partial.mkdir()
    (left.partial / "keep.txt").write_text("mine")
    with pytest.raises(StorageError, match="untrusted leftover"):
        left.resume()
    assert (left.partial / "keep.txt").read_text() == "mine"
    assert not left.dst_path.exists()


# -- downloads: the journal --------------------------------------------------------------


def test_symlinked_journal_is_not_trusted(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    kept = tmp_path / "elsewhere.json"
    left.journal.rename(kept)
    left.journal.symlink_to(kept)
    before = kept.read_bytes()

    assert left.resume() == 0
    assert_copied(left)
    assert kept.read_bytes() == before  # the link went, its target stayed as it was


def test_journal_of_another_source_starts_over(tmp_path: Path) -> None:
    left = interrupted_download(tmp_path)
    # Same size and mtime, so the same size:etag:mtime identity: only the URL differs.
    other = tmp_path / "other-src.bin"
    other_data = os.urandom(len(left.data))
    other.write_bytes(other_data)
    st = os.stat(tmp_path / "src.bin")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    src2, key2 = open_url(str(other), left.opts)

    assert left.resume(src2, key2) == 0
    assert left.dst_path.read_bytes() == other_data


def _huge(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode() + b" " * (2 * MiB)  # valid JSON, far over the bound


def _nested(body: dict[str, Any]) -> bytes:
    depth = 20_000  # under the size bound, over the parser's recursion limit
    return b'{"done": ' + b"[" * depth + b"]" * depth + b"}"


def _with(**changes: Any) -> Callable[[dict[str, Any]], bytes]:
    def mutate(body: dict[str, Any]) -> bytes:
        body.update(changes)
        return json.dumps(body).encode()

    return mutate


def _partial_ino_as_text(body: dict[str, Any]) -> bytes:
    body["partial"]["ino"] = str(body["partial"]["ino"])
    return json.dumps(body).encode()


MALFORMED: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "not-json": lambda body: b"{not json",
    "not-an-object": lambda body: b"[0, 1, 2]",
    "binary": lambda body: os.urandom(4096),
    "huge": _huge,
    "deeply-nested": _nested,
    "done-as-strings": _with(done=["0", "1", "2"]),
    "done-out-of-range": _with(done=[0, 1, 2, 99]),
    "done-negative": _with(done=[-1, 0]),
    "done-booleans": _with(done=[True]),
    "done-a-string": _with(done="012"),
    "done-nan": lambda body: json.dumps(body).replace('"done": [0', '"done": [NaN, 0').encode(),
    "chunk-as-string": _with(chunk=str(1 * MiB)),
    "no-partial-record": _with(partial=None),
    "partial-ino-as-string": _partial_ino_as_text,
}


@pytest.mark.parametrize("mutate", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_journal_starts_over(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mutate: Callable[[dict[str, Any]], bytes],
) -> None:
    left = interrupted_download(tmp_path)
    left.journal.write_bytes(mutate(left.journal_body()))
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert left.resume() == 0
    assert_copied(left)
    assert warned(caplog, str(left.journal)) or warned(caplog, str(left.partial))


# -- downloads: the destination ----------------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_destination_symlink_is_refused(tmp_path: Path, dangling: bool) -> None:
    opts = resolve_options(read_chunk_size=1 * MiB, max_attempts=1)
    data = os.urandom(2 * MiB + 7)
    (tmp_path / "src.bin").write_bytes(data)
    outside = tmp_path / "elsewhere" / "victim.bin"
    outside.parent.mkdir()
    if not dangling:
        outside.write_bytes(b"precious")
    dst_dir = tmp_path / "dst"
    dst_dir.mkdir()
    link = dst_dir / "dst.bin"
    link.symlink_to(outside)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts)
    dst, dst_key = open_url(str(link), opts)

    with pytest.raises(DestinationIsSymlinkError, match="symbolic link"):
        copy_object(src, src_key, dst, dst_key, opts)
    assert link.is_symlink() and os.readlink(link) == str(outside)
    assert [p.name for p in dst_dir.iterdir()] == ["dst.bin"]  # no partial, no journal
    if dangling:
        assert not outside.exists()
    else:
        assert outside.read_bytes() == b"precious"

    code = main(["cp", str(tmp_path / "src.bin"), str(link)])
    assert code == 2  # a usage error: name the link's target, or remove the link
    assert link.is_symlink()
    assert dangling or outside.read_bytes() == b"precious"


# -- uploads: the journal in the state directory -----------------------------------------


def _upload_journal_symlink(journal: Path, tmp_path: Path) -> None:
    kept = tmp_path / "elsewhere.json"
    journal.rename(kept)
    journal.symlink_to(kept)


def _upload_journal_hard_link(journal: Path, tmp_path: Path) -> None:
    os.link(journal, tmp_path / "elsewhere.json")


def _rewrite(mutate: Callable[[dict[str, Any]], Any]) -> Callable[[Path, Path], None]:
    def plant(journal: Path, tmp_path: Path) -> None:
        body = json.loads(journal.read_bytes())
        new = mutate(body)
        journal.write_bytes(new if isinstance(new, bytes) else json.dumps(body).encode())

    return plant


UPLOAD_LEFTOVERS: dict[str, Callable[[Path, Path], None]] = {
    "symlink": _upload_journal_symlink,
    "hard-link": _upload_journal_hard_link,
    "part-not-a-pair": _rewrite(lambda b: b.update(parts={"1": "x"})),
    "part-number-not-decimal": _rewrite(lambda b: b["parts"].update(one=b["parts"]["1"])),
    "part-number-out-of-range": _rewrite(lambda b: b["parts"].update({"99": b["parts"]["1"]})),
    "part-size-as-string": _rewrite(lambda b: b["parts"].update({"1": [b["parts"]["1"][0], "5"]})),
    "other-destination": _rewrite(lambda b: b.update(destination="s3://elsewhere/key")),
    "huge": _rewrite(lambda b: json.dumps(b).encode() + b" " * (2 * MiB)),
    "deeply-nested": _rewrite(lambda b: b'{"parts": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"),
}


@pytest.mark.parametrize("plant", UPLOAD_LEFTOVERS.values(), ids=UPLOAD_LEFTOVERS.keys())
def test_upload_journal_untrusted_starts_a_new_upload(
    moto_server: S3Server,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    plant: Callable[[Path, Path], None],
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("cp-trust"))
    opts = resolve_options(
        part_size=5 * MiB,
        write_concurrency=1,
        max_attempts=1,
        storage_options=moto_server.storage_options(),
    )
    data = os.urandom(11 * MiB)  # 3 parts
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/src.bin", opts)
    state = tmp_path / "state"
    faulty = FaultyStore(dst)
    faulty.faults["upload_part"] = fail_at(2)  # part 1 stored, recorded in the journal
    with pytest.raises(StorageError, match="injected"):
        copy_object(src, src_key, faulty, dst_key, opts, state_dir=state)
    (journal,) = state.iterdir()
    assert list(json.loads(journal.read_bytes())["parts"]) == ["1"]
    plant(journal, tmp_path)
    outside = {p: p.read_bytes() for p in tmp_path.glob("elsewhere.json")}

    again = FaultyStore(dst)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        result = copy_object(src, src_key, again, dst_key, opts, state_dir=state)
    assert result.resumed_bytes == 0
    assert again.calls.get("create_multipart") == 1 and again.calls["upload_part"] == 3
    assert dst.get(dst_key) == data
    assert not list(state.iterdir())  # the journal (or the planted link) is gone
    for path, body in outside.items():
        assert path.read_bytes() == body  # a link's target is never touched
    assert warned(caplog, str(journal))
    for upload in list(dst.list_multipart("")):  # the first run's upload, left open
        dst.abort_multipart(upload)
