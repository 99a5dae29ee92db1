"""`cloudckpt verify` and `cloudckpt info` on every checkpoint kind, each written by its
real writer: torch's ``FileSystemWriter`` (uploaded as files), cloudckpt's DCP writer,
megatron-core's ``dist_checkpointing.save`` (uploaded), the safetensors library's
``save_file``, ``torch.save``; and a lone DCP data object. Healthy ones pass with the
fields ``--json`` documents; a damaged file fails with exit code 4 and its URL named.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.cli import main
from cloudckpt.dcp import CloudStorageWriter
from cloudckpt.options import TransferOptions
from cloudckpt.store import Store, open_url
from conftest import unique_bucket_name

pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass
class Where:
    """A fresh place on one store: its URL, options and the store itself."""

    url: str
    storage_options: dict[str, Any]
    store: Store
    key: str

    def key_of(self, name: str) -> str:
        return f"{self.key}/{name}" if self.key else name

    def upload(self, local: Path, name: str) -> str:
        """Copy a local file or folder under ``name`` object by object; its URL."""
        paths = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in paths:
            rel = name if local.is_file() else f"{name}/{path.relative_to(local).as_posix()}"
            self.store.put(self.key_of(rel), path.read_bytes())
        return f"{self.url}/{name}"

    def damage(self, name: str, edit: Any) -> None:
        """Rewrite the object ``name`` with ``edit(bytearray)``'s result."""
        data = bytearray(self.store.get(self.key_of(name)))
        self.store.put(self.key_of(name), bytes(edit(data)))


@pytest.fixture(params=["file", "moto"])
def where(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Where]:
    if request.param == "file":
        root = tmp_path / "store"
        root.mkdir()
        url = root.as_uri()
        options: dict[str, Any] = {}
    else:
        server = request.getfixturevalue("moto_server")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.make_bucket(unique_bucket_name('kinds'))}/ckpts"
        options = server.storage_options()
    store, key = open_url(url, TransferOptions(storage_options=options))
    yield Where(url, options, store, key.rstrip("/"))


def cli(*args: str) -> tuple[int, str]:
    """``cloudckpt ARGS`` in this process: exit code and stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue() + err.getvalue()


def cli_json(*args: str, code: int = 0) -> Any:
    got, out = cli(*args, "--json")
    assert got == code, out
    return json.loads(out)


def state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)},
        "big": torch.randn(300_000),
        "step": 7,
        "epoch": 2,
        "optimizer": {"param_groups": [{"lr": 0.01}]},
    }


def flip_middle(data: bytearray) -> bytearray:
    data[len(data) // 2] ^= 0x01
    return data


def assert_failed(args: tuple[str, ...], name: str) -> dict[str, Any]:
    """verify exits 4 and names the damaged object ``name`` (both outputs)."""
    code, out = cli("verify", *args)
    assert code == 4, out
    assert name in out and "FAILED" in out
    report = cli_json("verify", *args, code=4)
    bad = [c for c in report["checked"] if not c["ok"]]
    assert report["ok"] is False and bad
    assert any(name in c["url"] for c in bad) and all(name in c["error"] for c in bad)
    return report


def test_dcp_written_by_torch_and_uploaded(where: Where, tmp_path: Path) -> None:
    # A value of a class the trust boundary refuses is no damage: verify passes it.
    written = {**state(), "args": argparse.Namespace(seed=1)}
    dcp.save(written, storage_writer=dcp.FileSystemWriter(str(tmp_path / "theirs")))
    url = where.upload(tmp_path / "theirs", "theirs")

    report = cli_json("verify", url)
    assert report["ok"] is True
    names = sorted(c["url"].rpartition("/")[2] for c in report["checked"])
    assert names == [".metadata", "__0_0.distcp"]
    info = cli_json("info", url)
    assert info["kind"] == "dcp" and info["metadata"]["writer"] == "torch"
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["model.w"] == {
        "name": "model.w",
        "dtype": "float32",
        "shape": [64, 32],
        "bytes": 8192,
    }
    assert tensors["big"]["bytes"] == 1_200_000
    assert {i["name"] for i in info["items"]} == {
        "step",
        "epoch",
        "optimizer.param_groups.0.lr",
        "args",
    }
    assert info["scalars"] == {"step": 7, "epoch": 2, "optimizer.param_groups.0.lr": 0.01}

    where.damage("theirs/__0_0.distcp", lambda b: b[: len(b) - 1000])
    report = assert_failed((url,), "__0_0.distcp")
    assert "truncated" in json.dumps(report)


def test_dcp_written_by_cloudckpt(where: Where) -> None:
    url = f"{where.url}/ours"
    writer = CloudStorageWriter(url, options=TransferOptions(storage_options=where.storage_options))
    dcp.save(state(), storage_writer=writer)

    report = cli_json("verify", url)
    assert report["ok"] is True and len(report["checked"]) == 3  # + the layout index
    info = cli_json("info", url)
    assert info["metadata"]["writer"] == "cloudckpt"
    assert {t["name"] for t in info["tensors"]} == {"model.w", "big"}
    assert info["scalars"]["step"] == 7

    # One flipped byte inside the large tensor's record: its block checksum fails.
    where.damage("ours/__0_0.distcp", flip_middle)
    report = assert_failed((url,), "__0_0.distcp")
    assert "CRC-32" in json.dumps(report)


def test_a_lone_dcp_data_object(where: Where, tmp_path: Path) -> None:
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "theirs")))
    url = where.upload(tmp_path / "theirs" / "__0_0.distcp", "__0_0.distcp")

    code, out = cli("verify", url)
    assert code == 0, out
    assert "a DCP data file; verify its checkpoint prefix for checksums" in out
    report = cli_json("verify", url)
    assert report["ok"] is True and report["note"].startswith("a DCP data file")
    assert cli_json("info", url)["kind"] == "dcp-data"

    where.damage("__0_0.distcp", lambda b: b[:-30])  # cuts the last archive's end record
    assert_failed((url,), "__0_0.distcp")


def _megatron_save(rank: int, world: int, out: str) -> None:
    """One rank: megatron-core's own writer (torch_dist) on CPU."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sharded = {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", w, replica_id=0)},
        "iteration": 7,
        "optimizer": {"param_groups": [{"lr": 0.001}]},
    }
    dist_checkpointing.save(sharded, out)


def test_megatron_checkpoint_written_by_megatron_core(where: Where, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing")
    from ranks import run_ranks

    local = tmp_path / "iter_0000007"
    local.mkdir()
    run_ranks(_megatron_save, 1, str(local), timeout=300)
    url = where.upload(local, "iter_0000007")

    report = cli_json("verify", url)
    assert report["ok"] is True
    names = sorted(c["url"].rpartition("/")[2] for c in report["checked"])
    assert names == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    info = cli_json("info", url)
    assert info["kind"] == "megatron"
    assert info["metadata"]["backend"]["sharded_backend"] == "torch_dist"
    assert info["tensors"] == [
        {"name": "model.w", "dtype": "float32", "shape": [8, 8], "bytes": 256}
    ]
    assert info["scalars"]["common.pt:iteration"] == 7
    assert info["scalars"]["common.pt:optimizer.param_groups[0].lr"] == 0.001

    where.damage("iter_0000007/__0_0.distcp", lambda b: b[:-200])
    assert_failed((url,), "__0_0.distcp")


def test_safetensors_folder_and_file(where: Where, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {"a": torch.zeros(4, 4), "b": torch.ones(2)},
        "model-00002-of-00002.safetensors": {"c": torch.ones(3, dtype=torch.bfloat16)},
    }
    for name, tensors in shards.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})
    weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    index = {"metadata": {"total_size": 78}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    url = where.upload(folder, "hf")

    assert cli_json("verify", url)["ok"] is True
    info = cli_json("info", url)
    assert info["kind"] == "safetensors"
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["a"] == {
        "name": "a",
        "dtype": "float32",
        "shape": [4, 4],
        "bytes": 64,
        "file": "model-00001-of-00002.safetensors",
    }
    assert tensors["c"]["dtype"] == "bfloat16"
    assert info["metadata"]["model-00002-of-00002.safetensors"] == {"format": "pt"}

    single = where.upload(folder / "model-00001-of-00002.safetensors", "one.safetensors")
    assert cli_json("verify", single)["ok"] is True
    assert {t["name"] for t in cli_json("info", single)["tensors"]} == {"a", "b"}

    # A broken header: its length field now runs past the end of the file.
    where.damage("hf/model-00002-of-00002.safetensors", lambda b: b"\xff\xff\xff\x00" + b[4:])
    report = assert_failed((url,), "model-00002-of-00002.safetensors")
    assert "header" in json.dumps(report)
    where.store.delete(where.key_of("hf/model-00002-of-00002.safetensors"))
    code, out = cli("verify", url)
    assert code == 4 and "model-00002-of-00002.safetensors" in out, out


def test_info_shows_a_torch_checkpoints_scalars(where: Where, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    torch.save(
        {
            "state_dict": model.state_dict(),
            "epoch": 3,
            "global_step": 1200,
            "optimizer": opt.state_dict(),
            "lr_schedulers": [sched.state_dict()],
        },
        tmp_path / "last.ckpt",
    )
    url = where.upload(tmp_path / "last.ckpt", "last.ckpt")
    info = cli_json("info", url)
    assert info["kind"] == "torch"
    scalars = info["scalars"]
    assert scalars["epoch"] == 3 and scalars["global_step"] == 1200
    assert scalars["optimizer.param_groups[0].lr"] == 0.0625
    assert scalars["lr_schedulers[0]._last_lr[0]"] == 0.0625
    assert scalars["lr_schedulers[0].last_epoch"] == 1
    assert info["archives"][0]["scalars"] == scalars
    assert {t["name"] for t in info["tensors"]} == {"state_dict.weight", "state_dict.bias"}
    code, out = cli("info", url)
    assert code == 0 and "global_step=1200" in out


def test_a_prefix_of_no_known_kind_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "notes.txt").write_text("not a checkpoint")
    for command in ("info", "verify"):
        code, out = cli(command, str(tmp_path / "misc"))
        assert code == 2 and "misc" in out, out
