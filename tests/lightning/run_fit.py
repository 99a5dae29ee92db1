"""Run Trainer.fit in its own process (DDP re-launches this script for rank 1).

    python run_fit.py DIRPATH EPOCHS STORAGE_OPTIONS_JSON [--devices N] [--async]
        [--resume] [--hang-on-save N --marker FILE] [--report FILE]

``--hang-on-save N`` blocks the upload of the N-th ``last.ckpt`` forever after touching
``--marker``: the test then kills the process mid-save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(__file__))

from lightning.pytorch import Trainer
from tiny import Tiny

from cloudckpt.lightning import CloudCheckpointIO, CloudModelCheckpoint
from cloudckpt.store.s3 import S3Store


def hang_on(n: int, marker: str) -> None:
    real_put = S3Store.put
    seen = 0

    def put(self, key, data, **kwargs):
        nonlocal seen
        if key.endswith("last.ckpt"):
            seen += 1
            if seen == n:
                with open(marker, "w") as f:
                    f.write("uploading")
                threading.Event().wait()  # never returns: the test kills us here
        return real_put(self, key, data, **kwargs)

    S3Store.put = put  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("epochs", type=int)
    p.add_argument("storage_options")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hang-on-save", type=int, default=0)
    p.add_argument("--marker", default="")
    p.add_argument("--report", default="")
    args = p.parse_args()
    opts = json.loads(args.storage_options)
    if args.hang_on_save:
        hang_on(args.hang_on_save, args.marker)
    callback = CloudModelCheckpoint(
        dirpath=args.dirpath,
        filename="{epoch}",
        monitor="score",
        mode="max",
        save_top_k=2,
        save_last=True,
        storage_options=opts,
    )
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        plugins=[CloudCheckpointIO(async_save=args.async_save, storage_options=opts)],
    )
    model = Tiny()
    trainer.fit(model, ckpt_path="last" if args.resume else None)
    if args.report and trainer.is_global_zero:
        with open(args.report, "w") as f:
            json.dump(
                {"started_at_epoch": model.started_at_epoch, "world_size": trainer.world_size}, f
            )
    # As torch asks of every trainer process: gloo's worker threads, left to the
    # interpreter's exit, can abort the process ("terminate called without an active
    # exception") after the run has succeeded.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
