"""The fast CRC-32 agrees with zlib's, including when continued across chunks."""

from __future__ import annotations

import os
import zlib

from cloudckpt.format.checksum import IMPLEMENTATION, crc32


def test_crc32_matches_zlib():
    data = os.urandom(1 << 20) + b"tail"
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[100:5000]) == zlib.crc32(data[100:5000])
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(b"") == 0


def test_the_development_environment_has_the_fast_implementation():
    assert IMPLEMENTATION == "isal"  # pyproject's test extra pulls cloudckpt[fast]
