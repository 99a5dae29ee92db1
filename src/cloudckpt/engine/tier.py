"""What every local tier directory is, whatever its layout (docs/tiers.md).

A node-local directory holding one run's checkpoints for one bucket root: its
``LocalStore``, the run file ``_TIER.json`` that claims it for that root (create-only,
:func:`~cloudckpt.engine.drain.claim`: a directory another run claimed is not this
run's), the drain record of each checkpoint (engine/journal.py) and the sweep of the
temp files crashed writers left there (engine/leftovers.py).

Two layouts derive from it: the manager's, a folder per checkpoint committed by its
marker (``manager/tiers.py``, :class:`LocalTier`, NeMo's tier too), and Lightning's, a
file per checkpoint committed by its rename (``lightning/tier.py``, :class:`FileTier`).
It lives in the engine, below both: the Lightning layer does not import the manager.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from ..store.local import LocalStore
from .drain import claim
from .journal import DrainJournal
from .leftovers import sweep_leftovers

__all__ = ["TierDirectory"]


class TierDirectory:
    """The local directory ``path`` (made if missing; a file there is a ConfigError) of
    the bucket root ``remote_url``:
    ``store`` (its ``LocalStore``, rooted at ``url``), ``owner`` (the bucket root its
    run file names: the run file is created naming ``remote_url`` unless one is there
    already) and ``drain_journal`` (the drain record of each checkpoint, by name).

    A directory whose run file names another root is not ``owned``: each layout says so
    with a WARNING of its own and keeps off it.
    """

    def __init__(self, path: str | os.PathLike[str], remote_url: str) -> None:
        self.path = Path(path).expanduser()
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"local_dir {self.path} is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(self.path)
        self.url = self.store.root_url
        self.remote_url = remote_url
        self.owner = claim(self.store, remote_url)
        self.drain_journal = DrainJournal(self.store, remote_url)

    @property
    def owned(self) -> bool:
        """Whether the directory belongs to this run (its run file names our bucket root)."""
        return self.owner == self.remote_url

    def sweep(self) -> list[str]:
        """Remove the temp files of writers that are gone, never a live writer's
        (:func:`~cloudckpt.engine.leftovers.sweep_leftovers`). Returns their URLs."""
        return sweep_leftovers(self.store)
