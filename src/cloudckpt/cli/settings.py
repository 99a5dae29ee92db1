"""The command line's transfer settings: flags over the profile a URL selects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..store import Settings as StoreSettings

__all__ = ["Settings"]


class Settings(StoreSettings):
    """The command line's transfer settings (its flags, as a call's arguments), checked
    once and resolved for each URL a command opens (``Settings.open``): the profile a
    URL selects applies beneath them, and S3 flags never reach a local path."""

    def __init__(self, overrides: Mapping[str, Any]) -> None:
        super().__init__(None, dict(overrides))
