"""A URL and its settings are resolved once per call: the profile is looked up once per
URL, whatever the entry point (Lightning's IO, the DCP writer, the manager), and the
resolved object is what travels down."""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import TransferOptions, profiles
from cloudckpt.cli.settings import Settings as CliSettings
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp.location import CheckpointLocation
from cloudckpt.errors import ConfigError
from cloudckpt.lightning import CloudCheckpointIO, CloudModelCheckpoint, fs
from cloudckpt.options import MiB
from cloudckpt.store import Resolved, Settings, memory, open_target, resolve
from cloudckpt.store.paths import exists
from servers import unique_bucket_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An in-memory bucket, and a profile ``lab`` that names it and sets a part size."""
    name = unique_bucket_name()
    config = tmp_path / "config.toml"
    config.write_text(
        f'[profiles.lab]\nurl = "memory://{name}"\nmatch = ["memory://{name}/"]\n'
        'part_size = "8MiB"\nwrite_concurrency = 3\n'
    )
    monkeypatch.setenv("CLOUDCKPT_CONFIG", str(config))
    yield name
    memory.clear(name)


@pytest.fixture
def visits(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every profile look-up from here on, by URL (each resolution makes exactly one)."""
    seen: Counter[str] = Counter()
    real = profiles.find_profile

    def counting(url: str) -> profiles.Profile | None:
        seen[url] += 1
        return real(url)

    monkeypatch.setattr(profiles, "find_profile", counting)
    return seen


def test_resolve_looks_the_profile_up_once_for_url_and_options(bucket, visits) -> None:
    found = resolve("profile://lab/run/x.pt", write_concurrency=5)
    assert visits == {"profile://lab/run/x.pt": 1}
    assert found.url == "profile://lab/run/x.pt"
    assert found.location == f"memory://{bucket}/run/x.pt"
    assert (found.options.part_size, found.options.write_concurrency) == (8 * MiB, 5)
    target = found.open()
    assert target.store.url(target.key) == found.location
    assert visits == {"profile://lab/run/x.pt": 1}  # opening resolves nothing again


def test_a_resolved_url_is_never_resolved_again(bucket, visits) -> None:
    target = open_target("profile://lab/a.pt")
    assert open_target(target) is target
    assert resolve(target).location == f"memory://{bucket}/a.pt"
    location = CheckpointLocation.resolve(resolve("profile://lab/dcp"))
    assert location.options.part_size == 8 * MiB
    location.store.put(location.key("x"), b"1")
    assert visits == {"profile://lab/a.pt": 1, "profile://lab/dcp": 1}
    with pytest.raises(ConfigError, match="resolved already"):
        open_target(target, part_size=16 * MiB)


def test_a_checkpoint_location_pickles_what_was_resolved(bucket, visits) -> None:
    location = CheckpointLocation.resolve("profile://lab/ckpt", write_concurrency=2)
    location.store.put(location.key("a"), b"x")
    copy = pickle.loads(pickle.dumps(location))
    assert copy.url == "profile://lab/ckpt" and copy.location == f"memory://{bucket}/ckpt"
    assert copy.options == location.options and copy.options.write_concurrency == 2
    assert copy.exists("a") and not copy.exists("b")
    writer = CloudStorageWriter(location.resolved)  # handed on, not resolved again
    assert writer.location.options == location.options
    assert visits == {"profile://lab/ckpt": 1}
    assert pickle.loads(pickle.dumps(resolve(f"memory://{bucket}/r"))).location.endswith("/r")


def test_lightning_io_resolves_once_per_call(bucket, visits) -> None:
    io = CloudCheckpointIO(read_concurrency=4)
    url = "profile://lab/io.ckpt"
    io.save_checkpoint({"w": torch.arange(4)}, url)
    assert visits == {url: 1}
    visits.clear()
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(4))
    assert visits == {url: 1}
    visits.clear()
    io.remove_checkpoint(url)
    assert visits == {url: 1}
    assert not exists(memory.MemoryStore(bucket), "io.ckpt")


def test_lightning_async_io_resolves_once_per_call(bucket, visits) -> None:
    io = CloudCheckpointIO(async_save=True)
    url = f"memory://{bucket}/async.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, url)
    io.wait()
    assert visits == {url: 1}


def test_dcp_writer_resolves_once(bucket, visits) -> None:
    url = "profile://lab/dcp-run"
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(state, storage_writer=CloudStorageWriter(url, read_concurrency=2))
    assert visits == {url: 1}
    visits.clear()
    back = {"w": torch.zeros(3, 4)}
    dcp.load(back, storage_reader=CloudStorageReader(url))
    assert torch.equal(back["w"], state["w"])
    assert visits == {url: 1}


def test_manager_save_resolves_each_url_once(bucket, visits) -> None:
    manager = cloudckpt.CheckpointManager("profile://lab/managed", keep_last=2)
    info = manager.save(1, {"w": torch.arange(3)})
    # The root when the manager is made; the step's object when its payload is saved.
    assert visits == {"profile://lab/managed": 1, f"{info.url}state.pt": 1}
    assert manager.options.part_size == 8 * MiB


def test_local_paths_take_none_of_the_shared_storage_options(tmp_path: Path) -> None:
    shared = Settings(None, {"storage_options": {"endpoint_url": "http://example.invalid"}})
    local = shared.resolve(tmp_path / "x.pt")
    assert local.options.storage_options == {}
    remote = shared.resolve("s3://bucket/x.pt")
    assert remote.options.storage_options == {"endpoint_url": "http://example.invalid"}
    cli = CliSettings({"storage_options": {"region_name": "x"}, "part_size": 16 * MiB})
    opened = cli.open(str(tmp_path / "y.pt"))
    assert opened.options.storage_options == {} and opened.options.part_size == 16 * MiB
    io = CloudCheckpointIO(storage_options={"region_name": "x"})  # every path, local ones too
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "z.ckpt")
    assert (tmp_path / "z.ckpt").exists()
    # A call's own storage options for a local path are a mistake, and said so.
    with pytest.raises(ConfigError, match="no storage options"):
        open_target(tmp_path / "x.pt", storage_options={"region_name": "x"})


def test_settings_are_checked_when_given() -> None:
    with pytest.raises(ConfigError, match="nonsense"):
        Settings(None, {"nonsense": 1})
    with pytest.raises(ConfigError, match="part_size"):
        CloudCheckpointIO(part_size=1)
    with pytest.raises(ConfigError, match="nonsense"):
        CliSettings({"nonsense": 1})
    assert isinstance(resolve("memory://b/x"), Resolved)


def test_a_remote_dirpath_is_set_up_in_one_place(
    bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Lightning's and NeMo's callbacks share it: settings checked when the callback is
    made, registered for its URL only when given, setup refusing links."""
    monkeypatch.setattr(fs, "_settings", {})
    assert fs.remote_dirpath(tmp_path / "ckpts") is None
    with pytest.raises(ConfigError, match="TransferOptions"):
        CloudModelCheckpoint(dirpath=str(tmp_path), options="fast")  # type: ignore[arg-type]

    fs.register_options("", part_size=16 * MiB)  # what a checkpoint I/O registers
    plain = CloudModelCheckpoint(dirpath=f"cloudckpt://memory://{bucket}/plain/")
    assert plain.dirpath == f"memory://{bucket}/plain"
    assert fs.target_for(f"{plain.dirpath}/a.ckpt").options.part_size == 16 * MiB
    tuned = CloudModelCheckpoint(
        dirpath=f"memory://{bucket}/tuned", options=TransferOptions(part_size=32 * MiB)
    )
    assert fs.target_for(f"{tuned.dirpath}/a.ckpt").options.part_size == 32 * MiB

    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda v: f"{v}-rank0"))
    fs.setup_remote_dirpath(tuned, trainer)
    assert tuned.dirpath == f"memory://{bucket}/tuned-rank0"
    assert isinstance(tuned._fs, fs.CloudFileSystem)
    linked = CloudModelCheckpoint(dirpath=f"memory://{bucket}/l", save_last="link")
    with pytest.raises(ValueError, match="link"):
        fs.setup_remote_dirpath(linked, trainer)
