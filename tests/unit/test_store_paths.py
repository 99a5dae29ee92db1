"""The file-system verbs of store/paths.py on the in-memory, filesystem and S3 stores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cloudckpt.errors import BucketNotFoundError, NotAnObjectError, NotFoundError
from cloudckpt.options import resolve_options
from cloudckpt.store import Store, open_url
from cloudckpt.store.paths import (
    children,
    classify,
    dir_prefix,
    exists,
    head_object,
    is_prefix,
)
from conftest import make_target
from servers import StoreTarget

#: Objects laid out in every test's store: a file, a nested "directory", a sibling.
LAYOUT = {
    "run/a.bin": b"a" * 3,
    "run/sub/b.bin": b"b" * 5,
    "run/sub/deep/c.bin": b"c" * 7,
    "run-2/x.bin": b"x",  # shares "run" as a string prefix, not as a directory
}


@dataclass
class Tree:
    name: str
    store: Store
    base: str  # the test's own key prefix ("" on a bucket, the directory's on files)

    def key(self, relative: str) -> str:
        return f"{self.base}/{relative}" if self.base else relative


@pytest.fixture(params=["memory", "file", "moto"])
def target(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreTarget]:
    yield from make_target(request, request.param, tmp_path)


@pytest.fixture
def tree(target: StoreTarget) -> Tree:
    options = resolve_options(storage_options=target.storage_options)
    store, base = open_url(target.base_url, options)
    t = Tree(target.name, store, base.strip("/"))
    for relative, data in LAYOUT.items():
        store.put(t.key(relative), data)
    return t


def test_dir_prefix() -> None:
    assert dir_prefix("run") == "run/"
    assert dir_prefix("run/") == "run/"
    assert dir_prefix("") == ""
    assert dir_prefix("/") == ""


def test_classify_object_prefix_missing(tree: Tree) -> None:
    entry = classify(tree.store, tree.key("run/a.bin"))
    assert entry.kind == "object"
    assert entry.info is not None and entry.info.size == 3
    assert classify(tree.store, tree.key("run")) == ("prefix", None)
    assert classify(tree.store, tree.key("run/sub")).kind == "prefix"
    assert classify(tree.store, tree.key("run/")).kind == "prefix"
    assert classify(tree.store, tree.key("run/nothing")) == ("missing", None)
    assert classify(tree.store, tree.key("ru")).kind == "missing"  # a string prefix only


def test_exists_is_for_objects_only(tree: Tree) -> None:
    assert exists(tree.store, tree.key("run/sub/b.bin"))
    assert not exists(tree.store, tree.key("run/sub"))  # a prefix (a directory on files)
    assert not exists(tree.store, tree.key("run/missing.bin"))
    assert not exists(tree.store, "")  # the root is never an object


def test_is_prefix(tree: Tree) -> None:
    assert is_prefix(tree.store, tree.key("run"))
    assert is_prefix(tree.store, tree.key("run/sub/deep"))
    assert not is_prefix(tree.store, tree.key("run/a.bin"))
    assert not is_prefix(tree.store, tree.key("ru"))
    assert not is_prefix(tree.store, tree.key("nothing"))


def test_children_one_level(tree: Tree) -> None:
    dirs, files = children(tree.store, tree.key("run"))
    assert sorted(files) == ["a.bin"]
    assert files["a.bin"].size == 3
    assert sorted(dirs) == ["sub"]
    assert sorted(o.key for o in dirs["sub"]) == [
        tree.key("run/sub/b.bin"),
        tree.key("run/sub/deep/c.bin"),
    ]
    assert children(tree.store, tree.key("nothing")) == ({}, {})


def test_children_of_the_root(tree: Tree) -> None:
    if tree.base:  # on files the test's directory stands for the root
        pytest.skip("the filesystem store's root is the machine's")
    dirs, files = children(tree.store, "")
    assert sorted(dirs) == ["run", "run-2"] and files == {}


def test_head_object_names_a_prefix(tree: Tree) -> None:
    assert head_object(tree.store, tree.key("run/sub/deep/c.bin")).size == 7
    with pytest.raises(NotAnObjectError, match="run/sub"):
        head_object(tree.store, tree.key("run/sub"))
    with pytest.raises(NotFoundError) as caught:
        head_object(tree.store, tree.key("run/missing.bin"))
    assert not isinstance(caught.value, NotAnObjectError)


def test_an_object_and_a_prefix_of_one_name(tree: Tree) -> None:
    if tree.name == "file":
        pytest.skip("a file and a directory cannot share a name")
    tree.store.put(tree.key("run/sub"), b"both")
    entry = classify(tree.store, tree.key("run/sub"))
    assert entry.kind == "object" and entry.info is not None and entry.info.size == 4
    assert exists(tree.store, tree.key("run/sub"))
    assert is_prefix(tree.store, tree.key("run/sub"))
    dirs, files = children(tree.store, tree.key("run"))
    assert "sub" in dirs and "sub" in files


def test_a_missing_bucket_is_an_error_not_a_no(moto_server) -> None:
    options = resolve_options(storage_options=moto_server.storage_options(), max_attempts=1)
    store, _ = open_url("s3://no-such-bucket-paths/x", options)
    for verb in (exists, is_prefix, classify, children, head_object):
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-paths"):
            verb(store, "run/x.bin")
