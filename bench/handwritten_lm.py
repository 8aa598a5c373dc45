"""The benchmark's `lm` baseline: a nanoGPT-style DDP training loop written by hand, with nothing
from the template, for the template's language-model recipe (docs/recipes/language-model.md).

    torchrun --nproc_per_node=2 bench/handwritten_lm.py --data <bake>/data/chars --seed 1

The same work as the recipe's run with the template's defaults: a GPT of the same architecture
and initialisation as the template's model.name=gpt (ddpkit/lm.py; 4 pre-norm blocks 128 wide,
2 heads, context 128, dropout 0.1, the head tied to the token embedding), windows of
train.bin (np.memmap) drawn at random per rank with torch.randint, a global batch of 64,
AdamW as the template builds it by default (the recipe's lr 0.001; torch's betas and eps;
weight decay 0.01 on the matrices and embeddings, none on biases and LayerNorm weights;
fused), linear warmup then cosine to 0 (nanoGPT's get_lr, with the template's formula),
gradients clipped to norm 1.0. At the end: the loss over every consecutive window of val.bin
(each rank its contiguous share, batches of 256), and a checkpoint (model and optimizer)
written by rank 0 with torch.save, as the template's run ends with a validation and a
checkpoint.

Rank 0 prints JSON lines for bench.py: {"first_step": unix time}, then one {"epoch": 1,
"seconds", "train_seconds", "steps", "loss", "window_losses", "steady_seconds_per_step",
"val_loss"}. window_losses is what the template's train_log.jsonl logs as `loss`: the mean
training loss over all ranks of the steps of each window, windows ending at step 1 and every
--log-every steps (and the last step). steady_seconds_per_step is the time per step after the
first --log-every steps, the windows the bench times on both sides.
"""

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.c_proj = nn.Linear(4 * width, width, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = CausalSelfAttention(width, heads, dropout), MLP(width, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, width: int, layers: int, heads: int,
                 dropout: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for name, p in self.named_parameters():  # GPT-2's init, residual projections scaled
            if p.dim() >= 2:
                scaled = name.endswith("c_proj.weight")
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if scaled else 0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def get_lr(it: int, args) -> float:
    """Linear warmup over --warmup steps, then cosine from --lr to 0 at the last step."""
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    progress = min(1.0, (it - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def get_batch(data: np.ndarray, block_size: int, batch_size: int):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                     for i in ix])
    return x, y


def configure_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """Decay on every matrix and embedding, none on biases and LayerNorm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, fused=True)


@torch.no_grad()
def val_loss(model: nn.Module, data: np.ndarray, args, rank: int, world: int) -> float:
    """The mean loss over every consecutive window of the split, each rank its share."""
    model.eval()
    windows = (len(data) - 1) // args.block_size
    first, end = rank * windows // world, (rank + 1) * windows // world
    totals = torch.zeros(2, dtype=torch.float64)  # summed loss, tokens
    for lo in range(first, end, args.eval_batch_size):
        starts = range(lo * args.block_size, min(lo + args.eval_batch_size, end) * args.block_size,
                       args.block_size)
        rows = torch.stack([torch.from_numpy(data[s:s + args.block_size + 1].astype(np.int64))
                            for s in starts])
        logits = model(rows[:, :-1])
        totals[0] += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(),
                                     reduction="sum").item()
        totals[1] += rows[:, 1:].numel()
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True, help="train.bin, val.bin, meta.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64, help="global, over all ranks")
    parser.add_argument("--eval-batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()
    if args.steps <= args.log_every:
        parser.error("--steps must be above --log-every: the steps after the first window "
                     "are the ones timed")
    return args


def main():
    args = parse_args()
    ddp = "LOCAL_RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(1000 * args.seed + rank)  # each rank its own windows and dropout

    meta = json.loads((args.data / "meta.json").read_text())
    train_data = np.memmap(args.data / "train.bin", dtype=meta["dtype"], mode="r")
    val_data = np.memmap(args.data / "val.bin", dtype=meta["dtype"], mode="r")
    bare = GPT(meta["vocab_size"], args.block_size, args.width, args.layers,
               args.width // 64 if args.width % 64 == 0 else 1, args.dropout)
    model = DDP(bare) if ddp else bare  # DDP starts every rank from rank 0's weights
    optimizer = configure_optimizer(bare, args)

    start = time.perf_counter()
    window, window_losses, steady_start = torch.zeros(2), {}, None
    for it in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, args)
        x, y = get_batch(train_data, args.block_size, args.batch_size // world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step = it + 1
        window += torch.stack([loss.detach(), torch.ones(())])
        if step == 1 and rank == 0:
            print(json.dumps({"first_step": time.time()}), flush=True)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            if ddp:
                dist.all_reduce(window)
            window_losses[step] = (window[0] / window[1]).item()
            window.zero_()
            if step == args.log_every:
                steady_start = time.perf_counter()
    train_seconds = time.perf_counter() - start
    steady = (time.perf_counter() - steady_start) / (args.steps - args.log_every)

    validation = val_loss(bare, val_data, args, rank, world)
    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="handwritten-lm-") as folder:
            torch.save({"model": bare.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": args.steps}, os.path.join(folder, "ckpt.pt"))
    if ddp:
        dist.barrier()
    if rank == 0:
        print(json.dumps({"epoch": 1, "seconds": time.perf_counter() - start,
                          "train_seconds": train_seconds, "steps": args.steps,
                          "loss": window_losses[args.steps], "window_losses": window_losses,
                          "steady_seconds_per_step": steady, "val_loss": validation}),
              flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
