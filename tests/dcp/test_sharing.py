"""Equal shapes and tensor properties in DCP plans and metadata become one object each:
the pickles DCP sends between ranks and stores mean the same, in fewer bytes."""

from __future__ import annotations

import copy
import pickle

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)

from cloudckpt.format.dcp.sharing import share_in_load_plan, share_in_metadata, share_in_save_plan


def _state() -> dict[str, torch.Tensor]:
    state = {f"layer{i}.w": torch.randn(4, 8) for i in range(30)}
    state["half"] = torch.zeros(4, 8, dtype=torch.float16)
    state["grad"] = torch.zeros(4, 8, requires_grad=True)
    state["bias"] = torch.zeros(8)
    return state


def _save_plan() -> object:
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), None, True)
    return planner.create_local_plan()


def test_a_save_plan_pickles_the_same_items_in_fewer_bytes() -> None:
    plan = _save_plan()
    before = copy.deepcopy(plan)
    size = len(pickle.dumps(plan))
    assert share_in_save_plan(plan) is plan
    assert plan == before  # every item equal to what the planner made
    assert pickle.loads(pickle.dumps(plan)) == before
    assert len(pickle.dumps(plan)) < size * 0.8
    properties = {id(i.tensor_data.properties) for i in plan.items}
    sizes = {id(i.tensor_data.size) for i in plan.items}
    assert len(properties) == 3  # float32, float16, float32 with requires_grad: kept apart
    assert len(sizes) == 2  # (4, 8) and (8,)


def test_metadata_keeps_its_values() -> None:
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), None, True)
    _, metadata = planner.create_global_plan([planner.create_local_plan()])
    before = copy.deepcopy(metadata.state_dict_metadata)
    share_in_metadata(metadata)
    assert metadata.state_dict_metadata == before
    assert len({id(md.properties) for md in metadata.state_dict_metadata.values()}) == 3


def test_a_load_plan_pickles_the_same_items_in_fewer_bytes() -> None:
    state = _state()
    saver = DefaultSavePlanner()
    saver.set_up_planner(state, None, True)
    _, metadata = saver.create_global_plan([saver.create_local_plan()])
    loader = DefaultLoadPlanner()
    loader.set_up_planner({k: torch.empty_like(v) for k, v in state.items()}, metadata, True)
    plan = loader.create_local_plan()
    before = copy.deepcopy(plan)
    size = len(pickle.dumps(plan))
    assert share_in_load_plan(plan) is plan
    assert plan == before and pickle.loads(pickle.dumps(plan)) == before
    assert len(pickle.dumps(plan)) < size
    assert len({id(i.lengths) for i in plan.items}) == 2
