"""URL parsing for the cloud schemes (no server needed)."""

from __future__ import annotations

import pytest

from cloudckpt.errors import InvalidURLError
from cloudckpt.store import SUPPORTED_SCHEMES, split_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("gs://bucket/a/b.pt", ("gs", "bucket", "a/b.pt")),
        ("gcs://bucket/a", ("gs", "bucket", "a")),
        ("gs://bucket", ("gs", "bucket", "")),
        ("az://container/a/b.pt", ("az", "container", "a/b.pt")),
        ("azure://container/k", ("az", "container", "k")),
        ("abfs://container/k", ("az", "container", "k")),
        ("abfs://c@acct.dfs.core.windows.net/x/y", ("abfs", "c@acct", "x/y")),
        ("abfss://c@acct.dfs.core.windows.net/x", ("abfs", "c@acct", "x")),
        ("s3://b/k", ("s3", "b", "k")),
    ],
)
def test_split_url(url: str, expected: tuple[str, str, str]) -> None:
    assert split_url(url) == expected


@pytest.mark.parametrize("url", ["gs:///key", "az:///key", "gs://b/k?x=1", "az://c/k#frag"])
def test_malformed_cloud_urls(url: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        split_url(url)
    # Named without its query or fragment, which may hold a SAS (tests/unit/test_secrets.py).
    shown = url.replace("#", "?").partition("?")[0]
    assert shown in str(info.value) and (url == shown or url not in str(info.value))


def test_unknown_scheme_lists_the_cloud_schemes() -> None:
    with pytest.raises(InvalidURLError) as info:
        split_url("ftp://host/x")
    for scheme in ("gs://", "az://", "s3://"):
        assert scheme in str(info.value)
    assert {"gs", "az", "abfs"} <= set(SUPPORTED_SCHEMES)
