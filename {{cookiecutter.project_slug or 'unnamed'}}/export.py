"""Write a checkpoint's model as one file: for evaluate.py, or to ship the model.

    python export.py runs/<run>                                   # its latest checkpoint
    python export.py runs/<run>/checkpoints/step-00000200 out.pt  # that one, to out.pt
    python export.py runs/<run> --best                            # its best validation's

One process, no GPU and no process group needed: the checkpoint's shards (saved by any number of
processes, DDP or FSDP) are read into whole tensors. The file (default: model.pt in the run
folder, which training also writes at its end) holds the weights keyed by parameter name, the
step and the config that builds the model, and loads with torch.load(weights_only=True):

    state = torch.load("model.pt", weights_only=True)
    model.load_state_dict(state["model"])  # the bare model, as build_model makes it
"""

import json
from pathlib import Path

from ddpkit import checkpoint, checkpoint_files, checkpoint_load, lifecycle, report
from ddpkit.config import UserError, config_from_dict


def main(argv: list[str]) -> None:
    best = "--best" in argv
    argv = [arg for arg in argv if arg != "--best"]
    if len(argv) not in (1, 2):
        raise UserError("usage: python export.py <run folder or checkpoint folder> [output file]"
                        " [--best]")
    source = checkpoint_files.find_checkpoint(best_checkpoint(Path(argv[0])) if best else argv[0])
    if not checkpoint_files.is_checkpoint(source):
        raise UserError(f"{source} is not a checkpoint folder: give a run folder or its "
                        "checkpoints/step-<N>")
    state = checkpoint_load.load_checkpoint(source)
    cfg = config_from_dict(state.get("config", {}), f"config stored in {source}")
    run_dir = source.parent.parent if source.parent.name == "checkpoints" else source.parent
    target = Path(argv[1]) if len(argv) == 2 else run_dir / checkpoint_files.MODEL_FILE
    checkpoint.export_model(checkpoint_load.read_model(source), target, state["step"], cfg)
    print(f"wrote {target}: the model of {source} (step {state['step']})")


def best_checkpoint(run_dir: Path) -> str:
    """The checkpoint of a run's best validation, as its summary.json names it."""
    try:
        best = json.loads((run_dir / report.SUMMARY_FILE).read_text()).get("best_checkpoint")
    except (OSError, ValueError):
        best = None
    if not best:
        raise UserError(f"--best: {run_dir} names no best checkpoint (give a run folder trained "
                        "with train.keep_best=true, after its first validation)")
    return str(run_dir / "checkpoints" / Path(best).name)  # the run folder may have moved


if __name__ == "__main__":
    lifecycle.run_main(main)
