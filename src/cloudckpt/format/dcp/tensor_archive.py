"""One tensor's ``torch.save`` archive for a DCP item, and what the DCP writer records.

A DCP save of many small tensors spent most of its CPU in ``torch.save``: its zip writer
makes dozens of small writes per tensor, each through Python. :func:`tensor_archive`
gives the same archive as three buffers: the header (every byte before the storage's),
the tensor's storage as it lies in memory (so a large tensor is still sent from its own
memory), and the trailer. The archive itself is the torch archive builder's one-tensor
form (:func:`cloudckpt.format.torch.archive_writer.tensor_layout`: ``torch.save``'s
bytes, checked against it at first use, off with the fast paths off); this module adds
what a DCP writer records about it: where the storage record's bytes start, their
CRC-32, and the checksums a reader checks (:mod:`cloudckpt.format.dcp.checks`).

``None`` means the caller uses ``torch.save``: a tensor that is not a plain one of CPU
memory (a subclass, a quantized, sparse, nested, conjugate or negative-bit tensor, one
that requires grad), an archive of 4 GiB or more, or the builder off (see
:func:`archive_builder_on`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checksum import crc32
from ..torch.archive_writer import builder_on as archive_builder_on
from ..torch.archive_writer import tensor_layout
from ..torch.ziprecords import SingleStorage
from .checks import block_crcs, block_size_for
from .layout import WHOLE_LIMIT

__all__ = ["TensorArchive", "archive_builder_on", "tensor_archive"]


@dataclass(frozen=True)
class TensorArchive:
    """A tensor's archive as three buffers, and what a DCP writer records about it."""

    header: bytes  # records before the storage bytes, and the storage's local header
    storage: memoryview  # the storage's bytes (the caller's view of its memory)
    trailer: bytes  # the storage's data descriptor, later records, directory, end
    data_offset: int  # where the storage record's bytes start in the archive
    record_crc: int  # zip CRC-32 of the storage record
    #: CRC-32 of the whole archive when it is at most ``whole_limit`` bytes (read whole).
    crc: int | None = None
    #: For a larger archive (read by slice): the CRC-32 of each ``block_size`` bytes of
    #: the storage record, 4 bytes little-endian each.
    block_size: int = 0
    block_crcs: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.storage.nbytes + len(self.trailer)

    def tobytes(self) -> bytes:
        """The archive in one piece (a copy; tests and small archives)."""
        return b"".join((self.header, self.storage, self.trailer))


def _build(layout: SingleStorage, storage: memoryview, whole_limit: int) -> TensorArchive:
    """The archive of ``layout`` around ``storage``, with the checksums a reader checks."""
    nbytes = storage.nbytes
    record_crc = crc32(storage)
    trailer = layout.trailer(record_crc)
    total = len(layout.header) + nbytes + len(trailer)
    crc: int | None = None
    block_size, blocks = 0, b""
    if total <= whole_limit:  # read whole: one CRC-32 of the archive
        crc = crc32(trailer, crc32(storage, layout.header_crc))
    elif nbytes > whole_limit // 2:  # read by slice: the CRC-32 of each block
        block_size = block_size_for(nbytes)
        blocks = block_crcs(storage, block_size)
    return TensorArchive(
        header=layout.header,
        storage=storage,
        trailer=trailer,
        data_offset=len(layout.header),
        record_crc=record_crc,
        crc=crc,
        block_size=block_size,
        block_crcs=blocks,
    )


def tensor_archive(
    tensor: torch.Tensor, storage: memoryview, *, whole_limit: int = WHOLE_LIMIT
) -> TensorArchive | None:
    """``torch.save(tensor)``'s archive as buffers, or None where ``torch.save`` must
    write it (see the module's docstring).

    ``storage`` is a byte view of ``tensor.untyped_storage()``'s memory (the whole
    storage, as ``torch.save`` writes it); the archive's ``storage`` is that view, so the
    caller keeps the tensor alive and unchanged until the bytes are sent. torch's
    serialization options are not read here (they cost more than the rest of the
    call): the caller asks :func:`archive_builder_on` once for a batch of tensors.
    """
    layout = tensor_layout(tensor, storage.nbytes)
    if layout is None:
        return None
    if storage.nbytes != tensor.untyped_storage().nbytes():
        raise ValueError(f"a view of {storage.nbytes} bytes is not the tensor's storage")
    return _build(layout, storage, whole_limit)
