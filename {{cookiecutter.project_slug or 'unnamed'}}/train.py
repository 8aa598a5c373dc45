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
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import dist_utils
from config import UserError, load_config
from data import DataModule
from evaluate import evaluate_split, find_checkpoint, restore_model_weights
from metrics import Task, scalars
from model import build_model, unwrap, wrap_model
from speed import FLOAT32, Speed, build_optimizer, describe, grad_scaler, resolve_speed

log = logging.getLogger("ddp")


RUN_ID_FILE = ".torchelastic_run_id"


def create_run_dir(cfg: DictConfig, env: dist_utils.DistEnv) -> Path | None:
    """Rank 0 picks the run folder and returns it; other ranks return None and learn it from
    rank 0, so a job has one folder, never one per process.

    The folder is run.dir when given; else the folder of this torchrun job (found by the run id
    torchrun gives every attempt of a job, so a restarted job finds its checkpoints); else a new
    timestamped one.
    """
    if cfg.run.dir:
        path = Path(cfg.run.dir)
        if cfg.train.resume == "never" and (path / "config.yaml").exists():
            raise UserError(f"run.dir={path} already holds a run and train.resume=never: pick a "
                            "new folder, delete it, or resume it with train.resume=auto")
        if env.is_main:
            path.mkdir(parents=True, exist_ok=True)
        return path if env.is_main else None
    if not env.is_main:
        return None
    output_dir = Path(cfg.run.output_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and cfg.train.resume != "never":
        for marker in output_dir.glob(f"*/{RUN_ID_FILE}"):
            if marker.read_text() == run_id:
                return marker.parent
    base = output_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):  # another run may have started in the same second
        path = base.with_name(f"{base.name}-{attempt}") if attempt else base
        try:
            path.mkdir()
        except FileExistsError:
            continue
        if run_id:
            (path / RUN_ID_FILE).write_text(run_id)
        return path
    raise UserError(f"cannot create a new run folder next to {base}: too many exist")


def checkpoint_to_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """train.resume: auto -> this run's latest checkpoint (None for a new run); never -> None;
    anything else -> that checkpoint file, or that run folder's latest checkpoint. Once this run
    has checkpoints of its own (a torchrun restart), its latest one wins over both."""
    if cfg.train.resume == "never":
        return None
    found = dist_utils.list_checkpoints(run_dir / "checkpoints")
    if found or cfg.train.resume == "auto":
        return found[-1] if found else None
    path = find_checkpoint(cfg.train.resume)
    if not path.exists():
        raise UserError(f"train.resume={cfg.train.resume}: no such checkpoint file or run folder")
    return path


def truncate_log(path: Path, keep) -> None:
    """Drop the records a resumed run will write again (rank 0, atomically)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if keep(json.loads(line))]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        tmp.replace(path)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
               task: Task, device: torch.device, speed: Speed = FLOAT32,
               scaler: torch.amp.GradScaler | None = None,
               grad_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches. Returns [loss sum, correct, samples]
    and the gradient norm before clipping (None without clipping), both left on the device:
    reading them would make the CPU wait for the GPU.

    With several micro-batches (gradient accumulation) the gradients are all-reduced once, on
    the last one: the others run forward *and* backward inside no_sync(), since DDP decides in
    forward whether the coming backward will communicate.
    """
    samples = sum(targets.shape[0] for _, targets in micro_batches)
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    optimizer.zero_grad(set_to_none=True)
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = speed.inputs(inputs.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        last = index == len(micro_batches) - 1
        skip_sync = not last and hasattr(model, "no_sync")
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with speed.autocast(device):
                outputs = model(inputs)
                # Sum over the micro-batch / samples of the whole step: the accumulated gradient
                # is that of the mean over the step's batch, as without accumulation.
                loss = task.loss(outputs, targets, reduction="sum") / samples
            # On the last micro-batch DDP averages the gradients over ranks.
            (scaler.scale(loss) if scaler else loss).backward()
        with torch.no_grad():
            stats[0] += loss.detach().double() * samples
            if task.is_classification:
                stats[1] += task.correct(outputs, targets)
    grad_norm = None
    if grad_clip:
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        # The gradients are already averaged over ranks, so every rank computes the same norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler:
        scaler.step(optimizer)  # skipped if fp16 overflowed; the scale then shrinks
        scaler.update()
    else:
        optimizer.step()
    stats[2] += samples
    return stats, grad_norm


def main(argv: list[str]) -> None:
    env = dist_utils.get_dist_env()
    cfg = load_config(argv, world_size=env.world_size)
    dist_utils.setup_logging(env)
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)

    with dist_utils.agree_on_errors():  # bad input stops every rank together, reported once
        torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP syncs them too)
        data = DataModule(cfg, env, device)
        model = build_model(cfg.model, data.input_shape, data.task.num_outputs)
        speed = resolve_speed(cfg, device, data.input_shape)
        run_dir = create_run_dir(cfg, env)
    run_dir = Path(dist_utils.broadcast_object(str(run_dir) if env.is_main else None))
    # Per-rank seed from here on: dropout masks differ between ranks, as they would between
    # the samples of one big batch on one process.
    torch.manual_seed(cfg.run.seed + env.rank)

    task = data.task
    total_steps = cfg.train.epochs * data.steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    with dist_utils.agree_on_errors():
        resume_from = checkpoint_to_resume(cfg, run_dir)
        state = dist_utils.load_checkpoint(resume_from) if resume_from else None
        if state:  # into the bare model, before DDP copies rank 0's weights to every rank
            restore_model_weights(model, state, resume_from)
    model = wrap_model(model, cfg, env, device, speed)
    optimizer = build_optimizer(model, cfg, speed)
    scaler = grad_scaler(speed, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, cfg.optim.warmup_steps, total_steps, cfg.optim.schedule))
    step, epoch, step_in_epoch = 0, 0, 0
    if state:
        with dist_utils.agree_on_errors():
            try:
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
                if scaler and state.get("scaler"):
                    scaler.load_state_dict(state["scaler"])
                step, epoch, step_in_epoch = (int(state[k]) for k in
                                              ("step", "epoch", "step_in_epoch"))
            except (KeyError, ValueError, TypeError) as error:
                raise UserError(f"cannot resume from {resume_from}: its optimizer or position "
                                f"does not fit this run ({error})") from None
        if state.get("world_size") == env.world_size and "rng" in state:
            dist_utils.set_rng_state(state["rng"][env.rank])
        else:
            log.warning("resuming %d process(es) from a checkpoint of %d: model, optimizer and "
                        "data position carry over; random streams (dropout) start afresh",
                        env.world_size, state.get("world_size"))
        log.info("resumed from %s: step %d, epoch %d, %d step(s) into it", resume_from, step,
                 epoch + 1, step_in_epoch)

    first_step = step
    if env.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        if state:  # what comes after the checkpoint will be logged again
            truncate_log(run_dir / "train_log.jsonl", lambda record: record["step"] <= step)
            truncate_log(run_dir / "metrics.jsonl", lambda record: record["step"] < step)
    tensorboard = []  # rank 0's SummaryWriter, made at the first record: not before step 1

    def writer():
        if env.is_main and not tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported by rank 0 only

            # purge_step: TensorBoard hides what a previous attempt logged after the checkpoint.
            tensorboard.append(SummaryWriter(log_dir=str(run_dir / "tb"),
                                             purge_step=first_step + 1 if state else None))
        return tensorboard[0] if tensorboard else None

    log.info("run folder: %s", run_dir)
    log.info("%d process(es) on %s, backend %s, %s | %s, %d outputs | %d steps per epoch, "
             "%d steps", env.world_size, device, dist_utils.backend_name(), describe(speed),
             task.kind, task.num_outputs, data.steps_per_epoch, total_steps)
    log.info("effective global batch %d = %d per micro-batch x %d process(es) x %d "
             "accumulation step(s)", data.micro_batch_size * env.world_size
             * cfg.train.grad_accum_steps, data.micro_batch_size, env.world_size,
             cfg.train.grad_accum_steps)

    def save() -> None:
        """A checkpoint from which training continues exactly (collective: every rank)."""
        rng = dist_utils.gather_objects(dist_utils.rng_state())  # each rank's generators
        folder = run_dir / "checkpoints"
        dist_utils.save_checkpoint({
            "model": dist_utils.clean_state_dict(unwrap(model).state_dict()),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler else None,  # fp16 loss scaling
            "step": step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "world_size": env.world_size,
            "rng": rng,
            "config": OmegaConf.to_container(cfg),
        }, folder / f"step-{step:08d}.pt")
        dist_utils.prune_checkpoints(folder, cfg.train.keep_checkpoints)

    last_saved = step if state else -1
    # Training sums stay on the device: reading them waits for the GPU, so that happens only
    # when a window of train.log_every steps (or the rest of an epoch) is logged. Its all-reduce
    # (which makes the sums global) runs in the background while training goes on; a window is
    # written out when the next one starts, or before a checkpoint or an epoch's record.
    window = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    window_steps, window_start = 0, time.perf_counter()
    epoch_totals = [0.0, 0.0, 0.0]
    grad_norm = None
    in_flight = []  # windows being all-reduced: (handle, sums, record, grad_norm)

    def flush_window() -> None:
        nonlocal window_steps, window_start
        if window_steps:  # the same on every rank, so all of them start the all-reduce
            sums = window.clone()
            window.zero_()
            record = {"step": step, "lr": scheduler.get_last_lr()[0], "time": time.time(),
                      "seconds": time.perf_counter() - window_start}
            # clip_grad_norm_ returns a new tensor each step: keeping it needs no copy.
            in_flight.append((dist_utils.all_reduce_sum_async(sums), sums, record, grad_norm))
            window_steps, window_start = 0, time.perf_counter()
        while len(in_flight) > 1:
            write_window(*in_flight.pop(0))

    def write_windows() -> None:
        """Write out every window still in flight (waits for their all-reduces)."""
        while in_flight:
            write_window(*in_flight.pop(0))

    def write_window(handle, sums, record, norm) -> None:
        if handle is not None:
            handle.wait()
        loss_sum, correct, count = sums.tolist()
        for i, value in enumerate((loss_sum, correct, count)):
            epoch_totals[i] += value
        seconds, now, step = record.pop("seconds"), record.pop("time"), record["step"]
        record.update(loss=loss_sum / count, samples_per_s=count / seconds)
        if task.is_classification:
            record["accuracy"] = correct / count
        if norm is not None:
            record["grad_norm"] = norm.item()  # before clipping; the same on every rank
        if not math.isfinite(record["loss"]):  # the same all-reduced value on every rank
            raise UserError(
                f"training diverged: the loss is {record['loss']} at step {step}; lower optim.lr"
                ", set optim.grad_clip (e.g. 1.0) or use speed.precision=bf16 or fp32")
        if env.is_main:
            for name, value in record.items():
                if name != "step":
                    writer().add_scalar(f"train/{name}", value, step)
            with open(run_dir / "train_log.jsonl", "a") as log_file:
                log_file.write(json.dumps({**record, "time": now}) + "\n")
        bar.set_postfix(loss=f"{record['loss']:.4f}")

    while epoch < cfg.train.epochs and step < total_steps:
        model.train()
        epoch_totals[:] = [0.0, 0.0, 0.0]
        show_bar = env.is_main and cfg.train.progress_bar and sys.stderr.isatty()
        bar = tqdm(total=data.steps_per_epoch, initial=step_in_epoch, leave=False,
                   desc=f"epoch {epoch + 1}/{cfg.train.epochs}", disable=not show_bar)
        epoch_start = time.perf_counter()
        for micro_batches in data.train_steps(epoch, skip_steps=step_in_epoch):
            stats, grad_norm = train_step(model, optimizer, micro_batches, task, device, speed,
                                          scaler, cfg.optim.grad_clip)
            window += stats
            window_steps += 1
            scheduler.step()
            step += 1
            step_in_epoch += 1
            bar.update()
            # The first step is logged too: it shows when training really started.
            if step % cfg.train.log_every == 0 or step == first_step + 1:
                flush_window()
            if cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0:
                write_windows()  # the log holds every step up to the checkpoint
                save()
                last_saved = step
            if step == total_steps:
                break
        flush_window()
        bar.close()

        # Validation: the exact path of evaluate.py, on the unwrapped model.
        val = scalars(evaluate_split(unwrap(model), data.eval_loader("val"), device, task,
                                     speed))
        write_windows()
        loss_sum, correct, count = epoch_totals
        record = {"epoch": epoch + 1, "step": step,
                  "epoch_seconds": time.perf_counter() - epoch_start}
        if count:
            record["train_loss"] = loss_sum / count
            if task.is_classification:
                record["train_accuracy"] = correct / count
        record.update({f"val_{name}": value for name, value in val.items()})
        if env.is_main:
            for name, value in val.items():
                writer().add_scalar(f"val/{name}", value, step)
            with open(run_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
        log.info("epoch %3d/%d  step %5d  %s", epoch + 1, cfg.train.epochs, step, "  ".join(
            f"{name} {value:.4f}" for name, value in record.items() if isinstance(value, float)))
        if step_in_epoch >= data.steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0

    if last_saved != step:
        save()
    if tensorboard:
        tensorboard[0].close()
    log.info("done: checkpoints in %s, TensorBoard logs in %s", run_dir / "checkpoints",
             run_dir / "tb")
    log.info("evaluate with: ./run.sh evaluate.py eval.checkpoint=%s", run_dir)


if __name__ == "__main__":
    dist_utils.run_main(main)
