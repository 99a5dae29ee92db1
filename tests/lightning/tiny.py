"""A tiny LightningModule and data for real Trainer runs on CPU (importable by subprocesses)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Tiny(LightningModule):
    """Linear regression; logs ``score`` = epoch so top-k rotation is deterministic."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)
        self.started_at_epoch: int | None = None

    def on_train_start(self) -> None:
        self.started_at_epoch = self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("score", float(self.current_epoch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, self.hparams.width, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)

    def val_dataloader(self):
        x = torch.randn(16, self.hparams.width)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def top_k_and_last(dirpath: str, storage_options: dict[str, Any], **overrides: Any) -> Any:
    """A ``CloudModelCheckpoint`` of ``epoch=N.ckpt`` files, the top 2 by ``score`` (the
    newest), and ``last.ckpt`` at ``dirpath``; ``overrides`` change any argument."""
    from cloudckpt.lightning import CloudModelCheckpoint

    kwargs: dict[str, Any] = {"filename": "{epoch}", "monitor": "score", "mode": "max"}
    kwargs |= {"save_top_k": 2, "save_last": True, "storage_options": storage_options}
    return CloudModelCheckpoint(dirpath=dirpath, **(kwargs | overrides))


def cpu_trainer(epochs: int, callbacks: list[Any], io: Any) -> Trainer:
    """A quiet Trainer of ``epochs`` on one CPU with ``callbacks`` and the checkpoint I/O
    plugin ``io``."""
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[io],
    )
