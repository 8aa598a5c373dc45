"""How a run ends: finished (the last checkpoint, the exported model, summary.json, curves.png,
the trackers closed), preempted (a checkpoint where every rank stopped), or failed and
interrupted (said in summary.json)."""

import contextlib
import json
import logging
from pathlib import Path

from ddpkit import checkpoint, dist_utils, report, supervisor, weight_choice, writes
from ddpkit.blocks import compile_seconds
from ddpkit.checkpoint_files import MODEL_FILE, list_checkpoints
from ddpkit.evaluation import run_folder_choice
from ddpkit.parallel import ModelState
from ddpkit.run_state import Run
from ddpkit.same_command import run_again

log = logging.getLogger("ddp")


def write_summary(run: Run, status: str) -> None:
    """<run>/summary.json (rank 0): how the run stands, and its task's headline validation
    metric, last and best (what report.py and sweep.py rank runs by)."""
    position = run.position
    summary = {"status": status, "step": position.step,
               **({} if run.data.by_steps else {"epoch": position.epoch}),
               "total_steps": run.total_steps, "world_size": run.env.world_size,
               "headline": run.task.headline, "higher_is_better": run.task.higher_is_better,
               "best_checkpoint": run.validation.best_checkpoint(run.run_dir),
               "stopped_early": run.validation.stopped_early, "exported": run.exported}
    if status != "running":
        summary["throughput"] = run.training_log.throughput()  # this job's timed windows
        history = report.read_run(run.run_dir)
        values = history.val_values()
        summary.update({"metric": f"val_{history.headline}", "best": history.best(),
                        "last": values[-1] if values else None})
    writes.write_text(run.run_dir / report.SUMMARY_FILE, json.dumps(summary, indent=1))


def finish(run: Run, status: str) -> None:
    """Rank 0, after the training log is closed: summary.json, curves.png (when done), the
    trackers' files, and the trackers closed."""
    if not run.env.is_main:
        return
    write_summary(run, status)
    files = [run.run_dir / "config.yaml", run.run_dir / report.SUMMARY_FILE]
    if status == "done" and run.cfg.train.plot_curves:
        files.append(report.plot_runs([report.read_run(run.run_dir)], run.run_dir
                                      / report.CURVES_FILE, title=run.run_dir.name))
    if run.trackers:
        run.trackers.log_files(files, "run")
        run.trackers.close("finished" if status == "done" else status)


def end_run(run: Run) -> None:
    """A finished run's records (collective), and where to find what it wrote."""
    if run.replicas is not None:  # the final weights' digest in the group's step log
        run.replicas.finish(run.model)
    with dist_utils.agree_on_errors():  # summary.json, curves.png, the trackers' files
        finish(run, "done")
    log.info(run.training_log.describe_throughput())
    if run.speed.compile and (seconds := compile_seconds()) is not None:
        log.info("torch.compile: %.1f s spent compiling (rank 0)", seconds)
    log.info("done: checkpoints in %s, the final model (%s weights, step %d) in %s, TensorBoard "
             "logs in %s", run.run_dir / "checkpoints", run.exported["weights"],
             run.exported["step"], run.run_dir / MODEL_FILE, run.run_dir / "tb")
    if run.env.is_main:  # what evaluate.py takes for the run folder (it reads summary.json)
        target, weights = run_folder_choice(run.run_dir)
        log.info("evaluate with: ./run.sh evaluate.py eval.checkpoint=%s (its %s: %s)",
                 run.run_dir, MODEL_FILE if target.name == MODEL_FILE else "newest checkpoint",
                 weights)


def stop_for_preemption(run: Run) -> None:
    """Save where every rank stopped, then leave with the 'preempted' status (collective)."""
    run.save_mid_training()
    run.checkpointer.wait()  # an asynchronous write too: on disk before the job leaves
    run.training_log.close()
    with dist_utils.agree_on_errors():
        finish(run, "preempted")
    from ddpkit.extras.elastic import stopped_by_torchrun

    then = ("torchrun starts the workers again from there (a node joined or left the "
            "elastic job)" if stopped_by_torchrun() else f"to continue from there, {run_again()}")
    raise supervisor.Preempted(f"saved step {run.position.step} in {run.run_dir}; {then}")


@contextlib.contextmanager
def summary_on_failure(run: Run):
    """summary.json says how a run that did not finish ended: "failed" (an error) or
    "interrupted" (Ctrl-C, which rank 0 then describes: supervisor.Interrupted); a preemption
    has written "preempted" itself."""
    try:
        yield
    except supervisor.Preempted:
        raise
    except BaseException as error:
        if run.env.is_main:
            status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            with contextlib.suppress(Exception):  # never hide the error that ended the run
                write_summary(run, status)
            if isinstance(error, KeyboardInterrupt):
                raise supervisor.Interrupted(where_interrupted(run)) from None
        raise


def where_interrupted(run: Run) -> str:
    """Where a Ctrl-C left the run (no checkpoint is saved on one), and what continues it."""
    checkpoints = list_checkpoints(run.checkpointer.folder)
    if not checkpoints:
        return (f"at step {run.position.step}, before the first checkpoint of {run.run_dir}: "
                f"to start it again from step 0, {run_again()}")
    saved = int(checkpoints[-1].name.removeprefix("step-"))
    return (f"at step {run.position.step}; the newest checkpoint of {run.run_dir} is step "
            f"{saved}: to continue from there, {run_again()}")


def save_and_export(run: Run) -> None:
    """The last checkpoint (unless the loop just saved it), on disk, the final model exported,
    and the training log closed."""
    if run.checkpointer.last_saved != run.position.step:
        run.save()
    run.checkpointer.wait()
    export(run)
    run.training_log.close()


def export(run: Run) -> None:
    """The final model as one file (collective: with FSDP the shards are gathered): the run's
    weights (its averages, with train.ema_decay: docs/checkpoints.md, "Which weights") of the
    last step, or of the best validation's checkpoint (train.export=best), read from disk."""
    best = run.validation.best_checkpoint(run.run_dir)
    if run.cfg.train.export == "best" and best is None:
        log.warning("train.export=best but no validation ran: model.pt holds the last weights")
    if run.cfg.train.export == "best" and best is not None:
        with dist_utils.agree_on_errors():
            which = weight_choice.choose(Path(best), {}, "auto", "train.export=best")
            run.exported = {"from": "best", "step": run.validation.best["step"],
                            "weights": which}
            if run.env.is_main:
                checkpoint.export_model(weight_choice.read(Path(best), {}, which),
                                        run.run_dir / MODEL_FILE, run.exported["step"],
                                        run.cfg, which)
        return
    averaged = run.ema is not None  # (train.export=ema: the same, deprecated)
    run.exported = {"from": "last", "step": run.position.step,
                    "weights": weight_choice.AVERAGED if averaged else weight_choice.TRAINED}
    with run.averaged_weights():
        weights = ModelState(run.model, whole=True).state_dict()
        if averaged:  # (on a CPU the dict may hold the parameters themselves: swapped back next)
            weights = {name: tensor.clone() for name, tensor in weights.items()}
    with dist_utils.agree_on_errors():
        if run.env.is_main:
            checkpoint.export_model(weights, run.run_dir / MODEL_FILE,
                                    run.position.step, run.cfg, run.exported["weights"])
