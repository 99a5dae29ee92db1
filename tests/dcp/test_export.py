"""``export_safetensors`` / ``cloudckpt export``: DCP checkpoints as consolidated safetensors.

The reference is torch's own consolidation (``dcp_to_torch_save`` of the same state
written by ``FileSystemWriter`` on the same ranks) and the files are read back with the
``safetensors`` library itself, not with cloudckpt's reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dcp_workers as w
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as st_load
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import cloudckpt
from cloudckpt.cli import main
from cloudckpt.dcp import CloudStorageWriter
from cloudckpt.dcp import export as export_module
from cloudckpt.dcp.export import SOURCE_KEY
from cloudckpt.errors import ConfigError, MissingKeyError, StorageError
from cloudckpt.store import RetryPolicy, Target, open_target
from conftest import make_target
from faults import FaultyStore
from safetensors import safe_open
from servers import StoreTarget

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict flattened with dots, as DCP names its entries."""
    if not isinstance(state, dict):
        return {prefix: state}
    out: dict[str, Any] = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _library_load(target: StoreTarget, rel: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file or sharded export at ``rel``, read by the
    safetensors library from bytes fetched without cloudckpt."""
    if rel.endswith(".index.json"):
        index = json.loads(target.read_object(f"{target.base_url}/{rel}"))
        folder = rel.rpartition("/")[0]
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(index["weight_map"].values())):
            shard = st_load(target.read_object(f"{target.base_url}/{folder}/{name}"))
            assert {k for k, f in index["weight_map"].items() if f == name} == set(shard)
            out.update(shard)
        return out
    return st_load(target.read_object(f"{target.base_url}/{rel}"))


@pytest.fixture
def rclone_target(request: pytest.FixtureRequest, tmp_path: Path):
    yield from make_target(request, "rclone", tmp_path)


@pytest.fixture
def memory_url(request: pytest.FixtureRequest, tmp_path: Path):
    for target in make_target(request, "memory", tmp_path):
        yield target.base_url


@pytest.fixture
def file_target(request: pytest.FixtureRequest, tmp_path: Path):
    yield from make_target(request, "file", tmp_path)


def test_two_rank_checkpoint_exports_as_torchs_own_consolidation(
    rclone_target: StoreTarget, file_target: StoreTarget, tmp_path: Path
) -> None:
    so = rclone_target.storage_options
    fs_dir, cloud = tmp_path / "fs", f"{rclone_target.base_url}/run/step-1"
    w.run_ranks(w.save_both_writers, 2, str(fs_dir), cloud, so)
    dcp_to_torch_save(str(fs_dir), str(tmp_path / "ref.pt"))
    reference = _flat(torch.load(tmp_path / "ref.pt", weights_only=True))
    tensors = {k: v for k, v in reference.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {"model.row", "model.col", "model.small", "model.rep"}

    # CloudStorageWriter's 2-rank checkpoint on S3 -> sharded safetensors on a filesystem.
    out = cloudckpt.export_safetensors(
        cloud,
        f"{file_target.base_url}/hf/",
        max_shard_size="3MB",
        source_options=cloudckpt.TransferOptions(storage_options=so),
    )
    assert out.url.endswith("/hf/model.safetensors.index.json")
    assert len(out.files) == 3 and out.tensors == 4 and out.reused == ()
    assert set(out.skipped) == {"step", "extra.name"}
    got = _library_load(file_target, "hf/model.safetensors.index.json")
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name

    # torch's FileSystemWriter directory (the same state) -> one file on S3, cast.
    single = cloudckpt.export_safetensors(
        str(fs_dir),
        f"{rclone_target.base_url}/hf-bf16/model.safetensors",
        dtype="bf16",
        max_shard_size=None,
        options=cloudckpt.TransferOptions(storage_options=so),
    )
    got = _library_load(rclone_target, "hf-bf16/model.safetensors")
    for name, want in tensors.items():
        cast = want.bfloat16() if want.is_floating_point() else want
        assert got[name].dtype == cast.dtype and torch.equal(got[name], cast), name
    with safe_open(_download(rclone_target, "hf-bf16/model.safetensors", tmp_path), "pt") as f:
        assert f.metadata()["format"] == "pt" and SOURCE_KEY in f.metadata()
    assert single.files == (single.url,)


def _download(target: StoreTarget, rel: str, tmp_path: Path) -> Path:
    path = tmp_path / rel.replace("/", "_")
    path.write_bytes(target.read_object(f"{target.base_url}/{rel}"))
    return path


def _mixed_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(64, 32, generator=g),
            "layer.0.weight": torch.randn(32, 32, generator=g).half(),
            "layer.0.bias": torch.randn(32, generator=g),
            "counter": torch.arange(7, dtype=torch.int32),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "layer.1.weight": torch.randn(32, 32, generator=g).half(),
        },
        "optim": {"state": {"embed.weight": {"exp_avg": torch.randn(64, 32, generator=g)}}},
        "step": 12,
    }


def _save(url: str, state: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=CloudStorageWriter(url, overwrite=True), no_dist=True)


def test_dtype_filter_and_rename(memory_url: str) -> None:
    state = _mixed_state()
    _save(f"{memory_url}/ck", state)
    out = cloudckpt.export_safetensors(
        f"{memory_url}/ck",
        f"{memory_url}/hf",
        dtype=torch.bfloat16,
        include="model.*",
        exclude="*.empty",
        rename={"model.": "", "model.layer.": "transformer.h."},
    )
    got = cloudckpt.load_safetensors(out.url)
    model = state["model"]
    assert set(got) == {"embed.weight", "transformer.h.1.weight"} | {
        "transformer.h.0.weight",
        "transformer.h.0.bias",
        "counter",
        "mask",
        "scalar",
    }
    assert got["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(got["embed.weight"], model["embed.weight"].bfloat16())
    assert torch.equal(got["transformer.h.0.weight"], model["layer.0.weight"].bfloat16())
    assert torch.equal(got["scalar"], model["scalar"].bfloat16()) and got["scalar"].shape == ()
    assert got["counter"].dtype == torch.int32 and torch.equal(got["counter"], model["counter"])
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], model["mask"])

    dropped = cloudckpt.export_safetensors(
        f"{memory_url}/ck",
        f"{memory_url}/hf2",
        rename=lambda n: None if n.startswith("optim.") else n.upper(),
    )
    got = cloudckpt.load_safetensors(dropped.url)
    assert set(got) == {f"MODEL.{k}".upper() for k in model}
    assert torch.equal(got["MODEL.EMPTY"], model["empty"]) and got["MODEL.EMPTY"].shape == (0, 4)


def test_bad_selections_are_refused_before_anything_is_written(memory_url: str) -> None:
    _save(f"{memory_url}/ck", _mixed_state())
    dst = f"{memory_url}/hf"
    with pytest.raises(MissingKeyError, match=r"no tensor matches \['modle\.\*'\]"):
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, include=["model.*", "modle.*"])
    with pytest.raises(MissingKeyError, match="nothing to export"):
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, exclude="*")
    with pytest.raises(ConfigError, match=r"'model\.counter' and 'model\.mask' would both be"):
        cloudckpt.export_safetensors(
            f"{memory_url}/ck", dst, include=["model.counter", "model.mask"], rename=lambda n: "x"
        )
    with pytest.raises(ConfigError, match="not a floating-point dtype"):
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, dtype="int8")
    with pytest.raises(ConfigError, match="max_shard_size"):
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, max_shard_size="lots")
    assert _shards(dst) == []


def _shards(url: str) -> list[str]:
    where = open_target(url + "/x")
    prefix = where.key.rpartition("/")[0] + "/"
    return sorted(o.key[len(prefix) :] for o in where.store.list(prefix))


def _index_metadata(url: str) -> dict[str, Any]:
    where = open_target(url)
    return json.loads(where.store.get(where.key))["metadata"]


def test_a_failed_export_commits_nothing_and_a_rerun_resumes(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _mixed_state()
    _save(f"{memory_url}/ck", state)
    dst = f"{memory_url}/hf"
    real = open_target(dst)
    faulty = FaultyStore(real.store)
    # The destination's third small-file put (shard 3 of 4) fails for good.
    faulty.faults["put"] = lambda n: StorageError("injected: the store refused") if n == 3 else None

    def opener(url: Any, options: Any = None, **overrides: Any) -> Target:
        t = open_target(url, options, **overrides)
        return Target(
            t.url, faulty.with_retry(RetryPolicy.from_options(t.options)), t.key, t.options
        )

    monkeypatch.setattr(export_module, "open_target", opener)
    kwargs: dict[str, Any] = {"max_shard_size": 1000, "include": "model.*"}
    with pytest.raises(StorageError, match="injected"):
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, **kwargs)
    assert _shards(dst) == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2)]  # no index

    faulty.faults.clear()
    out = cloudckpt.export_safetensors(f"{memory_url}/ck", dst, **kwargs)
    assert [u.rsplit("/", 1)[1] for u in out.reused] == [
        f"model-0000{i}-of-00004.safetensors" for i in (1, 2)
    ]
    assert _shards(dst)[-1] == "model.safetensors.index.json"
    got = cloudckpt.load_safetensors(out.url)
    assert set(got) == {f"model.{k}" for k in state["model"]}
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in state["model"].items())

    # The same export again reuses every file; a new save at the source reuses none.
    again = cloudckpt.export_safetensors(f"{memory_url}/ck", dst, **kwargs)
    assert len(again.reused) == 4
    first_source = _index_metadata(again.url)[SOURCE_KEY]
    changed = _mixed_state(seed=1)
    _save(f"{memory_url}/ck", changed)
    fresh = cloudckpt.export_safetensors(f"{memory_url}/ck", dst, **kwargs)
    assert fresh.reused == ()
    got = cloudckpt.load_safetensors(fresh.url)
    assert torch.equal(got["model.embed.weight"], changed["model"]["embed.weight"])
    assert _index_metadata(fresh.url)[SOURCE_KEY] != first_source
    assert (
        cloudckpt.export_safetensors(f"{memory_url}/ck", dst, resume=False, **kwargs).reused == ()
    )


_RSS_CHILD = """
import sys, warnings
warnings.simplefilter("ignore")
import cloudckpt

def peak():  # VmHWM: this process's peak RSS (ru_maxrss carries the parent's over exec)
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("VmHWM:"))

src, dst = sys.argv[1], sys.argv[2]
cloudckpt.export_safetensors(src, dst + "/warm", include="w0", batch_size="8MiB")
before = peak()
out = cloudckpt.export_safetensors(
    src, dst, batch_size="8MiB", part_size=8 << 20, write_concurrency=2, max_shard_size=None
)
print(peak() - before, out.size)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM (Linux)")
def test_memory_stays_bounded_by_the_batch_not_the_model(tmp_path: Path) -> None:
    state = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(24)}  # 96 MiB
    dcp.save(state, storage_writer=CloudStorageWriter(str(tmp_path / "ck")), no_dist=True)
    del state
    # A fixed mmap threshold makes glibc hand freed 4 MiB blocks back at once, so the
    # peak RSS is what was live (by default it may keep them for reuse).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    run = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(tmp_path / "ck"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    grew, size = (int(x) for x in run.stdout.split())
    assert size > 96 << 20
    # One 8 MiB batch read while two 8 MiB parts upload (about 20 MiB measured), not the
    # 96 MiB file (about 88 MiB with one batch of everything).
    assert grew < 48 << 20, f"peak RSS grew by {grew / 2**20:.0f} MiB"
    got = cloudckpt.load_safetensors(str(tmp_path / "hf"))
    assert len(got) == 24 and torch.equal(got["w23"], torch.full((1024, 1024), 23.0))


def test_cli_export(memory_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = _mixed_state()
    src = tmp_path / "ck"
    dcp.save(state, storage_writer=CloudStorageWriter(str(src)), no_dist=True)
    dst = tmp_path / "hf"
    argv = ["export", str(src), str(dst), "--include", "model.*", "--rename", "model.="]
    code = main([*argv, "--dtype", "fp16", "--max-shard-size", "1000", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == len(state["model"]) and doc["url"].endswith(".index.json")
    got = cloudckpt.load_safetensors(str(dst))
    assert got["embed.weight"].dtype == torch.float16
    assert main([*argv, "--max-shard-size", "1000"]) == 0
    # Without the cast, only the two shards of tensors already in fp16 are the same files.
    assert "2 kept from an earlier run" in capsys.readouterr().out
    assert main([*argv, "--max-shard-size", "1000"]) == 0
    assert "4 kept from an earlier run" in capsys.readouterr().out
    assert main(["export", str(src), str(dst), "--rename", "nonsense"]) == 2
    assert "--rename 'nonsense' is not OLD=NEW" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), str(dst)]) == 3
