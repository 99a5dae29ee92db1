"""Secrets out of everything cloudckpt shows: log records, reprs, error messages.

The rule (docs/configuration.md, "Secrets in output"): a *name* is secret when one of
its words (split at anything but letters and digits and at camelCase humps, case
ignored) is in :data:`SECRET_WORDS`, when ``key`` follows another word (``account_key``,
``aws_access_key_id``, ``AccountKey``; a bare ``key`` is an object key and stays), or
when it holds "connection string". Its value becomes ``***`` wherever it appears as
``name=value``, ``name: value``, ``'name': 'value'``, ``<Name>value</Name>`` or a URL
query parameter. ``Bearer`` and ``SharedKey`` tokens, PEM private keys and the password
of a URL's userinfo are masked too. Erring on the side of masking is deliberate: a
hidden continuation token costs less than a leaked key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "MASK",
    "SECRET_WORDS",
    "RedactingFilter",
    "dataclass_repr",
    "display_url",
    "is_secret_name",
    "mask_options",
    "redact_text",
]

MASK = "***"

#: Words that make a name secret wherever they appear in it.
SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "token",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "signature",
        "sig",
        "sas",
        "auth",
        "authorization",
        "cookie",
        "apikey",
    }
)

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# A name followed by ':' or '=' (a header, a query parameter, a kwarg, a dict entry).
_PAIR = re.compile(r"(?<![\w.-])([A-Za-z][\w.-]*)(['\"]?)([ \t]*[:=][ \t]*\n?[ \t]*)")
_XML = re.compile(r"<([A-Za-z][\w.-]*)>([^<]*)</\1>")
_SCHEME = re.compile(r"\b(Bearer|SharedKey|SharedKeyLite)([ \t]+)[^\s'\",]+", re.IGNORECASE)
_USERINFO = re.compile(r"(://[^/\s:@'\"]*):[^/\s@'\"]*@")
_PEM = re.compile(r"-----BEGIN ([A-Z ]*PRIVATE KEY)-----.*?-----END \1-----", re.DOTALL)
# Where an unquoted value ends: after 'name:' at the end of the line (a header) or
# before a dict's next quoted key or closing brace; after 'name=' at the next separator
# of a query, a list or a repr.
_TO_EOL = re.compile(r"[^\r\n}]*?(?=,\s*['\"]|[}\r\n]|$)")
_TO_SEP = re.compile(r"[^&;,\s'\"<>()\[\]{}]*")
_TO_SEMI = re.compile(r"[^;\s'\"]*")
_QUOTE = re.compile(r"b?(['\"])")
#: Connection-string parts whose value is itself a query string: masked up to the ';'.
_WHOLE = frozenset({"sharedaccesssignature"})


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORDS.findall(name)]


def is_secret_name(name: str) -> bool:
    """Whether values under ``name`` (an option, header, parameter or field) are masked."""
    words = _words(name)
    joined = "".join(words)
    return (
        any(w in SECRET_WORDS for w in words)
        or "key" in words[1:]
        or "connectionstring" in joined
        or "connstr" in joined
    )


def _mask_pairs(text: str) -> str:
    """Mask the value after each secret ``name=`` / ``name:`` / ``'name':`` in ``text``."""
    out: list[str] = []
    pos = 0
    while (m := _PAIR.search(text, pos)) is not None:
        end = m.end()
        out.append(text[pos:end])
        pos = end
        name = m.group(1)
        if not is_secret_name(name):
            continue
        quote = _QUOTE.match(text, end)
        if quote:  # 'value' or b'value': up to the closing quote
            close = text.find(quote.group(1), quote.end())
            out.append(quote.group(0) + MASK)
            pos = len(text) if close < 0 else close
            continue
        if ":" in m.group(3):
            value = _TO_EOL
        elif "connectionstring" in (joined := "".join(_words(name))) or joined in _WHOLE:
            value = _TO_SEMI
        else:
            value = _TO_SEP
        v = value.match(text, end)
        assert v is not None  # each pattern matches the empty string
        if v.end() > end:
            out.append(MASK)
            pos = v.end()
    out.append(text[pos:])
    return "".join(out)


def redact_text(text: str) -> str:
    """``text`` with every secret it shows replaced by ``***`` (see the module's rule)."""
    text = _PEM.sub(lambda m: f"-----BEGIN {m.group(1)}-----{MASK}-----END {m.group(1)}-----", text)
    text = _USERINFO.sub(rf"\1:{MASK}@", text)
    text = _SCHEME.sub(rf"\1\2{MASK}", text)
    text = _XML.sub(lambda m: f"<{m[1]}>{MASK}</{m[1]}>" if is_secret_name(m[1]) else m[0], text)
    return _mask_pairs(text)


def display_url(url: str) -> str:
    """``url`` as ``scheme://bucket/key`` for messages: no query, fragment or credentials.

    Plain paths come back unchanged (``?`` and ``#`` are ordinary characters in them).
    ``abfs://container@account...`` keeps its container, which is not a credential.
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and (":" in userinfo or parts.scheme.lower() not in ("abfs", "abfss")):
        netloc = host
    return f"{parts.scheme}://{netloc}{parts.path}"


def mask_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for display: every key kept, secret-named values (non-None) as ``***``,
    other strings redacted (a SAS in ``account_url``, a password in ``endpoint_url``)."""
    shown: dict[str, Any] = {}
    for key, value in options.items():
        if value is not None and is_secret_name(str(key)):
            shown[key] = MASK
        elif isinstance(value, Mapping):
            shown[key] = mask_options(value)
        elif isinstance(value, str):
            shown[key] = redact_text(value)
        else:
            shown[key] = value
    return shown


def dataclass_repr(obj: Any) -> str:
    """The dataclass repr of ``obj`` with :func:`mask_options` over its mappings and
    :func:`redact_text` over its strings; secret-named fields show ``***``."""
    assert is_dataclass(obj)
    shown = []
    for f in fields(obj):
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if value is not None and is_secret_name(f.name):
            text = repr(MASK)
        elif isinstance(value, Mapping):
            text = repr(mask_options(value))
        elif isinstance(value, str):
            text = repr(redact_text(value))
        else:
            text = redact_text(repr(value))
        shown.append(f"{f.name}={text}")
    return f"{type(obj).__name__}({', '.join(shown)})"


class RedactingFilter(logging.Filter):
    """Masks secrets in every record it sees: the message with its args merged in, the
    traceback and the stack. A record with nothing to mask is left as it is (args kept).

    On a handler it covers every logger whose records reach that handler (the SDKs'
    too); on a logger, only records made by that very logger."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # malformed: logging would print msg and args raw; show them masked
            record.msg, record.args = redact_text(f"{record.msg!r} % {record.args!r}"), None
        else:
            redacted = redact_text(message)
            if redacted != message:
                record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True
