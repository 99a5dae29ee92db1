"""A manager's local tier drained to every store: the filesystem, moto, rclone, the GCS
emulator and Azurite (tests/manager/test_tiers.py covers the protocol on moto).

Each kind saves to the local tier, drains, restores from local, then, the local copy
removed, restores the same state from the bucket's copy: the bytes and the marker the
drain wrote there are the local ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import step_dir
from servers import StoreTarget


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "b": torch.full((8,), step)}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(4096), "b": torch.zeros(8, dtype=torch.long)}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("kind", ["object", "dcp"])
def test_a_tier_drains_to_the_store_and_restores_from_either_copy(
    store_url: StoreTarget, tmp_path: Path, kind: str
) -> None:
    if kind == "dcp":
        pytest.importorskip("cloudckpt.dcp")
    tier = tmp_path / "tier"
    root = f"{store_url.base_url}/run"

    def manager() -> CheckpointManager:
        return CheckpointManager(
            root, kind=kind, local_dir=tier, storage_options=store_url.storage_options
        )

    m = manager()
    m.save(1, _state(1), metrics={"loss": 1.0})
    m.save(2, _state(2), metrics={"loss": 0.5})
    m.drain()
    assert [(c.step, c.tiers) for c in m.list()] == [
        (1, ("local", "remote")),
        (2, ("local", "remote")),
    ]
    remote = m.info(2)
    assert remote.metrics == {"loss": 0.5} and remote.url.startswith(store_url.base_url)
    local_files = {
        p.relative_to(tier / step_dir(2)).as_posix(): p.read_bytes()
        for p in (tier / step_dir(2)).rglob("*")
        if p.is_file() and p.name != MARKER_NAME
    }
    assert {f.name for f in remote.files} == set(local_files)
    for name, data in local_files.items():  # the same bytes, read by the store's own client
        assert store_url.read_object(f"{root}/{step_dir(2)}/{name}") == data, name

    _same(_restore(manager(), kind), _state(2))
    shutil.rmtree(tier / step_dir(2))  # the node lost its copy: the bucket's is read
    fresh = manager()
    assert [(c.step, c.tiers) for c in fresh.list()][-1] == (2, ("remote",))
    _same(_restore(fresh, kind), _state(2))


def _restore(m: CheckpointManager, kind: str) -> dict[str, Any]:
    if kind == "object":
        return m.restore()  # type: ignore[no-any-return]
    target = _blank()
    m.restore(state=target)
    return target
