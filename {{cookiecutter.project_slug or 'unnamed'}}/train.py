"""Train the model, on one process or many.

    python train.py                      # one process: CPU, or the first GPU
    ./run.sh                             # torchrun: one process per GPU (see run.sh)
    ./run.sh train.epochs=50 optim.lr=0.001 --config configs/my_experiment.yaml

Each run gets one folder, runs/<run.name>-<time>/ (chosen by rank 0 and shared with the others),
holding config.yaml, checkpoints/, tb/ (TensorBoard) and metrics.jsonl. Only rank 0 writes.
The distributed parts are the few lines that mention dist_utils, the sampler's epoch and DDP.
"""

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import dist_utils
from config import UserError, load_config
from data import DataModule
from evaluate import evaluate_split
from metrics import Task, scalars
from model import build_model, unwrap, wrap_model

log = logging.getLogger("ddp")


def create_run_dir(cfg: DictConfig, env: dist_utils.DistEnv) -> Path | None:
    """Rank 0 creates the run folder (run.dir, or a new timestamped one) and returns it.

    Other ranks return None and learn the path from rank 0, so a job has one folder, never one
    per process (and never two that differ by a second between ranks' clocks).
    """
    if cfg.run.dir:
        path = Path(cfg.run.dir)
        if (path / "config.yaml").exists():
            raise UserError(f"run.dir={path} already holds a run: pick a new folder or delete it")
        if env.is_main:
            path.mkdir(parents=True, exist_ok=True)
        return path if env.is_main else None
    if not env.is_main:
        return None
    base = Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):  # another run may have started in the same second
        path = base.with_name(f"{base.name}-{attempt}") if attempt else base
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"cannot create a new run folder next to {base}: too many exist")


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
               task: Task, device: torch.device) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns [loss sum, correct, samples].

    With several micro-batches (gradient accumulation) the gradients are all-reduced once, on
    the last one: the others run forward *and* backward inside no_sync(), since DDP decides in
    forward whether the coming backward will communicate.
    """
    samples = sum(targets.shape[0] for _, targets in micro_batches)
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    optimizer.zero_grad(set_to_none=True)
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        last = index == len(micro_batches) - 1
        skip_sync = not last and hasattr(model, "no_sync")
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            outputs = model(inputs)
            # Sum over the micro-batch / samples of the whole step: the accumulated gradient is
            # that of the mean over the step's batch, as without accumulation.
            loss = task.loss(outputs, targets, reduction="sum") / samples
            loss.backward()  # on the last micro-batch DDP averages the gradients over ranks
        with torch.no_grad():
            stats[0] += loss.detach().double() * samples
            if task.is_classification:
                stats[1] += task.correct(outputs, targets)
    optimizer.step()
    stats[2] += samples
    return stats


def main(argv: list[str]) -> None:
    env = dist_utils.get_dist_env()
    cfg = load_config(argv, world_size=env.world_size)
    dist_utils.setup_logging(env)
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)

    with dist_utils.agree_on_errors():  # bad input stops every rank together, reported once
        torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP syncs them too)
        data = DataModule(cfg, env, device)
        model = build_model(cfg.model, data.num_features, data.task.num_outputs)
        run_dir = create_run_dir(cfg, env)
    run_dir = Path(dist_utils.broadcast_object(str(run_dir) if env.is_main else None))
    # Per-rank seed from here on: dropout masks differ between ranks, as they would between
    # the samples of one big batch on one process.
    torch.manual_seed(cfg.run.seed + env.rank)

    model = wrap_model(model, cfg, env, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  weight_decay=cfg.optim.weight_decay)
    total_steps = cfg.train.epochs * data.steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, cfg.optim.warmup_steps, total_steps, cfg.optim.schedule))
    task = data.task

    writer = None
    if env.is_main:
        from torch.utils.tensorboard import SummaryWriter  # imported by the writing rank only

        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    log.info("run folder: %s", run_dir)
    log.info("%d process(es) on %s, backend %s | %s, %d outputs | %d steps per epoch, %d steps",
             env.world_size, device, dist_utils.backend_name(), task.kind, task.num_outputs,
             data.steps_per_epoch, total_steps)
    log.info("effective global batch %d = %d per micro-batch x %d process(es) x %d "
             "accumulation step(s)", data.micro_batch_size * env.world_size
             * cfg.train.grad_accum_steps, data.micro_batch_size, env.world_size,
             cfg.train.grad_accum_steps)

    def save(step: int, epoch: int) -> None:
        dist_utils.save_checkpoint({
            "model": dist_utils.clean_state_dict(unwrap(model).state_dict()),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "epoch": epoch,
            "config": OmegaConf.to_container(cfg),
        }, run_dir / "checkpoints" / f"step-{step:08d}.pt")

    step, last_saved = 0, -1
    # Training sums stay on the device: reading them (.tolist()) waits for the GPU, so that is
    # done only every log_every steps and at the end of an epoch, with the all-reduce that
    # makes them global.
    window = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    window_start = time.perf_counter()
    epoch_totals = [0.0, 0.0, 0.0]

    def flush_window() -> None:
        nonlocal window_start
        loss_sum, correct, count = dist_utils.all_reduce_sum(window).tolist()
        window.zero_()
        if count == 0:
            return
        elapsed = time.perf_counter() - window_start
        window_start = time.perf_counter()
        for i, value in enumerate((loss_sum, correct, count)):
            epoch_totals[i] += value
        record = {"step": step, "loss": loss_sum / count, "lr": scheduler.get_last_lr()[0],
                  "samples_per_s": count / elapsed}
        if task.is_classification:
            record["accuracy"] = correct / count
        if writer:
            for name, value in record.items():
                if name != "step":
                    writer.add_scalar(f"train/{name}", value, step)
            with open(run_dir / "train_log.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{record['loss']:.4f}")

    for epoch in range(cfg.train.epochs):
        model.train()
        epoch_totals[:] = [0.0, 0.0, 0.0]
        show_bar = env.is_main and cfg.train.progress_bar and sys.stderr.isatty()
        bar = tqdm(total=data.steps_per_epoch, desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
                   leave=False, disable=not show_bar)
        for micro_batches in data.train_steps(epoch):
            window += train_step(model, optimizer, micro_batches, task, device)
            scheduler.step()
            step += 1
            bar.update()
            if step % cfg.train.log_every == 0:
                flush_window()
            if cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0:
                save(step, epoch)
                last_saved = step
            if step == total_steps:
                break
        flush_window()
        bar.close()

        loss_sum, correct, count = epoch_totals
        # Validation: the exact path of evaluate.py, on the unwrapped model.
        val = scalars(evaluate_split(unwrap(model), data.eval_loader("val"), device, task))
        record = {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / count}
        if task.is_classification:
            record["train_accuracy"] = correct / count
        record.update({f"val_{name}": value for name, value in val.items()})
        if writer:
            for name, value in val.items():
                writer.add_scalar(f"val/{name}", value, step)
            with open(run_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
        log.info("epoch %3d/%d  step %5d  %s", epoch + 1, cfg.train.epochs, step, "  ".join(
            f"{name} {value:.4f}" for name, value in record.items() if isinstance(value, float)))
        if step == total_steps:
            break

    if last_saved != step:
        save(step, epoch + 1)
    if writer:
        writer.close()
    log.info("done: checkpoints in %s, TensorBoard logs in %s", run_dir / "checkpoints",
             run_dir / "tb")
    log.info("evaluate with: ./run.sh evaluate.py eval.checkpoint=%s", run_dir)


if __name__ == "__main__":
    dist_utils.run_main(main)
