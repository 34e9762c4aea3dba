"""A Lightning `Trainer` script as users write them: a LightningModule with its own
training and validation steps, a DataModule with 2 workers, Adam and a StepLR scheduler,
validation after every epoch and checkpoints. Seeds itself (``L.seed_everything``)."""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Shapes(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = (self.x[:, 0].mean((1, 2)) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].flip(-1) if torch.rand(()) < 0.5 else self.x[i]  # worker-seeded draw
        return x, self.y[i]


class Data(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Shapes(64, 1), batch_size=8, shuffle=True, num_workers=2)

    def val_dataloader(self):
        return DataLoader(Shapes(32, 2), batch_size=16, num_workers=2)


class LitNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=args.root, accumulate_grad_batches=args.accumulate,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitNet(), datamodule=Data())
