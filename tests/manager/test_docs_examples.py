"""The Python examples of docs/manager.md, docs/tiers.md and the README run as printed
against moto (issue 41, item 5): each block in its own process, twice in the same bucket
where it resumes, so the first run is a fresh one (``restore()`` returns None) and the
second resumes what the first saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudckpt.manager import CheckpointManager
from docs_examples import page_examples, run_example
from servers import S3Server


def _latest(server: S3Server, root: str) -> int | None:
    found = CheckpointManager(root, storage_options=server.storage_options()).latest()
    return None if found is None else found.step


def test_the_manager_page_example_starts_fresh_then_resumes(
    moto_server: S3Server, tmp_path: Path
) -> None:
    [example] = page_examples("docs/manager.md")
    bucket = run_example(moto_server, example, tmp_path, "manager-docs", placeholder="bucket")
    assert _latest(moto_server, f"s3://{bucket}/run1") == 29
    run_example(moto_server, example, tmp_path, "manager-docs", bucket=bucket, placeholder="bucket")
    assert _latest(moto_server, f"s3://{bucket}/run1") == 59  # resumed at step 30


def test_the_tiers_page_examples_run(moto_server: S3Server, tmp_path: Path) -> None:
    tiered, lightning = page_examples("docs/tiers.md")
    local = {"/local_nvme/": f"{tmp_path}/local_nvme/"}
    bucket = run_example(
        moto_server, tiered, tmp_path, "tiers-docs", placeholder="bucket", paths=local
    )
    assert _latest(moto_server, f"s3://{bucket}/run1") == 2  # drained before exit
    run_example(
        moto_server,
        tiered,
        tmp_path,
        "tiers-docs",
        bucket=bucket,
        placeholder="bucket",
        paths=local,
    )
    assert _latest(moto_server, f"s3://{bucket}/run1") == 5  # resumed from the local tier

    pytest.importorskip("lightning")
    other = {"/local_nvme/": f"{tmp_path}/lightning_nvme/"}
    bucket = run_example(
        moto_server, lightning, tmp_path, "tiers-lightning", placeholder="bucket", paths=other
    )
    names = {o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "run1/last.ckpt" in names


def test_the_readme_examples_run(moto_server: S3Server, tmp_path: Path) -> None:
    usage, manager = page_examples("README.md")
    bucket = run_example(moto_server, usage, tmp_path, "readme-docs", placeholder="my-bucket")
    for _ in range(2):
        run_example(
            moto_server, manager, tmp_path, "readme-docs", bucket=bucket, placeholder="my-bucket"
        )
    assert _latest(moto_server, f"s3://{bucket}/run2") == 5
