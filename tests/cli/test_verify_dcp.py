"""`cloudckpt verify` checks every tensor record inside DCP data objects too."""

from __future__ import annotations

import pytest
import torch

from cloudckpt.cli import main
from cloudckpt.manager import CheckpointManager


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_verify_finds_a_flipped_bit_in_a_dcp_data_object(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "run", kind="dcp")
    manager.save(1, {"w": torch.randn(2000), "b": torch.ones(10), "step": 1})
    assert main(["verify", str(tmp_path / "run")]) == 0
    data = next((tmp_path / "run").rglob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # inside the 8 KB tensor record
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "run")]) == 4
    assert "fails its CRC-32 check" in capsys.readouterr().out
