"""What a run's throughput is measured against: the model FLOPs of a training sample and the
device's peak FLOP/s (the MFU that training_log reports). The counting itself is flops.py's."""

import functools

import torch
from omegaconf import DictConfig

from ddpkit import flops
from ddpkit.data import DataModule, count_samples
from ddpkit.evaluation import loss_terms
from ddpkit.models import call_model
from ddpkit.parallel import build_model
from ddpkit.speed import Speed
from ddpkit.tasks import Task


def training_loss(task: Task, model: torch.nn.Module, batch) -> torch.Tensor:
    """The loss a training step differentiates (what count_flops counts)."""
    return loss_terms(task.loss(call_model(model, task.model_inputs(batch)), batch))["loss"]


def count_flops(cfg: DictConfig, data: DataModule, task: Task, input_shape,
                model: torch.nn.Module) -> float | None:
    """Model FLOPs of one training sample (forward, loss, backward) of a batch made as training
    makes them, counted on a copy of the model on the meta device (flops.py); where the model
    cannot run there (Hugging Face models, one that reads values), on `model` itself, the run's
    bare model, put back as it was. None when neither can be counted."""
    batch = data.sample_batch(2)  # 2: BatchNorm trains
    loss = functools.partial(training_loss, task)
    try:
        total = flops.count_training_flops(
            functools.partial(build_model, cfg.model, input_shape, task.num_outputs), loss, batch)
    except Exception:  # describe_flops() says so when this fails too; a real bug in the model is
        total = flops.count_in_place(model, loss, batch)  # reported by the training step
    return None if total is None else total / count_samples(batch)


def run_peak_flops(cfg: DictConfig, device: torch.device, speed: Speed) -> tuple[float | None, str]:
    """The device's peak FLOP/s at the run's precision (None if unknown), and its name."""
    return flops.peak_flops(device, "fp32" if speed.autocast_dtype is None else "bf16",
                            cfg.speed.tf32)
