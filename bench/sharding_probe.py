"""What the ranks of a sharded or replicated model cost: run by bench/sharding.py under torchrun,
in a baked project (on PYTHONPATH, as the working folder).

    torchrun --nproc_per_node=N sharding_probe.py train <out.json> <steps> <train.py overrides>
    torchrun --nproc_per_node=N sharding_probe.py hold <out.json> <rounds> <train.py overrides>

train: set up as train.py does, run <steps> optimizer steps; report every rank's peak resident
memory at the end of them (ru_maxrss: set-up included, no checkpoint or export yet) and the
median time of a step after the first two.

hold: per round, one training step (the state changes), then a synchronous save and an
asynchronous one of that state, each into a folder of its own. Held: from save() called to save()
returned, on the slowest rank; for the asynchronous save also the time until the write is on
disk (wait() returned).

Rank 0 writes the numbers to out.json.
"""

import json
import resource
import statistics
import time
from pathlib import Path

from omegaconf import OmegaConf

from ddpkit import checkpoint, dist_utils
from ddpkit.run_setup import start_run
from ddpkit.run_state import Run, train_step


def slowest(seconds: float) -> float:
    """The largest of every rank's value (the job waits for its slowest rank)."""
    return max(dist_utils.gather_objects(seconds))


def step(s: Run, batches) -> None:
    train_step(s.model, s.optimizer, next(batches), s.task, s.device, s.speed, s.scaler,
               s.cfg.optim.grad_clip)
    s.position.step += 1


def measure_training(s: Run, steps: int) -> dict:
    batches = s.data.train_steps(0, 0)
    seconds = []
    for _ in range(steps):
        dist_utils.barrier()
        start = time.perf_counter()
        step(s, batches)
        dist_utils.barrier()
        seconds.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mib": dist_utils.gather_objects(peak_mib),
            "seconds_per_step": statistics.median(seconds[2:])}


def measure_hold(s: Run, rounds: int) -> dict:
    savers = {}
    for mode in (False, True):
        cfg = OmegaConf.merge(s.cfg, {"train": {"checkpoint_async": mode}})
        savers[mode] = checkpoint.Checkpointer(s.run_dir / ("async" if mode else "sync"), cfg,
                                               s.env)
    times: dict = {"sync_held": [], "async_held": [], "async_total": []}
    batches = s.data.train_steps(0, 0)
    for _ in range(rounds):
        step(s, batches)
        dist_utils.barrier()
        start = time.perf_counter()
        savers[False].save(s.parts(), s.position, s.cfg)
        times["sync_held"].append(slowest(time.perf_counter() - start))
        dist_utils.barrier()
        start = time.perf_counter()
        savers[True].save(s.parts(), s.position, s.cfg)
        held = time.perf_counter() - start
        savers[True].wait()
        total = time.perf_counter() - start
        times["async_held"].append(slowest(held))
        times["async_total"].append(slowest(total))
    return times


def main(argv: list[str]) -> None:
    mode, out, count = argv[0], Path(argv[1]), int(argv[2])
    s = start_run(argv[3:])
    result = measure_training(s, count) if mode == "train" else measure_hold(s, count)
    if s.env.is_main:
        out.write_text(json.dumps(result))
    s.training_log.close()
    s.supervisor.settle()
    dist_utils.barrier()


if __name__ == "__main__":
    dist_utils.run_main(main)
