"""Settings that cannot run or cannot take effect, found before training starts: a name that
torch or your files do not have is refused by run.sh's preflight (before torchrun), a setting
that acts only with another one is refused or warned once, and an RDZV_CONF key torchrun does
not read is a warning."""

import sys

import pytest

from conftest import TINY, fixture, run


def one_error(result) -> str:
    """The single line of a launch refused with exit status 2."""
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stdout
    return lines[0]


@pytest.mark.parametrize(("setting", "expected"), [
    ("optim.name=adamx", "optim.name=adamx is not a torch.optim optimizer: choose one of "),
    ("optim.schedule=cosin", "optim.schedule=cosin is not a schedule: choose one of cosine, "),
    ("train.best_metric=acuracy", "train.best_metric=acuracy is not a validation metric of any "
     "task: choose one of loss, accuracy, "),
    ("parallel.cpu_offload=true", "parallel.cpu_offload=true keeps FSDP's shards in CPU memory, "
     "which parallel.strategy=ddp does not have: set parallel.strategy=fsdp, or leave "
     "parallel.cpu_offload=false"),
    ("profile.enabled=true profile.start_step=40 train.max_steps=30", "profile.start_step=40 "
     "comes after the run's last step (30), so nothing would be profiled: set "
     "profile.start_step to a step of the run"),
], ids=["optimizer", "schedule", "best-metric", "cpu-offload", "profile"])
def test_a_setting_that_cannot_run_is_refused_before_torchrun(setting, expected):
    # The preflight alone, as run.sh runs it before torchrun (test_launch: run.sh stops there).
    result = run([sys.executable, "-m", "ddpkit.preflight", "--nproc-per-node", "2",
                  "--nnodes", "1", *TINY, *setting.split()])
    assert one_error(result).startswith(f"error: {expected}")
    assert "did you mean accuracy?" in result.stdout or "best_metric" not in setting


def test_an_rdzv_conf_key_torchrun_does_not_read_is_a_warning():
    # The launch stops later, at the config, so that no node waits for the others.
    result = run(["./run.sh", *TINY, "train.epochs=0"], NNODES="2", NPROC_PER_NODE="1",
                 MASTER_ADDR="127.0.0.1", RDZV_ID="warned",
                 RDZV_CONF="last_cal_timeout=5,keep_alive_interval=2")
    assert result.returncode == 2, result.stdout
    assert result.stdout.strip().splitlines() == [
        "warning: RDZV_CONF: torchrun's c10d rendezvous does not read last_cal_timeout, so "
        "last_cal_timeout=5 has no effect (did you mean last_call_timeout?)",
        "error: train.epochs=0 is not valid: it must be > 0"]


@pytest.mark.slow
def test_what_the_data_decides_is_refused_or_warned_at_start_up(tmp_path):
    # The profiled step is past the run's 57 steps (3 epochs of 19): known once the data is.
    refused = run([sys.executable, "train.py", *TINY, "profile.enabled=true",
                   "profile.start_step=60", f"run.output_dir={tmp_path}"])
    assert one_error(refused) == (
        "error: profile.start_step=60 comes after the run's last step (57), so nothing would be "
        "profiled: set profile.start_step to a step of the run")
    # r2 is a metric of a task, not of this data's (multiclass)
    refused = run([sys.executable, "train.py", *TINY, "train.best_metric=r2",
                   f"run.output_dir={tmp_path}"])
    assert one_error(refused) == (
        "error: train.best_metric=r2 is not a validation metric of the multiclass task: choose "
        "one of loss, accuracy, average_precision_macro")
    # BatchNorm with 1 sample a micro-batch: from the model's layers, before any step.
    refused = run([sys.executable, "train.py", *TINY, "model.batchnorm=true",
                   "train.global_batch_size=1", f"run.output_dir={tmp_path}"])
    assert one_error(refused) == (
        "error: BatchNorm layer net.1 (BatchNorm1d) needs more than 1 value per channel to "
        "train, and a training micro-batch holds 1 sample (train.global_batch_size=1 over 1 "
        "process(es)): use a larger train.global_batch_size")
    assert list(tmp_path.iterdir()) == []
    warned = run([sys.executable, "train.py", *TINY, "train.max_steps=15",
                  "train.val_every_steps=100", "optim.gamma=0.5", "ddp.static_graph=true",
                  "train.estimate_windows=64", "guard.enabled=true", "guard.spike_factor=3",
                  f"run.output_dir={tmp_path}"])
    assert warned.returncode == 0, warned.stdout
    notes = [line.split(" ", 1)[1] for line in warned.stdout.splitlines()
             if "has no effect" in line]
    assert notes == [
        "optim.gamma=0.5 has no effect with optim.schedule=cosine: it acts only with "
        "optim.schedule=step or multistep or plateau",
        "train.val_every_steps=100 has no effect: the run has 15 steps, so it validates only at "
        "the end of each epoch",
        f"train.estimate_windows=64 has no effect: the training split of data.dataset="
        f"{fixture('vectors')} is not drawn with replacement (a streams.SampledStream, as "
        "data.dataset=tokens gives)",
        "guard.window=100 has no effect: the run has 15 steps, so guard.spike_factor=3.0 never "
        "judges one (it waits for guard.window updated steps first): lower guard.window"]
