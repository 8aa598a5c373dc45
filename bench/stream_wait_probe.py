"""How long the training loop waits for each batch: run by bench/stream_wait.py under torchrun,
in a baked project (on PYTHONPATH, as the working folder).

    torchrun --nproc_per_node=N stream_wait_probe.py <out.json> <epochs> <step ms> <sleep|spin>
        <train.py overrides>

Each rank sets up as train.py does (config, process group, the DataModule) and runs <epochs>
epochs of DataModule.train_steps, the iterator the training loop reads. In place of the step, a
stand-in of known length: `sleep` (no CPU used: the loader workers have the cores) or `spin` (a
busy loop: a core taken, as a real step takes one), then a barrier, as the gradient all-reduce
ends a DDP step. The wait of a step: the time next() takes to give its micro-batches.

Rank 0 writes every rank's waits, as [epoch, step, seconds], to out.json.
"""

import json
import time
from pathlib import Path

from ddpkit import dist_utils
from ddpkit.data import DataModule
from ddpkit.run_setup import start_processes


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


STAND_INS = {"sleep": time.sleep, "spin": spin}


def measure(data: DataModule, epochs: int, step_seconds: float, stand_in) -> list:
    waits = []
    for epoch in range(epochs):
        steps = data.train_steps(epoch)
        for index in range(data.steps_per_epoch):
            start = time.perf_counter()
            next(steps)
            waits.append([epoch, index, time.perf_counter() - start])
            if step_seconds:
                stand_in(step_seconds)
            dist_utils.barrier()
        steps.close()
    return waits


def main(argv: list[str]) -> None:
    out, epochs, step_ms, kind = Path(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    cfg, env, device = start_processes(argv[4:])
    data = DataModule(cfg, env, device)
    waits = measure(data, epochs, step_ms / 1000, STAND_INS[kind])
    every_rank = dist_utils.gather_objects(waits)
    if env.is_main:
        out.write_text(json.dumps({"steps_per_epoch": data.steps_per_epoch,
                                   "waits": every_rank}))
    dist_utils.barrier()


if __name__ == "__main__":
    dist_utils.run_main(main)
