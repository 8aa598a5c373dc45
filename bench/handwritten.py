"""The baseline of the benchmark: the DDP training script a user would write by hand from the
blog post the template grew from (torchrun, LOCAL_RANK, DistributedSampler, DDP), written
plainly and correctly (set_epoch included), with nothing from the template.

    torchrun --nproc_per_node=2 bench/handwritten.py --workload tiny --epochs 12

Same model, data sizes, per-rank batch, optimizer and epochs as the baked project's defaults
(tiny: digits MLP) or its `model.name=cnn data.dataset=images` (cnn). Like the post, it
validates on rank 0 only. Started without torchrun it is one plain process (no DDP); with
--matched it does the work the template does each step (whole batches read by indexing, fused
AdamW, the running training loss and accuracy summed on the device), written inline, so that a
comparison measures the template's machinery alone. Rank 0 prints one JSON line per event for
bench.py:
{"first_step": unix time}, {"epoch": n, "seconds": s, "train_seconds": t, "steps": k, ...}.

--workload gpt is nanoGPT's loop instead (train_gpt): the model and corpus of bench/gpt.py,
each rank drawing its own random windows (get_batch), AdamW with weight decay on the matrices
(fused, as the template's default is; nanoGPT fuses on CUDA only), --steps steps, then
validation on rank 0 and a checkpoint written by rank 0 with torch.save (model and optimizer),
as nanoGPT's train.py does.
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_rest, _, y_rest, _ = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=0.15 / 0.8,
                                                      stratify=y_rest, random_state=0)
    return (x_train, y_train), (x_val, y_val)


def random_images(n=2000, classes=4, size=32):
    # Noisy copies of one random low-resolution pattern per class, as the baked `images` set.
    rng = np.random.default_rng(0)
    label = rng.integers(0, classes, n)
    pattern = rng.standard_normal((classes, 3, 4, 4))
    pattern = np.kron(pattern, np.ones((1, 1, size // 4, size // 4)))
    x = (0.5 * pattern[label] + rng.standard_normal((n, 3, size, size))).astype(np.float32)
    n_test = int(np.ceil(0.2 * n))
    n_val = int(np.ceil(0.15 / 0.8 * (n - n_test)))
    return (x[n_test + n_val:], label[n_test + n_val:]), (x[n_test:n_test + n_val],
                                                          label[n_test:n_test + n_val])


class WholeBatches(TensorDataset):
    """Tensors indexed with a whole batch's indices at once (converted to a tensor once)."""

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices)
        return tuple(tensor[indices] for tensor in self.tensors)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(128, 4),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["tiny", "cnn", "gpt"], default="tiny")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global, over all ranks")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--samples", type=int, default=2000, help="cnn: synthetic images")
    parser.add_argument("--steps", type=int, default=8, help="gpt: optimizer steps")
    parser.add_argument("--matched", action="store_true",
                        help="do what the template does (whole-batch indexing, fused AdamW, "
                        "running training loss and accuracy), so that only the loops differ")
    return parser.parse_args()


def main():
    args = parse_args()

    distributed = "LOCAL_RANK" in os.environ  # under torchrun; else one plain process
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    if args.workload == "gpt":
        train_gpt(args, distributed, rank, world_size, device)
        if distributed:
            dist.destroy_process_group()
        return
    (x_train, y_train), (x_val, y_val) = (digits() if args.workload == "tiny"
                                          else random_images(args.samples))
    train_set = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    val_set = TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    if args.matched:  # one train_set[indices] per batch instead of a collate of samples
        train_set = WholeBatches(*train_set.tensors)
        loader = DataLoader(train_set, batch_size=None, sampler=BatchSampler(
            sampler, args.batch_size // world_size, drop_last=False))
    else:
        loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                            pin_memory=device.type == "cuda")
    val_loader = DataLoader(val_set, batch_size=256)

    model = (mlp() if args.workload == "tiny" else cnn()).to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  fused=args.matched or None)
    bare = model.module if distributed else model

    first_step_done = False
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        sampler.set_epoch(epoch)
        seen = 0
        running = torch.zeros(2, device=device)  # --matched: loss and correct, on the device
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.matched:  # the training loss and accuracy the template logs, kept alike
                with torch.no_grad():
                    running += torch.stack([loss.detach() * len(y),
                                            (logits.argmax(-1) == y).sum()])
            seen += len(y) * world_size
            if not first_step_done:
                first_step_done = True
                if rank == 0:
                    print(json.dumps({"first_step": time.time()}), flush=True)
            if step % 10 == 0 and rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        train_seconds = time.perf_counter() - start
        if rank == 0:  # validation on one process, as in the post
            model.eval()
            correct = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (bare(x.to(device)).argmax(1) == y.to(device)).sum().item()
        if distributed:
            dist.barrier()
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "seconds": time.perf_counter() - start,
                              "train_seconds": train_seconds, "steps": step + 1,
                              "loss": loss.item(), "val_accuracy": correct / len(val_set),
                              "images_per_s": seen / train_seconds}), flush=True)
    if distributed:
        dist.destroy_process_group()


def gpt_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay on the matrices only, fused AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def train_gpt(args, distributed: bool, rank: int, world_size: int, device: torch.device):
    """nanoGPT's loop on bench/gpt.py's model and corpus: random windows per rank, --steps
    steps, validation on rank 0, a torch.save checkpoint by rank 0."""
    import gpt

    stream, end = gpt.corpus(), gpt.held_out()
    train_stream = stream[:end]
    val = gpt.Windows(stream[end:end + gpt.VAL_WINDOWS * gpt.CONTEXT + 1], gpt.CONTEXT)
    model = gpt.GPT().to(device)
    bare = model
    if distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = gpt_optimizer(bare, args.lr)
    generator = torch.Generator().manual_seed(1337 + rank)  # each rank its own windows
    per_rank = args.batch_size // world_size
    start, seconds = time.perf_counter(), []
    for step in range(args.steps):
        began = time.perf_counter()
        starts = torch.randint(len(train_stream) - gpt.CONTEXT, (per_rank,), generator=generator)
        x, y = (t.to(device) for t in gpt.windows(train_stream, starts))
        loss = gpt.lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == 0 and rank == 0:
            print(json.dumps({"first_step": time.time()}), flush=True)
        seconds.append(time.perf_counter() - began)
    train_seconds = time.perf_counter() - start
    if rank == 0:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for index in range(0, len(val), args.batch_size):
                x, y = val[list(range(index, min(index + args.batch_size, len(val))))]
                total += gpt.lm_loss(bare(x.to(device)), y.to(device)).item() * len(x)
        folder = tempfile.mkdtemp(prefix="handwritten-gpt-")
        torch.save({"model": bare.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": args.steps}, os.path.join(folder, "ckpt.pt"))
        shutil.rmtree(folder)
    if distributed:
        dist.barrier()
    if rank == 0:
        print(json.dumps({"epoch": 1, "seconds": time.perf_counter() - start,
                          "train_seconds": train_seconds, "steps": args.steps,
                          "step_seconds": seconds, "loss": loss.item(),
                          "val_loss": total / len(val)}), flush=True)


if __name__ == "__main__":
    main()
