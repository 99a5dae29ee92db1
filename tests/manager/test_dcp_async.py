"""``CheckpointManager.async_save`` of a DCP state dict on 2 real gloo ranks (forked).

Each rank trains on (all-reduces, mutates its tensors) while the save runs in the
background; the marker appears once every rank's data is durable, retention runs on
rank 0, and a rank whose write fails fails the step on every rank with nothing
committed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from cloudckpt.dcp import writer as writer_module
from cloudckpt.errors import DistributedSaveError
from cloudckpt.manager import CheckpointManager
from ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(rank: int, step: int) -> dict[str, Any]:
    return {
        "model": {
            "shared": torch.full((256, 64), float(step)),
            f"own{rank}": torch.arange(99.0) * step,
        },
        "step": step,
    }


def _empty(rank: int) -> dict[str, Any]:
    return {"model": {"shared": torch.zeros(256, 64), f"own{rank}": torch.zeros(99)}, "step": 0}


def _train_while_saving(rank: int, world: int, root: str, so: dict[str, Any]) -> None:
    m = CheckpointManager(root, keep_last=2, kind="dcp", storage_options=so)
    handles = []
    for step in (1, 2, 3):
        live = _state(rank, step)
        handles.append(m.async_save(step, live, metrics={"loss": 1.0 / step}))
        # Training goes on at once: the live tensors change, the default group is busy.
        live["model"]["shared"].add_(1000)
        for _ in range(5):
            t = torch.ones(4)
            dist.all_reduce(t)
            assert t.tolist() == [world] * 4
    infos = [h.result(timeout=120) for h in handles]
    assert [i.step for i in infos] == [1, 2, 3]
    assert infos[-1].metrics == {"loss": pytest.approx(1 / 3)}
    assert m.latest().step == 3
    assert [c.step for c in m.list()] == [2, 3]  # keep_last=2, applied by rank 0
    got = m.restore(state=_empty(rank))
    want = _state(rank, 3)  # what was live when step 3 was saved, not after
    assert torch.equal(got["model"]["shared"], want["model"]["shared"])
    assert torch.equal(got["model"][f"own{rank}"], want["model"][f"own{rank}"])
    assert got["step"] == 3


def _one_rank_fails(rank: int, world: int, root: str, so: dict[str, Any]) -> None:
    m = CheckpointManager(root, kind="dcp", storage_options=so)
    m.async_save(1, _state(rank, 1)).result(timeout=120)
    if rank == 1:
        real = writer_module.CloudStorageWriter.write_data

        def broken(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("injected: rank 1 cannot write")

        writer_module.CloudStorageWriter.write_data = broken  # type: ignore[method-assign]
    handle = m.async_save(2, _state(rank, 2))
    with pytest.raises(DistributedSaveError, match="rank 1: OSError: injected: rank 1 cannot"):
        handle.result(timeout=120)
    if rank == 1:
        writer_module.CloudStorageWriter.write_data = real  # type: ignore[method-assign]
    assert m.latest().step == 1  # nothing of step 2 committed
    assert [c.step for c in m.list()] == [1]


@pytest.mark.parametrize("where", ["file", "rclone"])
def test_async_dcp_saves_commit_while_training_goes_on(
    where: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    root, so = _root(where, request, tmp_path)
    run_ranks(_train_while_saving, 2, root, so, timeout=300)


def test_a_failing_rank_fails_the_step_on_every_rank(tmp_path: Any) -> None:
    run_ranks(_one_rank_fails, 2, (tmp_path / "run").as_uri(), {}, timeout=300)


def _root(where: str, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    if where == "file":
        return (tmp_path / "run").as_uri(), {}
    from servers import unique_bucket_name

    server = request.getfixturevalue("rclone_server")
    bucket = server.make_bucket(unique_bucket_name("mgr-dcp-async"))
    return f"s3://{bucket}/run", server.storage_options()
