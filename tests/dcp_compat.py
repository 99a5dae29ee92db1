"""DCP keyword arguments that differ across the torch releases the suite runs on."""

from __future__ import annotations

import inspect

import torch.distributed.checkpoint as dcp

#: Run dcp.save/load in this process alone: ``no_dist=True`` where they take it; older
#: releases (torch 2.4) have no such argument and run single-process whenever no
#: process group exists.
SINGLE: dict[str, bool] = (
    {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
)
