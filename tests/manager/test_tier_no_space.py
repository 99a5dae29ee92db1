"""A filesystem that runs out of space during a write (docs/errors.md, docs/tiers.md).

The room check of a local tier refuses a save it sees will not fit; a write that runs
out of space anyway (another program filled the disk, or a state larger than its
tensors) is refused by the kernel midway. The fault is injected where the kernel
reports it on delayed-allocation filesystems, at the payload's ``fsync``: the write is
``NoSpaceError`` naming the file, in a local tier ``LocalTierFullError`` naming the steps
that wait for the bucket; no temp file is left and nothing is committed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.errors import LocalTierFullError, NoSpaceError
from cloudckpt.manager import CheckpointManager
from servers import free_port


@pytest.fixture
def full_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of files whose ``fsync`` fails with ENOSPC (append a name to arm it)."""
    names: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if any(n in path for n in names):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield names


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_save_that_runs_out_of_space_is_no_space_error_naming_the_file(
    tmp_path: Path, full_at: list[str]
) -> None:
    full_at.append("model.pt")
    with pytest.raises(NoSpaceError, match=r"no space left for file://.*model\.pt"):
        cloudckpt.save({"w": torch.ones(1000)}, tmp_path / "model.pt")
    assert files_under(tmp_path) == []  # the temp file went with the failure


def test_a_tier_that_runs_out_of_space_midway_names_the_waiting_steps(
    tmp_path: Path, full_at: list[str]
) -> None:
    """The bucket is away (connections refused): steps 1 and 2 wait in the tier. Step 3's
    write runs out of space: LocalTierFullError names them; nothing of step 3 is left;
    with room again, step 3 saves."""
    tier = tmp_path / "tier"
    away = {
        "endpoint_url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "region_name": "us-east-1",
        "aws_access_key_id": "k",
        "aws_secret_access_key": "s",
    }
    m = CheckpointManager("s3://bucket/run", local_dir=tier, storage_options=away, max_attempts=1)
    for step in (1, 2):
        m.save(step, {"w": torch.full((1000,), float(step))})
    before = files_under(tier)
    full_at.append("step-000000003")
    with pytest.raises(LocalTierFullError, match=r"no space left for .*step-000000003") as full:
        m.save(3, {"w": torch.full((1000,), 3.0)})
    assert "wait for the bucket" in str(full.value) and "[1, 2]" in str(full.value)
    assert files_under(tier) == before  # no temp file, no marker of step 3
    full_at.clear()
    m.save(3, {"w": torch.full((1000,), 3.0)})
    assert (tier / "step-000000003" / "_CHECKPOINT.json").is_file()


def test_an_async_save_that_runs_out_of_space_fails_its_handle_the_same_way(
    tmp_path: Path, full_at: list[str]
) -> None:
    tier = tmp_path / "tier"
    m = CheckpointManager(tmp_path / "bucket", local_dir=tier, drain_every_n_steps=10)
    m.save(1, {"w": torch.ones(1000)})
    full_at.append("step-000000002")
    handle = m.async_save(2, {"w": torch.zeros(1000)})
    with pytest.raises(LocalTierFullError, match=r"no space left for .*step-000000002"):
        handle.result()
    assert [c.step for c in m.list()] == [1]
    assert "step-000000002" not in "".join(files_under(tier))
