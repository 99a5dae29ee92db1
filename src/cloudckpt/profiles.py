"""Named configuration profiles from a TOML file, selected by URL.

The file is ``$CLOUDCKPT_CONFIG``, else ``$XDG_CONFIG_HOME/cloudckpt/config.toml``
(``~/.config/cloudckpt/config.toml``)::

    [profiles.minio]
    url = "s3://training"            # profile://minio/run1/x.pt -> s3://training/run1/x.pt
    match = ["s3://training/"]       # ...and URLs under these prefixes use it too
    part_size = "128MiB"
    write_concurrency = 16
    requests_per_second = 3500      # a static cap; adaptive_rate = true works under it

    [profiles.minio.storage_options]
    endpoint_url = "http://minio.internal:9000"
    profile_name = "minio"           # credentials from the shared AWS config

``storage_options`` takes any storage option of the URL's store, the object options
too (``sse``, ``storage_class``, ``tags = { team = "ml" }``...: docs/stores.md); the
store checks each when it opens.

Precedence: a call's own arguments win over the profile, the profile wins over
``cloudckpt.configure()`` and the environment. An unknown key, an unknown profile
name in ``profile://NAME/...``, or a malformed value is a ``ConfigError``, never
silently ignored.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, InvalidURLError
from .redact import dataclass_repr, display_url, redact_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10
    import tomli as tomllib

__all__ = ["Profile", "config_path", "find_profile", "load_profiles"]

SCHEME = "profile://"

#: Transfer options a profile may set, and how to read each.
_TRANSFER_KEYS = {
    "part_size": "size",
    "read_chunk_size": "size",
    "max_bytes_in_flight": "size",
    "write_concurrency": "int",
    "read_concurrency": "int",
    "max_attempts": "int",
    "requests_per_second": "float",
    "adaptive_rate": "bool",
    "backoff_base": "float",
    "backoff_max": "float",
    "connect_timeout": "float",
    "request_timeout": "float",
    "metadata_timeout": "float",
    "deadline": "float",
}
_KEYS = frozenset({"url", "match", "storage_options", *_TRANSFER_KEYS})
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


@dataclass(frozen=True)
class Profile:
    """One ``[profiles.NAME]`` table."""

    name: str
    url: str | None = None
    match: tuple[str, ...] = ()
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    transfer: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """The dataclass repr with secret storage options masked (cloudckpt.redact)."""
        return dataclass_repr(self)

    def rewrite(self, url: str) -> str:
        """``profile://NAME/rest`` -> the profile's ``url`` + ``/rest``; other URLs unchanged."""
        if not url.startswith(SCHEME):
            return url
        if self.url is None:
            raise ConfigError(
                f"profile {self.name!r} has no url, so {display_url(url)} names nothing"
            )
        rest = url[len(SCHEME) + len(self.name) :].lstrip("/")
        return f"{self.url.rstrip('/')}/{rest}" if rest else self.url


def config_path() -> Path:
    """Where the profiles file is looked for."""
    explicit = os.environ.get("CLOUDCKPT_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "cloudckpt" / "config.toml"


def _size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(m.group(1)) * _UNITS[m.group(2).lower()]
    raise ConfigError(f'{where} = {value!r} is not a size (e.g. 67108864 or "64MiB")')


def _parse(name: str, table: Any, path: Path) -> Profile:
    where = f"{path} [profiles.{name}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_KEYS))}"
        )
    transfer: dict[str, Any] = {}
    for key, kind in _TRANSFER_KEYS.items():
        if key not in table:
            continue
        value = table[key]
        if kind == "size":
            transfer[key] = _size(value, f"{where} {key}")
            continue
        if kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where} {key} = {value!r} is not true or false")
            transfer[key] = value
            continue
        try:
            transfer[key] = int(value) if kind == "int" else float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} {key} = {value!r} is not a number") from None
    match = table.get("match", ())
    match = (match,) if isinstance(match, str) else tuple(match)
    url = table.get("url")
    for prefix in (*match, *([url] if url else [])):
        if not isinstance(prefix, str) or "://" not in prefix or prefix.startswith(SCHEME):
            raise ConfigError(f"{where}: {redact_text(repr(prefix))} is not a store URL")
    options = table.get("storage_options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where} storage_options must be a table")
    return Profile(name, url, match, dict(options), transfer)


_cache: tuple[Path, float, dict[str, Profile]] | None = None
_lock = threading.Lock()


def load_profiles() -> dict[str, Profile]:
    """The profiles in the config file (re-read when it changes); {} when there is none."""
    global _cache
    path = config_path()
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        if os.environ.get("CLOUDCKPT_CONFIG"):
            raise ConfigError(f"CLOUDCKPT_CONFIG names {path}, which does not exist") from None
        return {}
    with _lock:
        if _cache is not None and _cache[0] == path and _cache[1] == mtime:
            return _cache[2]
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read the profiles file {path}: {exc}") from exc
        unknown = sorted(set(data) - {"profiles"})
        if unknown:
            raise ConfigError(f"{path}: unknown top-level key(s) {', '.join(unknown)}")
        profiles = {n: _parse(n, t, path) for n, t in data.get("profiles", {}).items()}
        _cache = (path, mtime, profiles)
        return profiles


def find_profile(url: str) -> Profile | None:
    """The profile ``url`` selects: ``profile://NAME/...``, else the longest matching prefix."""
    if not isinstance(url, str) or "://" not in url:
        return None
    profiles = load_profiles()
    if url.startswith(SCHEME):
        name = url[len(SCHEME) :].split("/", 1)[0]
        if name not in profiles:
            known = ", ".join(sorted(profiles)) or "none"
            raise InvalidURLError(
                f"{display_url(url)}: no profile named {name!r} (profiles: {known})"
            )
        return profiles[name]
    best: tuple[int, Profile] | None = None
    for profile in profiles.values():
        for prefix in profile.match:
            if url.startswith(prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), profile)
    return best[1] if best else None
