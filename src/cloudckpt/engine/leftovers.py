"""What a crash leaves in a local tier: the temp files of writers killed mid-file,
swept the same way by every tier (the manager's, NeMo's and Lightning's) at each save
and retention (docs/tiers.md, "Leftovers of a crash").
"""

from __future__ import annotations

import logging

from ..store.local import LocalStore

__all__ = ["sweep_leftovers"]

log = logging.getLogger("cloudckpt")


def sweep_leftovers(store: LocalStore) -> list[str]:
    """Remove the temp files of writers that are gone from the local tier ``store`` (a
    save, peer copy or download killed mid-file: store/local.py ``sweep_temps``); never
    a live writer's, whose lock is held. Returns their URLs; a failure is logged, never
    raised (the next sweep tries again)."""
    try:
        removed = store.sweep_temps("")
    except Exception as exc:
        log.warning("sweeping crash leftovers in the local tier %s failed: %s", store.root_url, exc)
        return []
    if removed:
        log.info(
            "removed %d temp file(s) crashed writers left in the local tier %s: %s",
            len(removed),
            store.root_url,
            ", ".join(removed),
        )
    return removed
