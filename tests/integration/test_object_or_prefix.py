"""Object or prefix: a URL ending in '/' is refused where one object is meant, a prefix
given to ``load`` says what it holds, and an object where a prefix is meant says so.

Run on the filesystem store and on moto (an S3 bucket), each test in a fresh place.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import cloudckpt
from cloudckpt.errors import InvalidURLError, NotAnObjectError, NotAPrefixError, NotFoundError
from cloudckpt.options import resolve_options
from cloudckpt.store import Store, open_url
from cloudckpt.store.paths import check_prefix
from conftest import make_target
from servers import StoreTarget


@pytest.fixture(params=["file", "moto"])
def target(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreTarget]:
    yield from make_target(request, request.param, tmp_path)


def _opts(target: StoreTarget) -> dict:
    return {"storage_options": target.storage_options}


def _store(target: StoreTarget) -> tuple[Store, str]:
    store, key = open_url(target.base_url, resolve_options(**_opts(target)))
    return store, key.strip("/")


def _keys(target: StoreTarget) -> list[str]:
    """Every object under the test's place, relative to it."""
    store, base = _store(target)
    prefix = f"{base}/" if base else ""
    return sorted(o.key[len(prefix) :] for o in store.list(prefix))


def test_object_verbs_refuse_a_url_ending_in_a_slash(target: StoreTarget) -> None:
    state = {"w": torch.arange(4.0)}
    url = f"{target.base_url}/e/"
    expected = f"ends in '/': name the object, e.g. {target.base_url}/e/model.pt"
    with pytest.raises(InvalidURLError) as saved:
        cloudckpt.save(state, url, **_opts(target))
    assert expected in str(saved.value)
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.async_save(state, url, **_opts(target))
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.load(url, **_opts(target))
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.save_safetensors(state, f"{target.base_url}/m.safetensors/", **_opts(target))
    with pytest.raises(InvalidURLError, match="ends in '/'"):
        cloudckpt.load_safetensors(f"{target.base_url}/m.safetensors/", **_opts(target))
    assert _keys(target) == []  # nothing written: no object "e/", no file "e"


def test_prefix_verbs_take_a_url_ending_in_a_slash(target: StoreTarget) -> None:
    state = {"w": torch.arange(4.0)}
    folder = f"{target.base_url}/hf/"
    written = cloudckpt.save_safetensors(state, folder, **_opts(target))
    assert written.url.endswith("/hf/model.safetensors")
    assert torch.equal(cloudckpt.load_safetensors(folder, **_opts(target))["w"], state["w"])
    manager = cloudckpt.CheckpointManager(f"{target.base_url}/run/", **_opts(target))
    manager.save(1, state)
    latest = manager.latest()
    assert latest is not None and latest.step == 1


def test_loading_a_prefix_says_what_it_holds(target: StoreTarget) -> None:
    state = {"w": torch.arange(4.0)}
    cloudckpt.save(state, f"{target.base_url}/run/a.pt", **_opts(target))
    cloudckpt.save(state, f"{target.base_url}/run/sub/b.pt", **_opts(target))
    url = f"{target.base_url}/run"
    with pytest.raises(NotAnObjectError) as info:
        cloudckpt.load(url, **_opts(target))
    message = str(info.value)
    kind = "directory" if target.name == "file" else "prefix"
    assert f"{url} is a {kind} with 2 objects under it, not an object" in message
    assert "CloudStorageReader" in message and "CheckpointManager" in message
    assert not isinstance(info.value, FileNotFoundError)
    cloudckpt.save(state, f"{target.base_url}/st/model.safetensors/a.pt", **_opts(target))
    with pytest.raises(NotAnObjectError, match=f"{kind} with 1 object under it, not an object"):
        cloudckpt.load_safetensors(f"{target.base_url}/st/model.safetensors", **_opts(target))


def test_loading_nothing_is_not_found(target: StoreTarget) -> None:
    with pytest.raises(NotFoundError) as info:
        cloudckpt.load(f"{target.base_url}/nothing.pt", **_opts(target))
    assert not isinstance(info.value, NotAnObjectError)
    assert "not an object" not in str(info.value)


def test_check_prefix_refuses_only_an_object(target: StoreTarget) -> None:
    cloudckpt.save({"w": torch.zeros(2)}, f"{target.base_url}/x.pt", **_opts(target))
    store, base = _store(target)
    key = f"{base}/x.pt" if base else "x.pt"
    with pytest.raises(NotAPrefixError) as info:
        check_prefix(store, key, "a CheckpointManager root")
    assert f"{store.url(key)} is an object, not a prefix" in str(info.value)
    assert "a CheckpointManager root" in str(info.value)
    assert isinstance(info.value, NotADirectoryError)
    check_prefix(store, f"{base}/missing" if base else "missing", "a DCP checkpoint")


def test_a_manager_root_that_is_an_object_says_so(target: StoreTarget) -> None:
    url = f"{target.base_url}/x.pt"
    cloudckpt.save({"w": torch.zeros(2)}, url, **_opts(target))
    with pytest.raises(NotAPrefixError, match="is an object, not a prefix"):
        cloudckpt.CheckpointManager(url, **_opts(target)).latest()


def test_a_dcp_checkpoint_that_is_an_object_says_so(target: StoreTarget) -> None:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import CloudStorageReader

    url = f"{target.base_url}/x.pt"
    cloudckpt.save({"w": torch.zeros(2)}, url, **_opts(target))
    # torch's dcp.load raises a reader's error inside its CheckpointException (a
    # BaseException), message kept.
    with pytest.raises(BaseException, match="is an object, not a prefix"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=CloudStorageReader(url, **_opts(target)))


def test_a_local_path_through_a_file(tmp_path) -> None:
    """An object store takes ``x.pt/inner.pt`` beside an object ``x.pt``; a filesystem
    cannot: reading it is NotFoundError (no object there), writing it NotAPrefixError."""
    cloudckpt.save({"w": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(NotFoundError, match=r"x\.pt/inner\.pt"):
        cloudckpt.load(tmp_path / "x.pt" / "inner.pt")
    with pytest.raises(NotAPrefixError, match="a part of its path is a file"):
        cloudckpt.save({"w": torch.zeros(2)}, tmp_path / "x.pt" / "inner.pt")
    with pytest.raises(NotAPrefixError, match="a part of its path is a file"):
        cloudckpt.save({"w": torch.zeros(2)}, tmp_path / "x.pt" / "deeper" / "inner.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt"]
