"""Run under torchrun by test_distributed.py: record which samples each rank really sees.

Usage: torchrun --nproc_per_node=N tests/probe_sharding.py OUT_DIR key=value...
Writes OUT_DIR/rank<R>.json with the train-set indices of each epoch (in the order the training
loop receives them) and the test-set indices of this rank's evaluation shard.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import dist_utils  # noqa: E402
from config import load_config  # noqa: E402
from data import DataModule  # noqa: E402


def indices_seen(batches, dataset) -> list[int]:
    """Map each row the loader yields back to its index (the synthetic rows are all distinct)."""
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
    return [index_of[row.numpy().tobytes()] for inputs, _ in batches for row in inputs]


def main(argv: list[str]) -> None:
    out_dir, cfg = Path(argv[0]), load_config(argv[1:])
    env = dist_utils.get_dist_env()
    device = torch.device("cpu")
    dist_utils.init_distributed(env, device, "gloo", timeout_minutes=2)
    data = DataModule(cfg, env, device)
    record = {
        "world_size": env.world_size,
        "train": [indices_seen(data.train_batches(epoch), data.datasets["train"])
                  for epoch in range(cfg.train.epochs)],
        "test": indices_seen(data.eval_loader("test"), data.datasets["test"]),
    }
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    dist_utils.run_main(main)
