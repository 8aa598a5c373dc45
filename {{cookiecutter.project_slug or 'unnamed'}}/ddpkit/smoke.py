"""train.fast_dev_run: a smoke test of the whole path in seconds (two training steps, a
validation and a test batch, a checkpoint and the export) in a temporary run folder."""

import contextlib
import logging
import math
import shutil
import time

from omegaconf import DictConfig, OmegaConf

from ddpkit.evaluation import evaluate_split
from ddpkit.run_end import save_and_export
from ddpkit.run_state import Run

log = logging.getLogger("ddp")

SMOKE_TEST_SETTINGS = {
    "run.name": ".fast_dev_run", "run.dir": "", "train.resume": "never", "train.epochs": 1,
    "train.max_steps": 0, "train.limit_train_batches": 2, "train.limit_val_batches": 1,
    "train.log_every": 1, "train.ckpt_every": 0, "train.progress_bar": False,
    "train.plot_curves": False, "tracking.mlflow": False, "tracking.wandb": False,
    "profile.enabled": False,
}


def smoke_test_config(cfg: DictConfig) -> DictConfig:
    """The run's config, cut down to a smoke test in a temporary run folder."""
    cfg = cfg.copy()
    for key, value in SMOKE_TEST_SETTINGS.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@contextlib.contextmanager
def removed_at_the_end(run: Run):
    """The smoke test's run folder is deleted when it ends, whether it passed or failed."""
    try:
        yield
    finally:
        if run.env.is_main:
            shutil.rmtree(run.run_dir, ignore_errors=True)


def end_smoke_test(run: Run, started: float) -> None:
    """After the smoke test's training steps: a checkpoint, the export, one test batch on every
    rank; then "ok" with what ran."""
    save_and_export(run)
    test = evaluate_split(run.model_for_evaluation(), run.data.eval_loader("test", limit=1),
                          run.device, run.task, run.speed, run.cfg.eval.binned_thresholds,
                          detail=False)
    loss, test_loss = run.training_log.last.get("loss", math.nan), test.get("loss", math.nan)
    log.info("fast_dev_run ok in %.1f s on %d process(es): %d training steps (loss %.4f), a "
             "validation and a test batch on every rank (test loss %.4f), a checkpoint and the "
             "export; the temporary run folder is removed", time.perf_counter() - started,
             run.env.world_size, run.position.step, loss, test_loss)
