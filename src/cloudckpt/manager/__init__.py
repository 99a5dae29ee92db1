"""Find, resume, prune and clean up checkpoints: :class:`CheckpointManager` and its parts.

``marker`` (layout and the commit marker), ``retention`` (keep policies), ``gc``
(garbage collection; removing a checkpoint is ``engine/remove.py``), ``payload``
(single object or DCP directory), ``tiers`` (a local tier drained to the bucket),
``tiered`` (what a manager with a local tier does beside the bucket: drains, ranks),
``choose`` (the step a restore on several ranks loads, a pure function), ``peers``
(each local directory's copy on the next node).
"""

from __future__ import annotations

from .gc import GcReport, collect_garbage
from .manager import CheckpointManager, ManagedSaveHandle
from .marker import MARKER_NAME, CheckpointInfo, FileEntry, list_checkpoints, read_marker
from .payload import DcpPayload, ObjectPayload, PayloadKind
from .retention import KeepEveryNSteps, KeepLast, KeepTopK, RetentionPolicy

__all__ = [
    "MARKER_NAME",
    "CheckpointInfo",
    "CheckpointManager",
    "DcpPayload",
    "FileEntry",
    "GcReport",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepTopK",
    "ManagedSaveHandle",
    "ObjectPayload",
    "PayloadKind",
    "RetentionPolicy",
    "collect_garbage",
    "list_checkpoints",
    "read_marker",
]
