"""The fault mix on the paths that used to call the store without retries: the CLI's
``cp``, Lightning's filesystem (resume's ``last`` lookup, top-k removal), and ranged
reads cut short on GCS and Azure (retried like S3's, not raised as corruption)."""

from __future__ import annotations

import torch

import cloudckpt
from cloudckpt.cli import main as cli_main
from cloudckpt.options import MiB
from cloudckpt.store import open_target
from cloudckpt.testing.fault_proxy import FaultProxy

RETRYING = {"max_attempts": 12, "backoff_base": 0.01, "backoff_max": 0.2, "request_timeout": 4.0}


def _state(mib: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def test_cp_survives_ten_percent_faults(rclone_server, tmp_path, monkeypatch):
    bucket = rclone_server.make_bucket("fault-cp")
    state = _state(24, 1)
    cloudckpt.save(state, tmp_path / "a.pt")
    with FaultProxy(rclone_server.endpoint_url, rate=0.10, seed=7, slow_seconds=5.0) as proxy:
        for key, value in rclone_server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        url = f"s3://{bucket}/copied/a.pt"
        argv = ["cp", str(tmp_path / "a.pt"), url, "--part-size", "5MiB", "--no-progress"]
        assert cli_main(argv) == 0
        argv = ["cp", url, str(tmp_path / "back.pt"), "--no-progress"]
        assert cli_main(argv) == 0
        assert sum(proxy.injected.values()) > 0
    out = torch.load(tmp_path / "back.pt", weights_only=True)
    assert torch.equal(out["w"], state["w"])


def test_lightning_filesystem_calls_survive_faults(rclone_server):
    """ls, info, open and rm of the fsspec view (what ``ckpt_path="last"`` and top-k
    rotation call) each see 503s and resets and still answer right."""
    from cloudckpt.lightning.fs import CloudFileSystem, register_options, wrap

    bucket = rclone_server.make_bucket("fault-fs")
    root = f"s3://{bucket}/run"
    direct = {"storage_options": rclone_server.storage_options()}
    for name in ("last.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"):
        cloudckpt.save({"name": name}, f"{root}/{name}", **direct)
    fs = CloudFileSystem()
    kinds = ("slowdown", "internal", "reset")
    with FaultProxy(rclone_server.endpoint_url, rate=0.3, kinds=kinds, seed=2) as proxy:
        opts = {"storage_options": {**direct["storage_options"], "endpoint_url": proxy.url}}
        register_options(root, **opts, **RETRYING)
        names = sorted(e.split("/")[-1] for e in fs.ls(wrap(root), detail=False))
        assert names == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
        assert fs.info(wrap(f"{root}/last.ckpt"))["type"] == "file"
        with fs.open(wrap(f"{root}/last.ckpt"), "rb") as f:
            assert f.read()[:2] == b"PK"
        fs.rm(wrap(f"{root}/epoch=1.ckpt"))
        assert not fs.exists(wrap(f"{root}/epoch=1.ckpt"))
        assert proxy.injected["slowdown"] + proxy.injected["internal"] > 0
        register_options(root, **direct)


def _short_reads(server, base_url: str, options: dict, storage_options_for) -> None:
    """A ranged read whose answer is cut short is retried, and the bytes are right."""
    data = bytes(range(256)) * 4096  # 1 MiB
    target = open_target(f"{base_url}/obj.bin", storage_options=options)
    target.store.put(target.key, data)

    def ranged_gets(method: str, path: str) -> bool:
        return method == "GET" and ("alt=media" in path or "/obj.bin" in path)

    for kind in ("short", "truncate"):
        with FaultProxy(server.endpoint_url, schedule={1: kind}, match=ranged_gets) as proxy:
            faulty = open_target(
                f"{base_url}/obj.bin", storage_options=storage_options_for(proxy), **RETRYING
            )
            buf = bytearray(300_000)
            faulty.store.read_into(faulty.key, 1000, [memoryview(buf)])
            assert proxy.injected[kind] == 1
        assert bytes(buf) == data[1000:301_000]


def test_gcs_short_reads_are_retried(gcs_server):
    bucket = gcs_server.make_bucket("short-reads-gcs")
    opts = gcs_server.storage_options()
    _short_reads(
        gcs_server, f"gs://{bucket}", opts, lambda proxy: {**opts, "endpoint_url": proxy.url}
    )


def test_azure_short_reads_are_retried(azure_server):
    container = azure_server.make_bucket("short-reads-azure")
    opts = azure_server.storage_options()

    def through(proxy):
        conn = opts["connection_string"]
        fields = dict(part.split("=", 1) for part in conn.split(";") if part)
        fields["BlobEndpoint"] = f"{proxy.url}/{fields['AccountName']}"
        return {"connection_string": ";".join(f"{k}={v}" for k, v in fields.items())}

    _short_reads(azure_server, f"az://{container}", opts, through)
