"""Write a checkpoint's model as one file (or one folder): for evaluate.py, or to ship the model.

    python export.py runs/<run>                                   # its latest checkpoint
    python export.py runs/<run>/checkpoints/step-00000200 out.pt  # that one, to out.pt
    python export.py runs/<run> --best                            # its best validation's
    python export.py runs/<run> --weights trained                 # not the averaged ones
    python export.py runs/<run> --format safetensors              # model.safetensors
    python export.py runs/<run> --format hf                       # hf-model/: save_pretrained
    python export.py runs/<run> --format hf data.root=/scratch/moved  # the run's data moved

One process, no GPU and no process group needed: the checkpoint's shards (saved by any number of
processes, DDP or FSDP) are read into whole tensors. The source may also be a model.pt.

Which weights (docs/checkpoints.md, "Which weights"): a run that kept averaged weights
(train.ema_decay) exports its averages, in every format; `--weights trained` takes the trained
ones. The line it prints says which it wrote. Writing the run's own model.pt records them in it
and in the run's summary.json (`exported`).

--format pt (the default) writes model.pt in the run folder (training also writes one at its
end): the weights keyed by parameter name, which weights they are, the step and the config that
builds the model; it loads with torch.load(weights_only=True):

    state = torch.load("model.pt", weights_only=True)
    model.load_state_dict(state["model"])  # the bare model, as build_model makes it

--format safetensors writes model.safetensors (the safetensors extra); --format hf writes a
Hugging Face model's save_pretrained folder, with the data's tokenizer (the transformers
extra). Both build the model from the checkpoint's config, as evaluate.py does: they need your
recipe files and the run's data (docs/checkpoints.md, "Exports"); `data.*` overrides say where
the data is now, as they do for evaluate.py.
"""

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import ddpkit
from ddpkit import (
    checkpoint,
    checkpoint_files,
    checkpoint_load,
    lifecycle,
    recipes,
    report,
    weight_choice,
    writes,
)
from ddpkit.config import UserError, config_from_dict, given_keys, load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model
from ddpkit.tasks import build_task
from ddpkit.tokens import Vocabulary
from ddpkit.writes import write_whole

OUTPUTS = {"pt": checkpoint_files.MODEL_FILE, "safetensors": "model.safetensors",
           "hf": "hf-model"}  # each format's output in the run folder, unless one is given
NEEDS = {"safetensors": ("safetensors", "safetensors"),  # format: (package, extra)
         "hf": ("transformers", "transformers")}


class Arguments(argparse.ArgumentParser):
    def error(self, message: str):
        """A mistake in the arguments: one line (exit 2 through lifecycle.run_main)."""
        raise UserError(f"{message} ({' '.join(self.format_usage().split())})")


def data_overrides(argv: list[str]) -> tuple[list[str], dict]:
    """The command line without its key=value words, and what those set: data.* only, checked
    against the settings' types as a training command line is."""
    overrides = [word for word in argv if "=" in word and not word.startswith("-")]
    keys = given_keys(overrides)
    for key in keys:
        if not key.startswith("data."):
            raise UserError(f"{key}: export.py takes data.* settings only (where the run's data "
                            "is now); the model and the task come from the checkpoint")
    given = load_config(overrides)
    return ([word for word in argv if word not in overrides],
            {key: OmegaConf.select(given, key) for key in keys})


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = Arguments(prog="python export.py", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a run folder (its newest intact checkpoint), a "
                        "checkpoint folder (checkpoints/step-N) or a model.pt")
    parser.add_argument("output", nargs="?", help="the file (the folder for hf) to write; "
                        f"default: {', '.join(OUTPUTS.values())} in the run folder")
    parser.add_argument("--best", action="store_true",
                        help="the checkpoint of the run's best validation")
    parser.add_argument("--format", default="pt", metavar="|".join(OUTPUTS),
                        help="pt (default), safetensors, or hf (a Hugging Face model's folder)")
    parser.add_argument("--weights", default="auto", metavar="|".join(weight_choice.CHOICES),
                        help="auto (default): the averaged weights where the run kept them, "
                        "else the trained ones; averaged; trained")
    args = parser.parse_intermixed_args(argv)  # --format and --best anywhere
    # (argparse's own wording of these differs between Pythons)
    if args.format not in OUTPUTS:
        parser.error(f"--format {args.format} is not one of {', '.join(OUTPUTS)}")
    if args.weights not in weight_choice.CHOICES:
        parser.error(f"--weights {args.weights} is not one of "
                     f"{', '.join(weight_choice.CHOICES)}")
    return args


def main(argv: list[str]) -> None:
    argv, overrides = data_overrides(argv)
    args = arguments(argv)
    if args.format in NEEDS and importlib.util.find_spec(NEEDS[args.format][0]) is None:
        package, extra = NEEDS[args.format]
        raise UserError(f"--format {args.format} needs the {package} package: install the "
                        f"{extra} extra (pip install -e '.[{extra}]')")
    source = checkpoint_files.find_checkpoint(
        best_checkpoint(Path(args.source)) if args.best else args.source)
    if source.is_dir() and not checkpoint_files.is_checkpoint(source):
        raise UserError(f"{source} is not a checkpoint folder: give a run folder, its "
                        "checkpoints/step-<N> or a model.pt")
    state = checkpoint_load.load_checkpoint(source)
    if not source.is_dir() and "model" not in state:
        raise UserError(f"{source} is not a model file: give a run folder, a checkpoint folder "
                        "or a model.pt")
    cfg = config_from_dict(state.get("config", {}), f"config stored in {source}")
    for key, value in overrides.items():  # where the run's data is now
        OmegaConf.update(cfg, key, value)
    run_dir = source.parent.parent if source.parent.name == "checkpoints" else source.parent
    target = Path(args.output) if args.output else run_dir / OUTPUTS[args.format]
    if args.format == "hf":
        check_hugging_face_target(target)
    which = weight_choice.choose(source, state, args.weights, f"--weights {args.weights}")
    weights = weight_choice.read(source, state, which)
    if args.format == "pt":
        checkpoint.export_model(weights, target, state["step"], cfg, which)
        if target.resolve() == (run_dir / checkpoint_files.MODEL_FILE).resolve():
            record_export(run_dir, source, args.best, state["step"], which)
    else:
        model, data = built_model(source, weights, cfg)
        if args.format == "safetensors":
            write_safetensors(model, target, state["step"], cfg, which)
        else:
            write_hugging_face(model, data, target, cfg)
    print(f"wrote {target}: {weight_choice.describe(which, source, state['step'])}")


def record_export(run_dir: Path, source: Path, best: bool, step: int, which: str) -> None:
    """The run's summary.json says what its model.pt now holds (`exported`, as the end of
    training writes it): from the best checkpoint, the last (the run's newest checkpoint) or
    another checkpoint; which weights. Without a summary.json there is nothing to say it in."""
    path = run_dir / report.SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    newest = checkpoint_files.list_checkpoints(run_dir / "checkpoints")[-1:]
    origin = "best" if best else "last" if [source] == newest else "checkpoint"
    summary["exported"] = {"from": origin, "step": step, "weights": which}
    writes.write_text(path, json.dumps(summary, indent=1))


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


def built_model(source: Path, weights: dict, cfg: DictConfig) -> tuple[torch.nn.Module,
                                                                        DataModule]:
    """The bare model that the checkpoint's config builds (your recipe files, the run's data for
    the input shape, as evaluate.py builds it), holding the chosen weights."""
    # The export's one line is its output: no progress bars of a Hugging Face model's loading
    # and saving (transformers reads this when a builder, or your model.py, imports it).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    model = build_model(cfg.model, task.input_shape(data.first_samples()[0]), task.num_outputs)
    checkpoint_load.load_model_weights(model, source, weights)
    return model.eval(), data


def write_safetensors(model: torch.nn.Module, target: Path, step: int, cfg: DictConfig,
                      which: str) -> None:
    """The weights keyed by parameter name, with the step, which weights (averaged or trained),
    the release and the config (JSON) as metadata. safetensors stores no shared tensors:
    save_model writes a tied weight (model.name=gpt's head.weight, the token embedding's) once
    and records each dropped name in the metadata, mapped to the name it kept;
    safetensors.torch.load_model restores both."""
    from safetensors.torch import save_model

    metadata = {"format": "pt", "step": str(step), "weights": which,
                "template_version": ddpkit.__version__,
                "config": json.dumps(OmegaConf.to_container(cfg))}
    written_in_place(target, lambda path: save_model(model, str(path), metadata))


def write_hugging_face(model: torch.nn.Module, data: DataModule, target: Path,
                       cfg: DictConfig) -> None:
    """A Hugging Face model's save_pretrained folder, with the token data's tokenizer (if it has
    one) saved beside it, so that from_pretrained and sample.py open it as it is."""
    transformers = sys.modules.get("transformers")  # imported by any builder of such a model
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        raise UserError(f"--format hf: model.name={cfg.model.name} builds a "
                        f"{type(model).__name__}, not a Hugging Face PreTrainedModel: export it "
                        "with --format safetensors")
    meta = getattr(data.splits.train, "meta", None) or {}
    tokenizer = (Vocabulary(meta).tokenizer
                 if meta.get("tokenizer") not in (None, "characters") else None)

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    written_in_place(target, save)


def check_hugging_face_target(target: Path) -> None:
    """The folder --format hf may replace: none yet, or one that save_pretrained wrote."""
    if target.exists() and not (target / "config.json").is_file():
        raise UserError(f"{target} exists and is not a Hugging Face model's folder: give "
                        "another output folder, or remove it")


def written_in_place(target: Path, write) -> None:
    """`write(path)` makes a file or folder that replaces `target` whole (writes.write_whole:
    never half written, nothing left by a failed write, the umask's permissions where
    safetensors would keep its files to their owner)."""
    from safetensors import SafetensorError  # (both formats that come here write with it)

    def write_or_say_why(path: Path) -> None:
        try:
            write(path)
        except SafetensorError as error:
            raise as_os_error(error) from None

    write_whole(target, write_or_say_why, advice="free space there, or give another output path")


def as_os_error(error: Exception) -> OSError:
    """safetensors' I/O errors ("... No space left on device (os error 28) ...") as the OSError
    they stand for, so that a full disk is reported as any other write's is."""
    if isinstance(error, OSError):
        return error
    code = re.search(r"\(os error (\d+)\)", str(error))
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else OSError(str(error))


if __name__ == "__main__":
    lifecycle.run_main(main, one_shot=True)
