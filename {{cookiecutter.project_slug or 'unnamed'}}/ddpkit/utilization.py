"""What a run's throughput is measured against: the model FLOPs of a training sample and the
device's peak FLOP/s (the MFU that training_log reports). The counting itself is flops.py's."""

import functools

import torch
from omegaconf import DictConfig
from torch.utils.data import default_collate

from ddpkit import flops
from ddpkit.data import DataModule, count_samples
from ddpkit.evaluation import loss_terms
from ddpkit.parallel import build_model
from ddpkit.speed import Speed
from ddpkit.tasks import Task


def training_loss(task: Task, model: torch.nn.Module, batch) -> torch.Tensor:
    """The loss a training step differentiates (what count_flops counts)."""
    return loss_terms(task.loss(model(task.model_inputs(batch)), batch))["loss"]


def count_flops(cfg: DictConfig, data: DataModule, task: Task, input_shape) -> float | None:
    """Model FLOPs of one training sample (forward, loss, backward), counted on a copy of the
    model on the meta device (flops.py); None for a model that cannot run there."""
    train = data.datasets["train"]
    batch = default_collate([train[0], train[min(1, len(train) - 1)]])  # 2: BatchNorm trains
    try:
        total = flops.count_training_flops(
            functools.partial(build_model, cfg.model, input_shape, task.num_outputs),
            functools.partial(training_loss, task), batch)
    except Exception:  # a model that reads values (.item(), data-dependent shapes); describe()
        return None  # says so, and a real bug in it is reported by the training step
    return total / count_samples(batch)


def peak_flops(cfg: DictConfig, device: torch.device, speed: Speed) -> tuple[float | None, str]:
    """The device's peak FLOP/s at the run's precision (None if unknown), and its name."""
    return flops.peak_flops(device, "fp32" if speed.autocast_dtype is None else "bf16",
                            cfg.speed.tf32)
