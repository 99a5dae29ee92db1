"""format.tensors.scan_storages: one walk gives the payload size and the storages to borrow."""

from __future__ import annotations

import torch

from cloudckpt.format.torch.tensors import scan_storages


def test_shared_storages_count_once_and_small_or_meta_ones_are_not_borrowed():
    big = torch.zeros(4096, dtype=torch.float32)  # 16 KiB
    small = torch.zeros(16, dtype=torch.int64)  # 128 B
    state = {
        "big": big,
        "view": big[10:20],  # the same storage again
        "nested": [small, {"again": big.view(64, 64)}],
        "meta": torch.empty(1 << 20, device="meta"),
        "other": 3,
    }
    total, borrowed = scan_storages(state, min_bytes=1024)
    assert total == big.nbytes + small.nbytes
    assert list(borrowed) == [big.untyped_storage().data_ptr()]
    nbytes, storage = borrowed[big.untyped_storage().data_ptr()]
    assert nbytes == big.nbytes and storage.data_ptr() == big.data_ptr()


def test_an_empty_state_has_nothing():
    assert scan_storages({"step": 1, "name": "x"}, min_bytes=1) == (0, {})
