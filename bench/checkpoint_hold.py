"""How long a checkpoint holds the ranks: run by bench/sharding.py under torchrun, in a baked
project (on PYTHONPATH, as the working folder).

    torchrun --nproc_per_node=2 checkpoint_hold.py <out.json> <rounds> <train.py overrides>

Per round: one training step (the state changes), then a synchronous save and an asynchronous one
of that state, each into a run folder of its own. Held: from save() called to save() returned,
the slowest rank's time; for the asynchronous save also the time until the write is on disk
(wait() returned). Rank 0 writes the times to out.json.
"""

import json
import time
from pathlib import Path

import checkpoint
import dist_utils
import torch.distributed as dist
import train
from omegaconf import OmegaConf


def slowest(seconds: float) -> float:
    """The largest of every rank's value (the job waits for its slowest rank)."""
    return max(dist_utils.gather_objects(seconds))


def main(argv: list[str]) -> None:
    out, rounds = Path(argv[0]), int(argv[1])
    s = train.setup(argv[2:])
    savers = {}
    for mode in (False, True):
        cfg = OmegaConf.merge(s.cfg, {"train": {"checkpoint_async": mode}})
        folder = s.run_dir / ("async" if mode else "sync")
        savers[mode] = checkpoint.Checkpointer(folder, cfg, s.env)
    times: dict = {"sync_held": [], "async_held": [], "async_total": []}
    steps = s.data.train_steps(0, 0)
    for _ in range(rounds):
        train.train_step(s.model, s.optimizer, next(steps), s.task, s.device, s.speed, s.scaler,
                         s.cfg.optim.grad_clip)
        s.position.step += 1
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
    if s.env.is_main:
        out.write_text(json.dumps(times))
    s.log.close()
    s.supervisor.settle()
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    dist_utils.run_main(main)
