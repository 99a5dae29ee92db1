"""Where a DCP load's tensors go: the planner's ``resolve_tensor`` and ``commit_tensor``,
without their per-item cost where the planner is torch's own.

``dcp.load`` of thousands of small tensors calls both once per read item. With
torch's ``DefaultLoadPlanner`` (and subclasses that keep its lookup), resolving an
item of a plain tensor is a dict lookup and two checks that return the tensor itself
(``find_state_dict_object``, ``narrow_tensor_by_index``), and committing does nothing.
:class:`Destinations` does exactly that lookup inline for a plain ``torch.Tensor`` or
``nn.Parameter`` asked for whole, and skips the empty commit; anything else (a DTensor,
a ShardedTensor, a slice, an unknown key, another planner) goes through the planner's
own methods, errors included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

__all__ = ["Destinations"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: subclasses go the long way
_LOOKUP = ("resolve_tensor", "lookup_tensor", "transform_tensor")


def _own(planner: LoadPlanner, names: tuple[str, ...]) -> bool:
    """Whether ``planner`` uses DefaultLoadPlanner's own ``names`` (none overridden)."""
    cls = type(planner)
    return isinstance(planner, DefaultLoadPlanner) and all(
        getattr(cls, n, None) is getattr(DefaultLoadPlanner, n) for n in names
    )


class Destinations:
    """``resolve`` and ``commit`` of one load's planner (see the module docstring)."""

    __slots__ = ("_commits", "_state", "planner")

    def __init__(self, planner: LoadPlanner) -> None:
        self.planner = planner
        state = getattr(planner, "state_dict", None) if _own(planner, _LOOKUP) else None
        self._state: dict[str, Any] | None = state if isinstance(state, dict) else None
        self._commits = not _own(planner, ("commit_tensor",))

    def resolve(self, item: ReadItem) -> torch.Tensor:
        """``planner.resolve_tensor(item)``, detached from autograd."""
        state = self._state
        if state is not None:
            index = item.dest_index
            tensor: Any = state.get(index.fqn)
            if type(tensor) in _PLAIN:
                offset = index.offset
                whole = offset is None or (len(offset) == tensor.dim() and not any(offset))
                if whole and item.lengths == tensor.shape:
                    return tensor.detach() if tensor.requires_grad else tensor
        return self.planner.resolve_tensor(item).detach()

    def commit(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """``planner.commit_tensor(item, tensor)``, where it does anything."""
        if self._commits:
            self.planner.commit_tensor(item, tensor)
