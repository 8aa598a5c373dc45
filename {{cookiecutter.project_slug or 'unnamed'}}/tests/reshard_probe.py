"""Resume a run as train.py would (ddpkit.run_setup.start_run: its latest checkpoint, at this
process count and strategy), then gather the model and optimizer state back from the processes
and compare them with the checkpoint's: prints `same state: N tensors` on rank 0, or fails. Run
by test_fsdp.py."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit import lifecycle  # noqa: E402
from ddpkit.checkpoint_files import list_checkpoints  # noqa: E402
from ddpkit.checkpoint_load import read_tensors  # noqa: E402
from ddpkit.parallel import ModelState  # noqa: E402
from ddpkit.run_setup import start_run  # noqa: E402


def differences(saved, restored, where: str = "") -> list[str]:
    """Where two nested states differ (tensors: torch.equal; anything else: ==)."""
    if isinstance(saved, dict) and isinstance(restored, dict):
        if saved.keys() != restored.keys():
            return [f"{where}: keys {sorted(saved)} != {sorted(restored)}"]
        return [found for key in saved
                for found in differences(saved[key], restored[key], f"{where}/{key}")]
    if isinstance(saved, list | tuple) and isinstance(restored, list | tuple):
        if len(saved) != len(restored):
            return [f"{where}: lengths {len(saved)} != {len(restored)}"]
        return [found for i, (a, b) in enumerate(zip(saved, restored, strict=True))
                for found in differences(a, b, f"{where}/{i}")]
    if isinstance(saved, torch.Tensor) and isinstance(restored, torch.Tensor):
        return [] if torch.equal(saved, restored.to(saved.device)) else [f"{where}: values"]
    return [] if saved == restored else [f"{where}: {saved!r} != {restored!r}"]


def flat_tensors(state, prefix: str = "") -> dict:
    """A nested state's tensors by dotted name, as a checkpoint folder names them."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return {prefix[:-1]: state} if isinstance(state, torch.Tensor) else {}
    return {name: value for key, inner in items
            for name, value in flat_tensors(inner, f"{prefix}{key}.").items()}


def main(argv: list[str]) -> None:
    s = start_run(argv)
    assert s.resumed, "the probe needs a run folder with a checkpoint (run.dir=...)"
    # Gathered whole onto rank 0 (a collective).
    restored = {name: flat_tensors(ModelState(s.model, optimizer, whole=True).state_dict())
                for name, optimizer in (("model", None), ("optimizer", s.optimizer))}
    if s.env.is_main:
        latest = list_checkpoints(s.run_dir / "checkpoints")[-1]
        saved = {name: read_tensors(latest, name) for name in ("model", "optimizer")}
        found = differences(saved, restored)
        if found:
            raise AssertionError("restored state differs: " + "; ".join(found[:10]))
        print(f"same state: {sum(len(part) for part in saved.values())} tensors", flush=True)
    s.training_log.close()


if __name__ == "__main__":
    lifecycle.run_main(main)
