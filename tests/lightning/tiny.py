"""A tiny LightningModule and data for real Trainer runs on CPU (importable by subprocesses)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
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
