"""Storages handed to unpickling: a fixed size, in memory nothing a pickle reaches can
resize, free or move.

``torch.load`` builds its storages over the archive's records, and they cannot grow:
a ``Tensor.set_`` that asks for more raises "Trying to resize storage that is not
resizable". A storage from ``torch.UntypedStorage(n)`` can grow, and growing frees its
memory and allocates new memory elsewhere, while cloudckpt's reader threads may still be
writing a record into the old. So every CPU storage cloudckpt hands to an unpickler
(its own machine or torch's) is made here: over an anonymous mapping (``mmap``, pages
zero-filled by the kernel when first touched, as with ``malloc`` at these sizes), taken
by ``torch.frombuffer``, which holds the mapping's buffer until the storage is freed
(so the mapping can be neither closed nor resized) and makes the storage
non-resizable. The reader holds the storage itself until its read has ended.
docs/security.md, "Storage lifetime".
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["fixed_storage"]

#: One byte that lives as long as the process: empty storages are slices of it (torch
#: has no public way to make an empty storage that cannot grow).
_ONE = torch.frombuffer(mmap.mmap(-1, 1), dtype=torch.uint8).untyped_storage()


def fixed_storage(nbytes: int) -> torch.UntypedStorage:
    """A new CPU storage of ``nbytes`` (zero-filled) that cannot be resized."""
    if nbytes == 0:
        return _ONE[0:0]
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
