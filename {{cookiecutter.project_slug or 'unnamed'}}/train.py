"""Train the model, on one process or many.

    python train.py                      # one process: CPU, or the first GPU
    ./run.sh                             # torchrun: one process per GPU (see run.sh)
    ./run.sh train.epochs=50 optim.lr=0.001 --config configs/my_experiment.yaml

Each run gets one folder, runs/<run.name>-<time>/ (chosen by rank 0 and shared with the others),
holding config.yaml, checkpoints/, tb/ (TensorBoard), train_log.jsonl, metrics.jsonl,
summary.json (how the run ended, its headline metric) and curves.png. Only rank 0 writes.
What is distributed happens in the engine: each rank's share of the epoch (epoch_steps), the
gradients' all-reduce (the wrapped model in train_step), the stop every rank agrees on (the
supervisor); the data, model and task are what the config names.

This file is the training loop. Building the run (config, data, model, optimizer, schedule, a
resumed checkpoint) is ddpkit/run_setup.py; the Run and one optimizer step (train_step) are
ddpkit/run_state.py; how a run ends (the last checkpoint, the export, summary.json, a
preemption) is ddpkit/run_end.py; validation (its cadence, the best checkpoint, early stopping)
is ddpkit/validation.py; train.fast_dev_run is ddpkit/smoke.py.
"""

import logging
import math
import time

from ddpkit import lifecycle, recipes
from ddpkit.config import given_keys, notes_at_start
from ddpkit.profiling import StepProfiler
from ddpkit.run_end import end_run, save_and_export, stop_for_preemption, summary_on_failure
from ddpkit.run_setup import describe_run, start_run
from ddpkit.run_state import Run, epoch_steps, train_step
from ddpkit.smoke import end_smoke_test, removed_at_the_end
from ddpkit.validation import keep_best, log_early_stop, validate

log = logging.getLogger("ddp")


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    run = start_run(argv)
    describe_run(run)
    if run.env.is_main:
        for note in notes_at_start(run.cfg, given_keys(argv)):
            log.warning(note)
    if run.cfg.train.fast_dev_run:
        with removed_at_the_end(run):
            train_epochs(run)
            end_smoke_test(run, started)
        return
    with summary_on_failure(run):
        train_epochs(run)
        save_and_export(run)
    end_run(run)


def train_epochs(run: Run) -> None:
    """The training loop, from where start_run left it to the end. Each part says itself when it
    acts: the training log when a window ends, the checkpointer when a checkpoint is due, the
    supervisor when every rank stops for a preemption."""
    cfg, model, data, task, position = run.cfg, run.model, run.data, run.task, run.position
    training_log, scheduler, checkpointer = run.training_log, run.scheduler, run.checkpointer
    optimizer, device, speed, scaler = run.optimizer, run.device, run.speed, run.scaler
    supervisor, rates, validation = run.supervisor, run.rates, run.validation
    step = run.train_step or train_step  # replica groups bring their own, voted on
    # Settings the loop reads every step, as plain numbers (an OmegaConf read is far slower).
    epochs, grad_clip = cfg.train.epochs, cfg.optim.grad_clip
    profiler = StepProfiler(cfg, run.run_dir, run.env.rank, device, position.step)
    validate_again(run)
    while (position.epoch < epochs and position.step < run.total_steps
           and not validation.stopped_early):
        model.train()
        training_log.start_epoch(resumed_within=position.step_in_epoch > 0)
        bar = run.progress_bar()
        for micro_batches in epoch_steps(run):
            values, samples, grad_norm = step(model, optimizer, micro_batches, task, device,
                                              speed, scaler, grad_clip)
            # The rates this step trained with, read before the scheduler sets the next step's.
            training_log.add_step(values, samples, grad_norm, rates())
            if run.guard is None or run.guard.updated:  # a skipped step keeps the schedule
                scheduler.step()
                if run.ema is not None:  # train.ema_decay: the averaged weights follow
                    run.ema.update()
            profiler.step()
            position.step += 1
            position.step_in_epoch += 1
            bar.update()
            if training_log.maybe_flush(position.step):
                bar.set_postfix(loss=f"{training_log.last.get('loss', math.nan):.4f}")
            if supervisor.should_stop():  # a preemption signal: every rank stops here
                stop_for_preemption(run)
            if validation.due(position, data.steps_per_epoch, run.total_steps):
                validated(run, validate(run, mid_epoch=True))  # train.val_every_steps
                model.train()
            if checkpointer.due(position.step):
                run.save_mid_training()
                training_log.restart_clock()  # the write is not training time of the next window
            if position.step == run.total_steps or validation.stopped_early:
                break
        bar.close()
        end_epoch(run)
    profiler.close()


def end_epoch(run: Run) -> None:
    """The epoch's steps done (or the run's): its validation, then the next epoch if this one
    is whole."""
    position = run.position
    run.training_log.end_training(position.step)
    if not run.validation.stopped_early:
        validated(run, validate(run))
    if position.step_in_epoch >= run.data.steps_per_epoch:
        position.epoch, position.step_in_epoch = position.epoch + 1, 0


def validate_again(run: Run) -> None:
    """A resumed run whose job was preempted inside a validation runs it again first: a
    step-cadence one, or the epoch's last, which then ends the epoch as it would have (also
    once the run's steps are all done, when the loop does not run again). The checkpoint of
    this step was saved before that validation: it is saved again (keep_best's or the end's)."""
    validation, step = run.validation, run.position.step
    if step not in (validation.interrupted_at, validation.interrupted_at_end):
        return
    run.checkpointer.last_saved = -1
    if step == validation.interrupted_at:
        validated(run, validate(run, mid_epoch=True))
        return
    run.training_log.start_epoch(resumed_within=True)
    end_epoch(run)


def validated(run: Run, record: dict | None) -> None:
    """What the loop does with a validation's record: stop for the preemption that cut it
    short, keep a new best checkpoint, and say so when early stopping ends the run."""
    if record is None:
        stop_for_preemption(run)
    if run.validation.judge(record) and run.validation.keep_best:
        keep_best(run)
    if run.validation.stopped_early:
        log_early_stop(run.validation)


if __name__ == "__main__":
    lifecycle.run_main(main)
