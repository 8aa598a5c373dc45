"""Run under torchrun by test_distributed.py: observe what the ranks really do.

Usage: torchrun --nproc_per_node=N tests/probes.py PROBE[,PROBE...] OUT_DIR key=value...

Several probes named with commas run one after the other in the same processes, each on a
DataModule of its own: one launch for the checks of one setting.

  shards         OUT_DIR/rank<R>.json: the train-set indices of each epoch, in the order the
                 training loop receives them, and the test indices of this rank's eval shard
  padding-bias   OUT_DIR/bias.json: test metrics through the exact shards and through a
                 padding DistributedSampler, for the same (freshly initialised) model
  allreduce      OUT_DIR/allreduce.json: gradient all-reduces counted by a DDP communication
                 hook over a few optimizer steps of ddpkit.run_state.train_step
  workers        OUT_DIR/workers.json: whether loaders with data.num_workers worker processes
                 give the batches of in-process loading, and each worker's random state
  streams        OUT_DIR/rank<R>.json: a stream's steps (ids, drawn features, weight) in two
                 epochs and from a resumed step, and this rank's test ids
  watchdog       nothing: the process ends while its stall watchdog calls the rendezvous
                 store without pause (the exit code says whether it ended cleanly)
"""

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info  # noqa: E402

from ddpkit import dist_utils, lifecycle  # noqa: E402
from ddpkit.config import load_config  # noqa: E402
from ddpkit.data import DataModule  # noqa: E402
from ddpkit.evaluation import evaluate_split, scalars  # noqa: E402
from ddpkit.parallel import build_model, wrap_model  # noqa: E402
from ddpkit.run_state import train_step  # noqa: E402
from ddpkit.speed import FLOAT32  # noqa: E402
from ddpkit.splits import TensorSamples  # noqa: E402
from ddpkit.supervisor import Supervisor, running_watchdog  # noqa: E402
from ddpkit.tasks import build_task  # noqa: E402


def indices_seen(batches, dataset) -> list[int]:
    """Map each row the loader yields back to its index (the synthetic rows are all distinct)."""
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(dataset.inputs)}
    return [index_of[row.numpy().tobytes()] for inputs, _ in batches for row in inputs]


def shards(cfg, env, data, out_dir: Path) -> None:
    record = {
        "train": [indices_seen(data.train_batches(epoch), data.datasets["train"])
                  for epoch in range(cfg.train.epochs)],
        "test": indices_seen(data.eval_loader("test"), data.datasets["test"]),
    }
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(record))


def model_and_task(cfg, data):
    task = build_task(cfg, data.splits)
    model = build_model(cfg.model, task.input_shape(data.datasets["train"][0]), task.num_outputs)
    return model, task


def padding_bias(cfg, env, data, out_dir: Path) -> None:
    torch.manual_seed(0)
    model, task = model_and_task(cfg, data)
    device = torch.device("cpu")
    exact = evaluate_split(model, data.eval_loader("test"), device, task)
    # What many templates do: DistributedSampler for evaluation. It pads the split with repeated
    # samples so every rank gets the same count, and those repeats are scored twice.
    padded_sampler = DistributedSampler(data.datasets["test"], shuffle=False)
    padded_loader = DataLoader(data.datasets["test"], batch_size=16, sampler=padded_sampler)
    padded = evaluate_split(model, padded_loader, device, task)
    if env.is_main:
        report = {name: {"num_samples": r["num_samples"], **scalars(r)}
                  for name, r in (("exact", exact), ("padded", padded))}
        (out_dir / "bias.json").write_text(json.dumps(report))


def allreduce(cfg, env, data, out_dir: Path) -> None:
    torch.manual_seed(cfg.run.seed)
    model, task = model_and_task(cfg, data)
    model = wrap_model(model, cfg, env, torch.device("cpu"), FLOAT32)
    calls = [0]

    def counting_allreduce(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, micro_batches = 0, 0
    for step_batches in data.train_steps(0):
        train_step(model, optimizer, step_batches, task, torch.device("cpu"))
        steps += 1
        micro_batches += len(step_batches)
    if env.is_main:
        report = {"steps": steps, "micro_batches": micro_batches, "allreduce_calls": calls[0]}
        (out_dir / "allreduce.json").write_text(json.dumps(report))


class RandomStateProbe(TensorSamples):
    """With each batch, the worker that read it, its seed and a draw of each random generator."""

    def __getitem__(self, index):
        info = get_worker_info()
        state = [info.id, info.seed, torch.randint(2**62, ()).item(),
                 int(np.random.randint(2**62)), random.getrandbits(62)]
        return (*super().__getitem__(index), state)


def workers(cfg, env, data, out_dir: Path) -> None:
    in_process = DataModule(OmegaConf.merge(cfg, {"data": {"num_workers": 0}}), env, data.device)
    same = all(
        all(torch.equal(a, b) for a, b in zip(batch, reference, strict=True))
        for epoch in range(2)
        for batch, reference in zip(data.train_batches(epoch), in_process.train_batches(epoch),
                                    strict=True)
    ) and all(
        torch.equal(batch[0], reference[0]) for batch, reference in
        zip(data.eval_loader("val"), in_process.eval_loader("val"), strict=True)
    )
    train = data.datasets["train"]
    probe = RandomStateProbe(train.inputs, train.targets)
    loader = data._loader(probe, data.micro_batch_size, data.train_sampler)
    data.train_sampler.set_epoch(0)
    first_draws = {}  # worker id -> the state its first batch reported
    for _, _, state in loader:
        first_draws.setdefault(state[0], state)
    everyone = dist_utils.gather_objects({"same_batches": same,
                                          "first_draws": list(first_draws.values())})
    if env.is_main:
        (out_dir / "workers.json").write_text(json.dumps(everyone))


def stream_steps(steps) -> list[dict]:
    """Each step of fixtures.id_stream as this rank has it: its samples' ids and drawn second
    features (micro-batches in order), and its weight."""
    return [{"ids": [int(i) for batch in step for i in batch[0][:, 0]],
             "drawn": [float(x) for batch in step for x in batch[0][:, 1]],
             "weight": step.weight} for step in steps]


def streams(cfg, env, data, out_dir: Path) -> None:
    record = {"epochs": [stream_steps(data.train_steps(epoch)) for epoch in range(2)],
              "resumed": stream_steps(data.train_steps(1, skip_steps=4)),
              "test": [int(i) for inputs, _ in data.eval_loader("test") for i in inputs[:, 0]]}
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(record))


def watchdog(cfg, env, data, out_dir: Path) -> None:
    Supervisor(env, timeout_minutes=2)
    dog = running_watchdog()
    dog.period = 0.0  # from its next round on, one store call after another,
    dog.where = lambda: ("tests/probes.py", False)  # with little in between
    report, deadline = f"{dog.prefix}rank{env.rank}", time.monotonic() + 60
    while not dog.store.check([report]) and time.monotonic() < deadline:
        time.sleep(0.01)  # (polls: the watchdog's first report, after its first period)


PROBES = {"shards": shards, "padding-bias": padding_bias, "allreduce": allreduce,
          "workers": workers, "streams": streams,
          "watchdog": watchdog}


def main(argv: list[str]) -> None:
    probes, out_dir, cfg = argv[0].split(","), Path(argv[1]), load_config(argv[2:])
    env = dist_utils.get_dist_env()
    device = torch.device("cpu")
    dist_utils.init_distributed(env, device, "gloo", timeout_minutes=2)
    for probe in probes:
        PROBES[probe](cfg, env, DataModule(cfg, env, device), out_dir)


if __name__ == "__main__":
    lifecycle.run_main(main)
