"""Endpoint URLs a store is pointed at (``endpoint_url``, ``AWS_ENDPOINT_URL``,
``account_url``): checked when the store opens, before any request.

An endpoint without its scheme (``127.0.0.1:9000``) is the usual slip; the SDKs answer
it with a long traceback (botocore) or a silent ``https://`` (Azure). It is refused
here as a :class:`~cloudckpt.errors.ConfigError` naming where the value came from and
the URL most likely meant.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ..errors import ConfigError

__all__ = ["check_endpoint", "suggest_endpoint"]


def _host_port(text: str) -> tuple[str, str]:
    """The host and port of ``host[:port][/path]`` (a user or password left out)."""
    netloc = text.split("/", 1)[0].rpartition("@")[2]
    if netloc.startswith("["):  # [::1]:9000
        host, _, rest = netloc[1:].partition("]")
        return host, rest.lstrip(":")
    host, _, port = netloc.partition(":")
    return host, port


def suggest_endpoint(text: str) -> str:
    """The URL a scheme-less endpoint most likely means: ``http://`` for a local server
    (an IP address, ``localhost``, or a port other than 443), else ``https://``."""
    host, port = _host_port(text)
    try:
        ipaddress.ip_address(host)
        plain = True
    except ValueError:
        plain = host == "localhost" or bool(port and port != "443")
    return f"{'http' if plain else 'https'}://{text.rpartition('@')[2]}"


def check_endpoint(value: object, where: str) -> str:
    """``value`` when it is an ``http://`` or ``https://`` URL with a host; otherwise a
    ConfigError naming ``where`` (``"AWS_ENDPOINT_URL"``, ``"the S3 endpoint_url
    (storage option, --endpoint-url)"``) and, for a value without a scheme, the URL
    meant."""
    text = str(value).strip()
    if "://" not in text:
        shown = text.rpartition("@")[2]  # never echo a user or password
        raise ConfigError(
            f"{where} is {shown!r}, without a scheme: did you mean {suggest_endpoint(text)!r}?"
        )
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        raise ConfigError(f"{where} is {shown!r}, not an http:// or https:// URL with a host")
    return text
