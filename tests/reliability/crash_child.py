"""A process that saves a checkpoint and SIGKILLs itself at a chosen point.

    python crash_child.py URL STORAGE_OPTIONS_JSON save|async|dcp|retain METHOD:N:before|after

(tests/reliability/test_crash.py runs :func:`run` in a forked child instead: the same
code, without a second interpreter importing torch.)

METHOD is a Store method (create_multipart, upload_part, complete_multipart, put, delete);
the process dies just before or just after its N-th call: the same as an external
SIGKILL at that moment, but at a point the test chose. ``upload_part`` counts parts
sent either way (``upload_part`` or, for scatter lists, ``upload_part_views``). The
public methods live on the ``Store`` base class, so one patch there arms every backend
(filesystem, S3, GCS, Azure) alike.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import cloudckpt
from cloudckpt.store.azure import AzureStore
from cloudckpt.store.base import Store
from cloudckpt.store.gcs import GCSStore
from cloudckpt.store.local import LocalStore
from cloudckpt.store.s3 import S3Store

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dcp_compat import SINGLE

BACKENDS = (LocalStore, S3Store, GCSStore, AzureStore)


def arm(method: str, n: int, when: str) -> None:
    names = [method, "upload_part_views"] if method == "upload_part" else [method]
    calls = 0
    for name in names:
        overriding = [cls.__name__ for cls in BACKENDS if name in vars(cls)]
        if overriding:  # the patch on Store would miss their calls
            raise AssertionError(f"{name} is overridden by {overriding}; arm it there too")
        real = getattr(Store, name)

        def wrapper(self, *args, real=real, **kwargs):
            nonlocal calls
            calls += 1
            if calls == n and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(self, *args, **kwargs)
            if calls == n and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(Store, name, wrapper)


def new_state() -> dict:
    return {f"t{i}": torch.full((1 << 20,), float(i + 100)) for i in range(3)}  # 12 MiB


def main() -> None:
    run(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4])


def run(url: str, options: dict, mode: str, point: str) -> None:
    """Save (``mode``) to ``url``, dying by SIGKILL at ``point``."""
    method, n, when = point.split(":")
    arm(method, int(n), when)
    opts = {"storage_options": options, "part_size": 5 << 20, "write_concurrency": 1}
    if mode == "save":
        cloudckpt.save(new_state(), url, **opts)
    elif mode == "async":
        cloudckpt.async_save(new_state(), url, **opts).result()
    elif mode == "dcp":  # URL is the new checkpoint's prefix
        import torch.distributed.checkpoint as dcp

        from cloudckpt.dcp import CloudStorageWriter

        dcp.save(new_state(), storage_writer=CloudStorageWriter(url, **opts), **SINGLE)
    else:  # "retain": URL is a manager root holding step 1; step 2 commits, then prunes 1
        manager = cloudckpt.CheckpointManager(url, keep_last=1, **opts)
        manager.save(2, new_state())


if __name__ == "__main__":
    main()
