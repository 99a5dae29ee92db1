"""What a killed save leaves is visible at once: ``ls --all`` and ``gc --dry-run`` list
open multipart uploads and uncommitted step prefixes with their ages, the young ones
marked as kept; gc removes only what is older than its grace period."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from cloudckpt.cli import main
from cloudckpt.manager.gc import collect_garbage, find_leftovers
from cloudckpt.options import resolve_options
from cloudckpt.store import Store, open_url
from cloudckpt.store.base import MultipartUpload
from conftest import unique_bucket_name
from servers import S3Server

PART = 5 * 1024 * 1024
ROOT = "run1"


@pytest.fixture
def bucket(rclone_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A fresh bucket on rclone, the CLI's environment pointed at it."""
    name = rclone_server.make_bucket(unique_bucket_name())
    for key, value in rclone_server.env().items():
        monkeypatch.setenv(key, value)
    options = resolve_options(storage_options=rclone_server.storage_options())
    store, _ = open_url(f"s3://{name}", options)
    yield store
    rclone_server.remove_bucket(name)


def _killed_save(store: Store, step: int) -> MultipartUpload:
    """What ``kill -9`` in the middle of a save leaves: an upload with a part, never
    completed or aborted, under the step's prefix."""
    upload = store.create_multipart(f"{ROOT}/step-{step:09d}/state.pt")
    store.upload_part(upload, 1, b"x" * PART, 0)
    return upload


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _json(*args: str) -> Any:
    done = _cli(*args, "--json")
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout)


def test_ls_all_shows_a_young_open_upload_right_after_the_kill(bucket: Store) -> None:
    upload = _killed_save(bucket, 1)
    url = bucket.url(upload.key)
    assert _cli("ls", bucket.url(ROOT)).returncode == 3  # plain ls: nothing committed
    done = _cli("ls", "--all", bucket.url(ROOT))
    assert done.returncode == 0, done.stderr
    assert f"open multipart upload to {url}" in done.stdout
    assert "within grace period (kept)" in done.stdout
    (found,) = _json("ls", "--all", bucket.url(ROOT))["leftovers"]
    assert found["kind"] == "upload" and found["url"] == url and found["kept"] is True
    assert found["upload_id"] == upload.upload_id
    assert 0 <= found["age_s"] < 3600
    (old,) = _json("ls", "--all", "--grace", "0", bucket.url(ROOT))["leftovers"]
    assert old["upload_id"] == upload.upload_id and old["kept"] is False  # past a 0 s grace


def test_gc_dry_run_lists_young_leftovers_as_kept_and_removes_nothing(bucket: Store) -> None:
    upload = _killed_save(bucket, 2)
    bucket.put(f"{ROOT}/step-000000003/state.pt", b"partial")  # uncommitted, young
    report = _json("gc", "--dry-run", bucket.url(ROOT))
    assert report["prefixes"] == [] and report["uploads"] == []
    kept = {(x["kind"], x["url"]) for x in report["kept"]}
    assert kept == {
        ("upload", bucket.url(upload.key)),
        ("prefix", bucket.url(f"{ROOT}/step-000000003/")),
    }
    assert all(x["kept"] and 0 <= x["age_s"] < 3600 for x in report["kept"])
    text = _cli("gc", "--dry-run", bucket.url(ROOT)).stdout
    assert text.count("within grace period (kept)") == 2
    assert [u.upload_id for u in bucket.list_multipart(ROOT + "/")] == [upload.upload_id]


def test_gc_removes_only_what_is_older_than_the_grace(bucket: Store) -> None:
    upload = _killed_save(bucket, 4)
    options = resolve_options()
    young = collect_garbage(bucket, ROOT, options)
    assert [x.url for x in young.kept] == [bucket.url(upload.key)] and not young.uploads
    assert [u.upload_id for u in bucket.list_multipart(ROOT + "/")] == [upload.upload_id]
    # An hour and a minute later the same upload is stale: gc aborts it.
    started = next(iter(bucket.list_multipart(ROOT + "/"))).initiated
    assert started is not None
    old = collect_garbage(bucket, ROOT, options, now=started + 3660)
    assert [u for u, _, _ in old.uploads] == [bucket.url(upload.key)] and not old.kept
    assert list(bucket.list_multipart(ROOT + "/")) == []


def test_find_leftovers_ages_an_uncommitted_prefix_by_its_newest_object(bucket: Store) -> None:
    bucket.put(f"{ROOT}/step-000000005/a.bin", b"a")
    bucket.put(f"{ROOT}/step-000000005/b.bin", b"bb")
    newest = max(o.mtime or 0 for o in bucket.list(f"{ROOT}/step-000000005/"))
    (found,) = find_leftovers(bucket, ROOT, grace_seconds=60, now=newest + 90)
    assert (found.kind, found.objects, found.bytes, found.kept) == ("prefix", 2, 3, False)
    assert found.age_s == pytest.approx(90)
    (young,) = find_leftovers(bucket, ROOT, grace_seconds=60, now=newest + 30)
    assert young.kept
