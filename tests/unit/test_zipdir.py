"""Zip directory parsing from an object's tail, including zip64 records."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.format.torch.zipdir import NeedMoreBytes, check_local_header, parse_directory


def _torch_archive() -> bytes:
    buf = io.BytesIO()
    torch.save({"a": torch.arange(10), "b": torch.randn(3, 3)}, buf)
    return buf.getvalue()


def test_torch_archive_records_are_located_exactly():
    data = _torch_archive()
    directory = parse_directory(data, 0, len(data), "mem://x")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            entry = directory.entries[info.filename]
            assert data[entry.data_offset : entry.end] == zf.read(info.filename)
            check_local_header(data[entry.header_offset : entry.data_offset], entry, "mem://x")


def test_zip64_entries_are_parsed():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, payload in [("arch/data.pkl", b"p" * 100), ("arch/data/0", b"x" * 1000)]:
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(payload)
    data = buf.getvalue()
    directory = parse_directory(data, 0, len(data), "mem://z")
    entry = directory.entries["arch/data/0"]
    assert entry.size == 1000
    # Python's zipfile streams with data descriptors: the reader must read the header.
    assert entry.local_header_size in (-1, entry.local_header_size)


def test_short_tail_asks_for_more():
    data = _torch_archive()
    directory = parse_directory(data, 0, len(data), "mem://x")
    start = directory.cd_offset + 10
    with pytest.raises(NeedMoreBytes) as more:
        parse_directory(data[start:], start, len(data), "mem://x")
    assert more.value.start == directory.cd_offset


@pytest.mark.parametrize("cut", [1, 10, 100])
def test_damaged_tails_raise_corrupt_checkpoint(cut):
    data = _torch_archive()
    with pytest.raises((CorruptCheckpointError, NeedMoreBytes)):
        parse_directory(data[:-cut], 0, len(data) - cut, "mem://x")


def test_not_a_zip():
    with pytest.raises(CorruptCheckpointError, match="not a zip archive"):
        parse_directory(b"\x80\x02hello" * 10, 0, 70, "mem://y")


def test_a_stored_record_with_two_sizes_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("arch/data/0", b"x" * 100)
    data = bytearray(buf.getvalue())
    central = data.index(b"PK\x01\x02")
    data[central + 24 : central + 28] = (5000).to_bytes(4, "little")  # uncompressed size
    with pytest.raises(CorruptCheckpointError, match="stored uncompressed"):
        parse_directory(bytes(data), 0, len(data), "mem://sizes")


def test_a_directory_with_no_entries_is_parsed_empty():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w"):
        pass
    data = buf.getvalue()
    assert parse_directory(data, 0, len(data), "mem://empty").entries == {}
