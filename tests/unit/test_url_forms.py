"""URL forms: which strings and paths name which store and key, and which are refused
(with the URL most likely meant) before any I/O. docs/stores.md, "URLs"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.cli import main
from cloudckpt.errors import ConfigError, InvalidURLError
from cloudckpt.store import object_url, split_url
from cloudckpt.store.registry import closest_scheme, suggest_url

CWD = os.getcwd()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://my-bucket/typo.pt", ("s3", "my-bucket", "typo.pt")),
        ("S3://my-bucket/k", ("s3", "my-bucket", "k")),  # schemes are case-insensitive
        ("s3a://b/k", ("s3", "b", "k")),
        ("Gs://b/k", ("gs", "b", "k")),
        ("memory://b/e/", ("memory", "b", "e/")),
        ("file:///data/x.pt", ("file", "", "/data/x.pt")),
        ("/data/s3:x", ("file", "", "/data/s3:x")),  # absolute: a path as it is
        ("/data/s3:/b/k", ("file", "", "/data/s3:/b/k")),
        ("./s3:/b/k", ("file", "", f"{CWD}/s3:/b/k")),  # ./ says: a local path
        ("data/s3:x", ("file", "", f"{CWD}/data/s3:x")),  # only the first part counts
        ("model:v1.pt", ("file", "", f"{CWD}/model:v1.pt")),  # not a scheme, not word:/
        ("/data/x://y", ("file", "", "/data/x:/y")),  # a path, normalized as paths are
    ],
)
def test_accepted_forms(url: str, expected: tuple[str, str, str]) -> None:
    assert split_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [
        # A known scheme without its "//", as the whole URL or a relative path's first part.
        ("s3:/my-bucket/typo.pt", "did you mean 's3://my-bucket/typo.pt'?"),
        ("s3:my-bucket/typo.pt", "did you mean 's3://my-bucket/typo.pt'?"),
        ("S3:/b/k", "did you mean 's3://b/k'?"),
        ("s3:b", "did you mean 's3://b'?"),
        ("s3:", "expected s3://bucket/key"),
        ("s3a:/b/k", "did you mean 's3a://b/k'?"),
        ("gs:/b/k", "did you mean 'gs://b/k'?"),
        ("gcs:b/k", "did you mean 'gcs://b/k'?"),
        ("az:/c/k", "did you mean 'az://c/k'?"),
        ("azure:/c/k", "did you mean 'azure://c/k'?"),
        ("abfs:/c/k", "did you mean 'abfs://c/k'?"),
        ("memory:/b/k", "did you mean 'memory://b/k'?"),
        ("file:/tmp/x.pt", "did you mean 'file:///tmp/x.pt'?"),
        ("file:tmp/x.pt", "did you mean 'file:///tmp/x.pt'?"),
        ("profile:/prod/x.pt", "did you mean 'profile://prod/x.pt'?"),
        # An unknown scheme: the known ones listed, the closest one suggested.
        ("s4://b/k", "did you mean 's3://b/k'?"),
        ("s4:/b/k", "did you mean 's3://b/k'?"),
        ("gz://b/k", "did you mean 'gs://b/k'?"),
        ("memroy://b/k", "did you mean 'memory://b/k'?"),
        ("ftp://host/x", "supported: file://, s3://"),
        ("C:/x", "'C' is no known scheme"),  # no drive letters: Linux and macOS paths
        ("://b/k", "no scheme"),
        # Wrong slashes after a right scheme.
        ("s3:///b/k", "did you mean 's3://b/k'?"),
        ("file://tmp/x.pt", "did you mean 'file:///tmp/x.pt'?"),
        ("PROFILE://prod/x.pt", "did you mean 'profile://prod/x.pt'?"),
    ],
)
def test_refused_forms(url: str, message: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        split_url(url)
    assert isinstance(info.value, ConfigError)
    assert message in str(info.value), str(info.value)


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(InvalidURLError) as info:
        split_url("s4:/b/k")
    for scheme in ("file://", "s3://", "gs://", "az://", "memory://"):
        assert scheme in str(info.value)
    with pytest.raises(InvalidURLError) as far:
        split_url("http://host/x")
    assert "did you mean" not in str(far.value)


def test_a_typo_says_how_to_write_such_a_local_path() -> None:
    with pytest.raises(InvalidURLError, match=r"is written \./s3:/b/k"):
        split_url("s3:/b/k")
    assert split_url("./s3:/b/k")[0] == "file"


def test_a_pathlib_url_is_the_same_typo() -> None:
    """``Path("s3://b/k")`` is ``s3:/b/k``: refused, saying why the slash went."""
    with pytest.raises(InvalidURLError) as info:
        split_url(Path("s3://b/k"))
    assert "did you mean 's3://b/k'?" in str(info.value)
    assert "pathlib" in str(info.value)
    assert split_url(Path("/data/s3:/b/k")) == ("file", "", "/data/s3:/b/k")


def test_messages_never_echo_credentials_or_queries() -> None:
    for url in ("s3:/user:SECRETMARK@b/k", "s3:/b/k?X-Amz-Signature=SECRETMARK"):
        with pytest.raises(InvalidURLError) as info:
            split_url(url)
        assert "SECRETMARK" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("word", "closest"),
    [("s4", "s3"), ("S4", "s3"), ("gz", "gs"), ("memroy", "memory"), ("fille", "file")],
)
def test_closest_scheme(word: str, closest: str) -> None:
    assert closest_scheme(word) == closest


@pytest.mark.parametrize("word", ["s3", "http", "ftp", "x"])
def test_no_closest_scheme_for_known_or_distant_words(word: str) -> None:
    assert closest_scheme(word) is None


def test_suggested_file_urls_have_an_empty_host() -> None:
    assert suggest_url("file", "/tmp/x") == "file:///tmp/x"
    assert suggest_url("s3", "//b/k") == "s3://b/k"


@pytest.mark.parametrize(
    ("url", "example"),
    [
        ("s3://b/e/", "s3://b/e/ ends in '/': name the object, e.g. s3://b/e/model.pt"),
        ("memory://b/", "memory://b/ ends in '/': name the object, e.g. memory://b/model.pt"),
        ("memory://b/x.pt/", "e.g. memory://b/x.pt"),
        ("./newdir/", "./newdir/ ends in '/': name the object, e.g. ./newdir/model.pt"),
        ("file:///tmp/newdir/", "e.g. file:///tmp/newdir/model.pt"),
        ("memory://b", "memory://b names a bucket, not an object"),
    ],
)
def test_an_object_url_names_an_object(url: str, example: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        object_url(url)
    assert example in str(info.value), str(info.value)


def test_an_object_url_is_returned_as_given() -> None:
    for url in ("s3://b/e/model.pt", "./x.pt", Path("newdir/"), "profile://prod", "file:///x"):
        assert object_url(url) is url


def test_refused_before_any_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No directory made, no request sent: the endpoint below has no server, so any
    request would fail otherwise than with InvalidURLError."""
    monkeypatch.chdir(tmp_path)
    nowhere = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}
    state = {"w": torch.zeros(2)}
    with pytest.raises(InvalidURLError, match=r"did you mean 's3://my-bucket/typo\.pt'"):
        cloudckpt.save(state, "s3:/my-bucket/typo.pt", storage_options=nowhere)
    with pytest.raises(InvalidURLError, match="did you mean"):
        cloudckpt.async_save(state, "s3:my-bucket/typo.pt", storage_options=nowhere)
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.save(state, "s3://my-bucket/e/", storage_options=nowhere, max_attempts=1)
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.async_save(state, "s3://my-bucket/e/", storage_options=nowhere)
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.load("s3://my-bucket/e/", storage_options=nowhere, max_attempts=1)
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.save_safetensors(state, "s3://my-bucket/model.safetensors/")
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.load_safetensors("./model.safetensors/")
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.save(state, "./newdir/")
    with pytest.raises(InvalidURLError, match="did you mean"):
        cloudckpt.CheckpointManager("s3:/my-bucket/run1", storage_options=nowhere)
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_shows_the_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["ls", "s3:/my-bucket/run1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "did you mean 's3://my-bucket/run1'?" in err
    assert "nothing at" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "meant"),
    [
        ("s3//bucket/x", "s3://bucket/x"),
        ("S3//bucket/x.pt", "s3://bucket/x.pt"),
        ("gs//b/k", "gs://b/k"),
        ("az///c/k", "az://c/k"),
        ("file//tmp/x.pt", "file:///tmp/x.pt"),
    ],
)
def test_a_scheme_without_its_colon_says_what_was_meant(url: str, meant: str) -> None:
    """``s3//bucket/x`` gets the same "did you mean" as ``s3:/bucket/x`` (issue 41)."""
    with pytest.raises(InvalidURLError, match=f"did you mean '{meant}'") as info:
        split_url(url)
    assert "is written ./" in str(info.value)


@pytest.mark.parametrize("url", ["./s3//b/k", "data//x", "s3/b/k", "/s3//b/k"])
def test_paths_that_only_look_like_that_are_paths(url: str) -> None:
    assert split_url(url)[0] == "file"
