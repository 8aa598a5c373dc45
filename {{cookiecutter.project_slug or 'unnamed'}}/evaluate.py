"""Evaluate a checkpoint on the test (or val) split, with one process or many.

    python evaluate.py eval.checkpoint=runs/<run>             # one process
    ./run.sh evaluate.py eval.checkpoint=runs/<run>           # torchrun, as many as run.sh says

Each rank evaluates its own block of the split (no sample twice, none padded in) and the ranks
add up sums and counts, so the numbers are those of a single-process evaluation whatever the
process count. Writes metrics.json next to the run and prints a summary on rank 0.
"""

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

import dist_utils
from config import UserError, config_from_dict, load_config
from data import DataModule
from model import build_model

log = logging.getLogger("ddp")


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, loader, device: torch.device) -> dict:
    """Loss and accuracy over the whole split: per-rank sums, then one all-reduce.

    Every rank makes exactly one collective call here, however many batches its shard has, so
    uneven shards cannot hang. Pass the unwrapped model: DDP's forward may sync buffers, which
    would need every rank to run the same number of batches.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for inputs, targets in loader:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(inputs)
        # Summed in float64: the total then barely depends on how the split was sharded.
        totals[0] += F.cross_entropy(logits.double(), targets, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == targets).sum()
        totals[2] += targets.numel()
    loss_sum, correct, count = dist_utils.all_reduce_sum(totals).tolist()
    model.train(was_training)
    count = max(count, 1.0)
    return {"loss": loss_sum / count, "accuracy": correct / count, "num_samples": int(count)}


def find_checkpoint(spec: str) -> Path:
    """A checkpoint file, or the latest `step-*.pt` of a run folder."""
    if not spec:
        raise UserError("eval.checkpoint is not set: pass eval.checkpoint=<run folder or .pt file>")
    path = Path(spec)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = sorted(folder.glob("step-*.pt"))  # zero-padded step numbers sort in order
        if not found:
            raise UserError(f"no checkpoint in {path}: expected {folder}/step-*.pt")
        return found[-1]
    return path


def default_output_dir(checkpoint: Path, split: str) -> Path:
    in_run = checkpoint.parent.name == "checkpoints"
    return (checkpoint.parent.parent if in_run else checkpoint.parent) / f"eval-{split}"


def restore_model(state: dict, train_cfg: DictConfig, data: DataModule, source: Path):
    model = build_model(train_cfg.model, data.num_features, data.num_classes)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:  # missing / unexpected keys, shape mismatch
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"checkpoint {source} does not fit the model it names: {detail}") from None
    return model


def main(argv: list[str]) -> None:
    cfg = load_config(argv)
    env = dist_utils.get_dist_env()
    dist_utils.setup_logging(env)
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)

    with dist_utils.agree_on_errors():  # a bad checkpoint stops every rank, reported once
        checkpoint = find_checkpoint(cfg.eval.checkpoint)
        state = dist_utils.load_checkpoint(checkpoint)
        train_cfg = config_from_dict(state.get("config", {}), f"config stored in {checkpoint}")
        train_cfg.eval = cfg.eval  # model and data as trained; evaluation settings from this call
        data = DataModule(train_cfg, env, device)
        model = restore_model(state, train_cfg, data, checkpoint)
    # No DDP wrapper: evaluation computes no gradients, and the weights are the same everywhere.
    model = model.to(device)
    start = time.perf_counter()
    metrics = evaluate_split(model, data.eval_loader(cfg.eval.split), device)
    seconds = time.perf_counter() - start

    if env.is_main:
        out_dir = Path(cfg.eval.output_dir) if cfg.eval.output_dir else default_output_dir(
            checkpoint, cfg.eval.split)
        report = {
            "checkpoint": str(checkpoint), "step": state.get("step"), "split": cfg.eval.split,
            "world_size": env.world_size, **metrics,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / ".metrics.json.tmp"
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out_dir / "metrics.json")
        log.info("evaluated %s on the %s split: %d samples, %d process(es), %.2fs",
                 checkpoint, cfg.eval.split, metrics["num_samples"], env.world_size, seconds)
        log.info("  %-10s %.4f", "loss", metrics["loss"])
        log.info("  %-10s %.4f", "accuracy", metrics["accuracy"])
        log.info("metrics: %s", out_dir / "metrics.json")


if __name__ == "__main__":
    dist_utils.run_main(main)
