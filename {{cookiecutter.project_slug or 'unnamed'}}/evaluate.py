"""Evaluate a checkpoint on the test (or val) split, with one process or many.

    python evaluate.py eval.checkpoint=runs/<run>             # one process
    ./run.sh evaluate.py eval.checkpoint=runs/<run>           # torchrun, as many as run.sh says

Each rank evaluates its own block of the split (no sample twice, none padded in) and metrics.py
combines the ranks' metric states, so every number (PR curves included) is the one a
single-process evaluation gives, whatever the process count. Rank 0 writes, into
<run>/eval-<split>/: metrics.json, pr_curves.json and pr_curves.png (classification),
TensorBoard scalars and PR curves in tb/, and predictions.npz with eval.save_predictions=true.
"""

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import BatchSampler

import dist_utils
from config import UserError, config_from_dict, load_config
from data import DataModule, EvalShardSampler
from metrics import SplitOutputs, Task, scalars
from model import build_model
from speed import FLOAT32, Speed, resolve_speed

log = logging.getLogger("ddp")


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, loader, device: torch.device, task: Task,
                   speed: Speed = FLOAT32) -> dict:
    """Exact metrics over the whole split (see metrics.py), and the split's `predictions` and
    `targets` in split order (in the data's own units); call it on every rank.

    Pass the unwrapped model: DDP's forward may sync buffers, which would need every rank to run
    the same number of batches, and shards may differ by one sample.
    """
    was_training = model.training
    model.eval()
    outputs = SplitOutputs(task)
    for inputs, targets in loader:
        inputs = speed.inputs(inputs.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        with speed.autocast(device):
            predicted = model(inputs)
        outputs.update(predicted.float(), targets)  # metrics in float64, whatever the autocast
    model.train(was_training)
    sampler = loader.sampler.sampler if isinstance(loader.sampler, BatchSampler) else loader.sampler
    sizes = sampler.block_sizes() if isinstance(sampler, EvalShardSampler) else None
    return outputs.compute(sizes)  # collectives: the same calls on every rank


def find_checkpoint(spec: str) -> Path:
    """A checkpoint file, or the latest `step-*.pt` of a run folder."""
    if not spec:
        raise UserError("eval.checkpoint is not set: pass eval.checkpoint=<run folder or .pt file>")
    path = Path(spec)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = dist_utils.list_checkpoints(folder)
        if not found:
            raise UserError(f"no checkpoint in {path}: expected {folder}/step-*.pt")
        return found[-1]
    return path


def default_output_dir(checkpoint: Path, split: str) -> Path:
    in_run = checkpoint.parent.name == "checkpoints"
    return (checkpoint.parent.parent if in_run else checkpoint.parent) / f"eval-{split}"


def restore_model_weights(model: torch.nn.Module, state: dict, source: Path) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:  # missing / unexpected keys, shape mismatch
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"checkpoint {source} does not fit the model: {detail}") from None


def restore_model(state: dict, train_cfg: DictConfig, data: DataModule, source: Path):
    model = build_model(train_cfg.model, data.input_shape, data.task.num_outputs)
    restore_model_weights(model, state, source)
    return model


def write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


def plot_pr_curves(curves: list, average_precision: list, path: Path, title: str) -> None:
    """One precision-recall curve per class, in one PNG (headless: the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6), dpi=120)
    for cls, (curve, ap) in enumerate(zip(curves, average_precision, strict=True)):
        ax.step(curve["recall"], curve["precision"], where="post", label=f"{cls}: AP {ap:.3f}")
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1.01), ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(title="class", fontsize="small", loc="lower left", ncols=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_tensorboard(out_dir: Path, result: dict, task: Task, step: int, split: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(out_dir / "tb")) as writer:
        for name, value in scalars(result).items():
            writer.add_scalar(f"{split}/{name}", value, step)
        if task.is_classification:
            targets, predictions = result["targets"].cpu(), result["predictions"].cpu()
            for cls in range(task.num_outputs):
                writer.add_pr_curve(f"{split}/pr_curve/class_{cls}", targets == cls,
                                    predictions[:, cls], global_step=step, num_thresholds=201)


def summary_lines(result: dict, task: Task) -> list[str]:
    lines = [f"  {name:<24} {value:.6f}" for name, value in scalars(result).items()]
    if task.is_classification:
        lines.append("  per class:  class  AP        recall")
        matrix = np.array(result["confusion_matrix"])
        recall = matrix.diagonal() / np.maximum(matrix.sum(axis=1), 1)
        for cls, ap in enumerate(result["average_precision_per_class"]):
            lines.append(f"              {cls:>5}  {ap:.6f}  {recall[cls]:.6f}")
    return lines


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
        # Precision and memory format from this call's speed settings (compile is not used).
        speed = resolve_speed(cfg, device, data.input_shape)
    # No DDP wrapper: evaluation computes no gradients, and the weights are the same everywhere.
    model = model.to(device, memory_format=speed.memory_format)
    start = time.perf_counter()
    split, task = cfg.eval.split, data.task
    result = evaluate_split(model, data.eval_loader(split), device, task, speed)
    seconds = time.perf_counter() - start
    if not env.is_main:
        return

    out_dir = Path(cfg.eval.output_dir or default_output_dir(checkpoint, split))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(checkpoint), "step": state.get("step"), "split": split,
              "task": task.kind, "world_size": env.world_size,
              **{k: v for k, v in result.items()
                 if k not in ("pr_curves", "predictions", "targets")}}
    write_json(out_dir / "metrics.json", report)
    written = ["metrics.json"]
    if task.is_classification:
        write_json(out_dir / "pr_curves.json", result["pr_curves"])
        plot_pr_curves(result["pr_curves"], result["average_precision_per_class"],
                       out_dir / "pr_curves.png", f"{split} split, step {state.get('step')}")
        written += ["pr_curves.json", "pr_curves.png"]
    write_tensorboard(out_dir, result, task, state.get("step") or 0, split)
    written.append("tb/")
    if cfg.eval.save_predictions:
        np.savez(out_dir / "predictions.npz", predictions=result["predictions"].cpu().numpy(),
                 targets=result["targets"].cpu().numpy())
        written.append("predictions.npz")

    log.info("evaluated %s on the %s split: %d samples, %d process(es), %.2fs",
             checkpoint, split, result["num_samples"], env.world_size, seconds)
    for line in summary_lines(result, task):
        log.info(line)
    log.info("wrote %s in %s", ", ".join(written), out_dir)


if __name__ == "__main__":
    dist_utils.run_main(main)
