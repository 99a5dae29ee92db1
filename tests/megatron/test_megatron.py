"""cloudckpt.megatron on a real megatron-core GPTModel (TP=2, gloo, 2 forked CPU ranks).

Each test starts its ranks with :func:`ranks.run_ranks`; the scenarios live in
``mcore_workers``. megatron-core is an optional dependency: without it these skip.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")

import mcore_workers as w

from cloudckpt.options import TransferOptions
from cloudckpt.store import open_url
from ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")

TIMEOUT = 300  # seconds for a whole multi-rank scenario on a busy 2-core machine


def _names(url: str, so: dict[str, Any]) -> list[str]:
    store, key = open_url(url, TransferOptions(storage_options=so))
    return sorted(o.key[len(key) + 1 :] for o in store.list(key + "/"))


def test_round_trip_and_tp_resharding(rclone_server: Any) -> None:
    so = rclone_server.storage_options()
    url = f"s3://{rclone_server.make_bucket('mcore-reshard')}/run"
    run_ranks(w.round_trip_and_reshard, 2, url, so, timeout=TIMEOUT)
    names = _names(f"{url}/tp2", so)
    assert {"metadata.json", "common.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(names)


def test_async_save_while_the_loop_runs_its_own_collectives(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('mcore-async')}/run/iter_1"
    run_ranks(w.async_save_while_training, 2, url, so, timeout=TIMEOUT)


def test_handle_finalizes_through_megatrons_async_calls_queue(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('mcore-queue')}/run/iter_1"
    run_ranks(w.megatron_async_queue, 2, url, so, timeout=TIMEOUT)


def test_a_second_async_save_queues_behind_a_stuck_first(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('mcore-queued')}/run"
    run_ranks(w.queued_async_saves, 2, url, so, timeout=TIMEOUT)


def test_a_rank_that_refuses_fails_the_save_everywhere(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('mcore-refused')}/run/iter_1"
    run_ranks(w.refused_save_fails_everywhere, 2, url, so, timeout=TIMEOUT)
    store, key = open_url(url, TransferOptions(storage_options=so))
    assert list(store.list_multipart(key + "/")) == []


def test_megatron_writer_and_reader_interop(moto_server: Any, tmp_path: Path) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('mcore-interop')}/run"
    run_ranks(w.megatron_interop, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_checkpoint_written_by_megatron_with_msc_loads(
    rclone_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("multistorageclient")
    so = rclone_server.storage_options()
    bucket = rclone_server.make_bucket("mcore-msc")
    config = {
        "profiles": {
            "ckpt": {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": bucket,
                        "endpoint_url": so["endpoint_url"],
                        "region_name": so["region_name"],
                    },
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {
                        "access_key": so["aws_access_key_id"],
                        "secret_key": so["aws_secret_access_key"],
                    },
                },
            }
        }
    }
    path = tmp_path / "msc.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("MSC_CONFIG", str(path))
    run_ranks(
        w.msc_interop, 2, f"s3://{bucket}/run/iter_1", so, "msc://ckpt/run/iter_1", timeout=TIMEOUT
    )
