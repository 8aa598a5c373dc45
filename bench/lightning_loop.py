"""The benchmark's third contender: PyTorch Lightning's Trainer on the same model and data as
handwritten.py (whose data and model builders it imports), launched the same way.

    torchrun --nproc_per_node=2 bench/lightning_loop.py --workload tiny --epochs 12

Needs `pytorch-lightning` (bench/requirements.txt): an extra of the benchmark only, never of a
baked project. Rank 0 prints the same JSON lines as handwritten.py.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten import cnn, digits, mlp, parse_args, random_images


class Classifier(pl.LightningModule):
    def __init__(self, net: torch.nn.Module, lr: float):
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class EpochTimer(pl.Callback):
    """Reports, on rank 0, the end of the first step and each epoch's time (validation
    included: Lightning validates inside the training epoch)."""

    def __init__(self):
        self.first_step_done, self.start = False, 0.0

    def on_train_epoch_start(self, trainer, module):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not self.first_step_done:
            self.first_step_done = True
            if trainer.is_global_zero:
                print(json.dumps({"first_step": time.time()}), flush=True)

    def on_train_epoch_end(self, trainer, module):
        if trainer.is_global_zero:
            print(json.dumps({"epoch": trainer.current_epoch + 1,
                              "seconds": time.perf_counter() - self.start,
                              "loss": float(trainer.callback_metrics["train_loss"])}),
                  flush=True)


def main():
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    torch.manual_seed(0)
    (x_train, y_train), (x_val, y_val) = (digits() if args.workload == "tiny"
                                          else random_images(args.samples))
    train = DataLoader(TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
                       batch_size=args.batch_size // world_size, shuffle=True)
    val = DataLoader(TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)),
                     batch_size=256)
    trainer = pl.Trainer(
        accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=1, strategy="ddp" if world_size > 1 else "auto", max_epochs=args.epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=10,
        callbacks=[EpochTimer()],
    )
    net = mlp() if args.workload == "tiny" else cnn()
    trainer.fit(Classifier(net, args.lr), train, val)


if __name__ == "__main__":
    main()
