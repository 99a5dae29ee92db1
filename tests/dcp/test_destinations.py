"""``Destinations`` (dcp/destinations.py): the same tensors as the planner's own
``resolve_tensor``, without its per-item calls where the planner is torch's default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp.destinations import Destinations


def _planner(state: dict[str, Any], cls: type = DefaultLoadPlanner) -> DefaultLoadPlanner:
    planner = cls()
    planner.set_up_planner(state, None, True)
    return planner


def _item(
    fqn: str,
    lengths: tuple[int, ...],
    dest_offsets: tuple[int, ...] | None = None,
    dest_index_offset: tuple[int, ...] | None = None,
) -> ReadItem:
    """A read item of ``fqn`` as torch's planner makes them: ``lengths`` elements at
    ``dest_offsets`` of the destination (zeros: the whole tensor)."""
    zeros = torch.Size([0] * len(lengths))
    index_offset = zeros if dest_index_offset is None else torch.Size(dest_index_offset)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, index_offset),
        dest_offsets=torch.Size(dest_offsets) if dest_offsets is not None else zeros,
        storage_index=MetadataIndex(fqn, zeros),
        storage_offsets=zeros,
        lengths=torch.Size(lengths),
    )


def test_a_plain_tensor_is_resolved_to_itself_as_torch_does() -> None:
    w = torch.randn(3, 4)
    planner = _planner({"w": w})
    item = _item("w", (3, 4))
    got = Destinations(planner).resolve(item)
    assert got is w
    theirs = planner.resolve_tensor(item).detach()
    assert got.data_ptr() == theirs.data_ptr() and got.shape == theirs.shape


def test_a_parameter_that_requires_grad_is_detached() -> None:
    p = torch.nn.Parameter(torch.randn(5))
    got = Destinations(_planner({"p": p})).resolve(_item("p", (5,)))
    assert not got.requires_grad
    assert got.data_ptr() == p.data_ptr()


def test_a_slice_goes_through_the_planner() -> None:
    w = torch.randn(6, 4)
    planner = _planner({"w": w})
    item = _item("w", (3, 4), dest_offsets=(2, 0))
    got = Destinations(planner).resolve(item)
    assert got.shape == (3, 4) and got.data_ptr() == w[2:5].data_ptr()


def test_unknown_keys_and_offsets_fail_as_in_torch() -> None:
    planner = _planner({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="Could not find FQN"):
        Destinations(planner).resolve(_item("nope", (2,)))
    shifted = _item("w", (2,), dest_index_offset=(1,))
    with pytest.raises(ValueError, match="can't find by offset"):
        Destinations(planner).resolve(shifted)


class _Scratch(DefaultLoadPlanner):
    """A planner that hands out its own buffers and copies on commit."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.scratch = torch.empty(tuple(read_item.lengths))
        return self.scratch

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.state_dict[read_item.dest_index.fqn].copy_(tensor)


def test_a_planner_with_its_own_methods_is_called() -> None:
    w = torch.zeros(4)
    planner = _planner({"w": w}, _Scratch)
    dest = Destinations(planner)
    item = _item("w", (4,))
    got = dest.resolve(item)
    assert got.data_ptr() == planner.scratch.data_ptr()
    got.fill_(3.0)
    dest.commit(item, got)
    assert torch.equal(w, torch.full((4,), 3.0))


def test_a_load_through_a_planner_that_copies_on_commit(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(8) for i in range(20)}
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=CloudStorageWriter(url))
    out = {k: torch.zeros(8) for k in state}
    dcp.load(out, storage_reader=CloudStorageReader(url), planner=_Scratch())
    assert all(torch.equal(out[k], v) for k, v in state.items())
