"""Which environment variables each built-in store reads its settings from, and a
digest of them: a store made under another digest was made from other settings
(docs/configuration.md, "When settings are read")."""

from __future__ import annotations

import hashlib
import os

__all__ = ["ENVIRONMENT_PREFIXES", "environment"]


#: The environment variables each built-in store reads its settings from (names
#: starting with these): credentials, endpoint, region, profile, emulator host.
ENVIRONMENT_PREFIXES: dict[str, tuple[str, ...]] = {
    "s3": ("AWS_",),
    "gs": ("GOOGLE_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST"),
    "az": ("AZURE_",),
    "abfs": ("AZURE_",),
}


def environment(scheme: str) -> str | None:
    """A digest of the environment variables the store of ``scheme`` reads (None: it
    reads none, or none is set): a store made under another digest was made from other
    settings. A digest, so no secret is kept by it."""
    prefixes = ENVIRONMENT_PREFIXES.get(scheme)
    if not prefixes:
        return None
    found = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    if not found:
        return None
    return hashlib.sha256(repr(found).encode()).hexdigest()
