"""The command line's transfer settings: flags over the profile a URL selects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..options import resolve_options
from ..store import Target as Opened
from ..store import open_target, split_url

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """The command line's transfer settings, resolved for each URL a command opens (so
    the profile a URL selects applies beneath them)."""

    overrides: Mapping[str, Any]

    def __post_init__(self) -> None:
        resolve_options(None, **self.overrides)  # a bad flag fails before any request

    def open(self, url: str) -> Opened:
        """The store, key and options for ``url``; S3 flags never reach a local path."""
        overrides = dict(self.overrides)
        if overrides.get("storage_options") and split_url(url)[0] == "file":
            del overrides["storage_options"]
        return open_target(url, **overrides)
