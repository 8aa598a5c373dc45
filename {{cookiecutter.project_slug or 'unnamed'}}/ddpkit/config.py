"""Experiment configuration: loading, merging and checking a run's settings.

A run's configuration is built in three layers, each overriding the one before:

    the schema (ddpkit/schema.py)  <-  configs/default.yaml (or --config FILE)  <-  key=value

Unknown keys and values of the wrong type are rejected with one line that names the key; the
values are checked against what each setting declares in the schema, and the settings that
depend on each other here. This module does not import torch, so `run.sh` can check a command
line in a fraction of a second before it starts any worker (`python config.py --world-size 2
optim.lr=0.01`).
"""

import difflib
import functools
import math
import sys
import textwrap
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ddpkit.project import PROJECT_DIR, UserError
from ddpkit.schema import (
    DECLARED,
    SCHEDULE_NAMES,
    Config,
    declarations,
    names_near_the_templates,
    schema,
)

DEFAULT_CONFIG_FILE = PROJECT_DIR / "configs" / "default.yaml"

TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
              bool | None: "true, false or null (null: chosen automatically)",
              bool | str: "true, false or a name",
              int | str: "a whole number or a name (auto)",
              list[int]: "a list of whole numbers, e.g. [100,200]",
              dict[str, Any]: "a mapping of names to values, e.g. optim.args.momentum=0.9"}

# Old launchers (`python -m torch.distributed.launch`) append --local_rank=N / --local-rank=N.
# torchrun puts the same value in LOCAL_RANK, which is what dist_utils reads. Deprecated, removed
# in release 2.0.0 (CHANGELOG.md): torch deprecated that launcher for torchrun (torch 2.0).
LAUNCHER_FLAGS = ("--local_rank", "--local-rank")


def schema_type(dotted_key: str):
    """The Python type the schema declares for `section.key`, or None if there is no such key.
    Any key of a mapping (optim.args.<name>) is one: its type is the mapping's value type."""
    node = schema()
    for part in dotted_key.split("."):
        if get_origin(node) is dict:
            node = get_args(node)[1]
            continue
        if not is_dataclass(node):
            return None
        match = [f for f in fields(node) if f.name == part]
        if not match:
            return None
        node = match[0].type
    return node


def _given_value(layer, key: str):
    """What the user wrote for `key` in a layer (a list of overrides or a loaded YAML file)."""
    if isinstance(layer, list):
        values = [item.partition("=")[2] for item in layer if item.partition("=")[0] == key]
        return values[-1] if values else None
    return OmegaConf.select(layer, key, default=None, throw_on_missing=False)


def _explain(error: OmegaConfBaseException, source: str, layer) -> UserError:
    """Turn an OmegaConf error into one sentence naming the key and what it accepts."""
    key = getattr(error, "full_key", None) or getattr(error, "key", None)
    if not key:
        return UserError(f"cannot apply {source}: {str(error).splitlines()[0]}")
    if isinstance(error, ConfigKeyError):
        parent, _, leaf = str(key).rpartition(".")
        section = schema_type(parent) if parent else Config
        known = [f.name for f in fields(section)] if is_dataclass(section) else []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        where = f"section {parent}" if parent else "the config"
        return UserError(
            f"{key} is not a config key ({source}); {where} has: {', '.join(known)}{hint}"
        )
    expected = TYPE_WORDS.get(schema_type(str(key)), "a section, not a value")
    value = _given_value(layer, str(key))
    return UserError(f"{key}={value} is not valid ({source}): {key} must be {expected}")


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    """Split a command line into the YAML file to start from and key=value overrides."""
    config_file = DEFAULT_CONFIG_FILE
    overrides = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        flag, has_value, value = arg.partition("=")
        if flag in LAUNCHER_FLAGS:
            if not has_value and args and args[0].isdigit():
                args.pop(0)
        elif flag == "--config":
            if not has_value:
                if not args:
                    raise UserError("--config needs a file: --config configs/my_experiment.yaml")
                value = args.pop(0)
            config_file = Path(value)
        elif arg.startswith("-"):
            raise UserError(
                f"unknown option {arg}: options are --config FILE and key=value overrides "
                "such as optim.lr=0.01 (see configs/default.yaml for every key)"
            )
        elif not has_value or not flag:
            raise UserError(f"{arg!r} is not a key=value override, e.g. train.epochs=5")
        elif is_dataclass(schema_type(flag)):
            example = f"{flag}.{fields(schema_type(flag))[0].name}="
            raise UserError(f"{flag} is a section: set its keys one at a time, e.g. {example}")
        else:
            overrides.append(arg)
    return config_file, overrides


def _check_values(cfg: DictConfig, world_size: int | None) -> None:
    """Each value against its declaration in the schema, then the settings that depend on each
    other; with `world_size`, the batch split too."""
    values = dict(_leaves(OmegaConf.to_container(cfg, resolve=False)))
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key}={value} is not valid: it must be a finite number")
    for key, declared in declarations().items():
        if (problem := declared.problem(values.get(key))) is not None:
            raise UserError(f"{key}={values[key]} is not valid: {problem}")
    _check_together(cfg)
    if cfg.train.max_steps:
        check_profile_steps(cfg, cfg.train.max_steps)  # with the data known: run_setup too
    if world_size is not None:
        check_batch_divides(cfg, world_size)


def _leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every value of a config, as OmegaConf.to_container gives it."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_together(cfg: DictConfig) -> None:
    """Settings whose values are fine alone but not with each other's."""
    data, optim, parallel = cfg.data, cfg.optim, cfg.parallel
    if data.val_fraction + data.test_fraction >= 1:
        raise UserError("data.val_fraction + data.test_fraction must leave samples to train on")
    if cfg.eval.save_predictions and cfg.eval.binned_thresholds:
        raise UserError("eval.save_predictions=true needs every sample's row, which "
                        "eval.binned_thresholds does not keep: set one of them to its default")
    if parallel.strategy == "fsdp" and cfg.speed.precision == "fp16":
        raise UserError("parallel.strategy=fsdp does not take speed.precision=fp16 (its loss "
                        "scaler is not shard-aware): use speed.precision=bf16 or fp32")
    if cfg.train.export == "ema" and not cfg.train.ema_decay:
        raise UserError("train.export=ema needs averaged weights: set train.ema_decay (e.g. "
                        "0.999), or train.export=last")
    if cfg.train.export == "best" and not cfg.train.keep_best:
        raise UserError("train.export=best needs the best checkpoint: set train.keep_best=true, "
                        "or train.export=last")
    if parallel.cpu_offload and parallel.strategy != "fsdp":
        raise UserError("parallel.cpu_offload=true keeps FSDP's shards in CPU memory, which "
                        f"parallel.strategy={parallel.strategy} does not have: set "
                        "parallel.strategy=fsdp, or leave parallel.cpu_offload=false")
    if optim.schedule == "step" and not optim.step_size:
        raise UserError("optim.schedule=step needs optim.step_size, the optimizer steps between "
                        "decays, e.g. optim.step_size=1000")
    if optim.schedule == "multistep" and not optim.milestones:
        raise UserError("optim.schedule=multistep needs optim.milestones, the steps that decay, "
                        "e.g. optim.milestones=[1000,2000]")


def check_profile_steps(cfg: DictConfig, total_steps: int) -> None:
    """The profiled steps start within a run of `total_steps` steps."""
    profile = cfg.profile
    if profile.enabled and profile.start_step > total_steps:
        raise UserError(f"profile.start_step={profile.start_step} comes after the run's last "
                        f"step ({total_steps}), so nothing would be profiled: set "
                        "profile.start_step to a step of the run")


def inactive_settings(cfg: DictConfig, given: list[str]) -> list[str]:
    """One line for each setting the command line (or a config file) gives that cannot take
    effect with the others (its declaration's acts_with): a schedule's numbers under another
    schedule, a DDP option under FSDP, a profiler setting with the profiler off. A value of
    yours (a schedule in model.py) may read any of them: nothing is said then."""
    found = []
    for key in given:
        declared = declarations().get(key)
        if declared is None or not declared.acts_with:
            continue
        other, *values = declared.acts_with
        value = OmegaConf.select(cfg, other)
        known = getattr(declarations().get(other), "known", ())
        if (known and value not in known) or (value in values if values else value):
            continue
        wanted = " or ".join(str(v).lower() for v in values) if values else "a value above 0"
        found.append(f"{key}={OmegaConf.select(cfg, key)} has no effect with {other}="
                     f"{str(value).lower()}: it acts only with {other}={wanted}")
    return found


def warmup_kept(cfg: DictConfig, given: list[str]) -> str | None:
    """One line when a schedule chosen by the command line or a config file keeps the default
    warmup it did not ask for (optim.schedule=step still ramps the rate up first)."""
    optim = cfg.optim
    if ("optim.schedule" not in given or "optim.warmup_steps" in given or not optim.warmup_steps
            or optim.schedule not in SCHEDULE_NAMES):  # a schedule of yours does its own warmup
        return None
    return (f"optim.schedule={optim.schedule} keeps the default warmup: the rate rises from "
            f"lr/{optim.warmup_steps} to lr over the first {optim.warmup_steps} steps "
            "(optim.warmup_steps=0 for none)")


# Deprecated, removed in release 2.0.0 (CHANGELOG.md): train.export=ema, which the rule of
# docs/checkpoints.md ("Which weights") made the same as train.export=last.
def deprecated_settings(cfg: DictConfig) -> str | None:
    """One line for a deprecated value, naming what to write instead."""
    if cfg.train.export == "ema":
        return ("train.export=ema is deprecated (removed in release 2.0.0): a run that keeps "
                "averaged weights exports them with train.export=last, the default; write that")
    return None


def notes_at_start(cfg: DictConfig, given: list[str]) -> list[str]:
    """What a run says once as it starts (rank 0) about settings that may not be what was
    meant: a kept warmup, a setting of settings.py named like one of the template's, a
    deprecated value."""
    return [note for note in (warmup_kept(cfg, given), *names_near_the_templates(),
                              deprecated_settings(cfg)) if note]


def accumulation_steps(cfg: DictConfig, world_size: int) -> int:
    """The micro-batches of an optimizer step at this world size: train.grad_accum_steps, or,
    with train.micro_batch_size, what the global batch needs at that many samples a pass."""
    micro = cfg.train.micro_batch_size
    if micro == "auto":  # each rank's whole share a pass until ddpkit/micro_batch.py has tried
        return 1
    return cfg.train.global_batch_size // (world_size * micro) if micro else (
        cfg.train.grad_accum_steps)


def check_batch_divides(cfg: DictConfig, world_size: int, where: str = "") -> None:
    """The global batch splits evenly over the processes (and their accumulation steps).
    `where` says, after the process count, when that count is one of several (an elastic job)."""
    train = cfg.train
    batch, micro, accum = train.global_batch_size, train.micro_batch_size, train.grad_accum_steps
    if micro and accum != 1:
        raise UserError(f"train.micro_batch_size={micro} and train.grad_accum_steps={accum} "
                        "both set the accumulation: leave train.grad_accum_steps at 1 (it "
                        "follows from the micro-batch)")
    if micro == "auto":  # the tries keep to divisors of each rank's share
        micro = 0
    if micro:
        parts = world_size * micro
        split = (f"into micro-batches of train.micro_batch_size={micro} on the {world_size} "
                 f"processes{where}")
    else:
        parts = world_size * accum
        split = f"by the {world_size} processes{where}" + (
            f" x {accum} accumulation steps" if accum > 1 else "")
    if batch % parts:
        raise UserError(f"train.global_batch_size={batch} does not divide {split}: use a "
                        f"multiple of {parts}, e.g. train.global_batch_size="
                        f"{batch - batch % parts or parts}")


def load_config(argv: list[str], world_size: int | None = None) -> DictConfig:
    """Build the run's config from a command line; raises UserError naming what to fix.

    With `world_size`, also checks what depends on the process count (the batch split).
    """
    config_file, overrides = parse_args(argv)
    cfg = OmegaConf.structured(schema())
    if not config_file.is_file():
        raise UserError(f"config file not found: {config_file}")
    try:
        file_cfg = OmegaConf.load(config_file)
    except Exception as error:  # YAML syntax errors come in several types
        raise UserError(f"{config_file} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(file_cfg, DictConfig):
        raise UserError(f"{config_file} must hold sections such as 'train:', not a list")
    for layer, source in ((file_cfg, str(config_file)), (overrides, "command line")):
        try:
            as_config = OmegaConf.from_dotlist(layer) if isinstance(layer, list) else layer
            cfg = OmegaConf.merge(cfg, as_config)
        except (ConfigKeyError, ValidationError) as error:
            raise _explain(error, source, layer) from None
        except OmegaConfBaseException as error:
            raise UserError(f"cannot apply {source}: {str(error).splitlines()[0]}") from None
    try:
        OmegaConf.resolve(cfg)  # ${...} interpolations become plain values now, not at use
    except OmegaConfBaseException as error:
        raise UserError(f"cannot resolve an interpolation: {str(error).splitlines()[0]}") from None
    _check_values(cfg, world_size)
    return cfg


def given_keys(argv: list[str]) -> list[str]:
    """The keys a command line sets: its key=value overrides and the keys of a --config file
    other than the default one (whose values are the defaults)."""
    config_file, overrides = parse_args(argv)
    keys = [item.partition("=")[0] for item in overrides]
    if config_file.resolve() != DEFAULT_CONFIG_FILE and config_file.is_file():
        keys = _dotted_keys(OmegaConf.load(config_file), "") + keys
    return list(dict.fromkeys(keys))


def _dotted_keys(node, prefix: str) -> list[str]:
    if not isinstance(node, DictConfig):
        return [prefix]
    return [key for name, child in node.items_ex(resolve=False)
            for key in _dotted_keys(child, f"{prefix}.{name}" if prefix else str(name))]


def lookup(registry: dict, name: str, key: str, what: str):
    """`registry[name]`, or the object that `module:attribute` or `path/to/file.py:attribute`
    names (code of your own outside the registry's file; a relative path is taken from the
    project folder). Anything else is a UserError naming `key` and the choices."""
    if name in registry:
        return registry[name]
    module_name, colon, attribute = name.rpartition(":")
    if not (colon and module_name and attribute):
        choices = f"choose one of {', '.join(registry)}, or " if registry else ""
        raise UserError(f"{key}={name} is not {what}: {choices}name one of your own as "
                        "module:name or path/file.py:name")
    try:
        module = _import_module(module_name)
        return getattr(module, attribute)
    except (ImportError, AttributeError, FileNotFoundError) as error:
        raise UserError(f"{key}={name}: cannot import it ({error})") from None


def _import_module(name: str):
    """A module by name, or by the path of its file: that file's folder joins sys.path (so
    DataLoader workers started by spawn or forkserver can import it too) and it is imported by
    its file name."""
    import importlib

    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = (Path(name) if Path(name).is_absolute() else PROJECT_DIR / name).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    known = sys.modules.get(path.stem)
    if known is not None and Path(getattr(known, "__file__", "") or "").resolve() != path:
        raise ImportError(f"a module named {path.stem} is already imported from "
                          f"{getattr(known, '__file__', 'elsewhere')}: rename {path.name}")
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return importlib.import_module(path.stem)


def config_from_dict(values: dict, source: str) -> DictConfig:
    """Rebuild a validated config from a plain dict, e.g. the one stored in a checkpoint."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema()), values)
    except (ConfigKeyError, ValidationError) as error:
        raise _explain(error, source, values) from None
    _check_values(cfg, None)
    return cfg


YAML_HEADER = """\
# Every setting of the template, its default and what it does. This file is written from the
# schema, ddpkit/schema.py, by `python config.py --write-defaults`: change a setting there, not
# here (tests/test_config.py fails when the two differ). Override any key on the command line:
#   ./run.sh train.epochs=50 optim.lr=0.001
# or put the keys you change in a file of your own and pass it with
# --config configs/my_experiment.yaml: the keys it leaves out keep these defaults.
# Settings of your own are declared and documented in settings.py.
"""


def default_yaml() -> str:
    """configs/default.yaml: the schema's sections (not settings.py's), each section under its
    docstring and each setting under its doc, in lines of at most 100 characters."""
    wrap = functools.partial(textwrap.wrap, break_long_words=False, break_on_hyphens=False)
    lines = [YAML_HEADER.rstrip("\n")]
    for section in fields(Config):
        lines += ["", *wrap(" ".join(section.type.__doc__.split()), width=100,
                            initial_indent="# ", subsequent_indent="# ")]
        lines.append(f"{section.name}:")
        for setting in fields(section.type):
            declared = setting.metadata[DECLARED]
            doc = declared.doc + (f" One of: {declared.choices_in_words()}."
                                  if declared.choices else "")
            lines += wrap(doc, width=100, initial_indent="  # ", subsequent_indent="  # ")
            default = (setting.default_factory() if setting.default is MISSING
                       else setting.default)
            lines.append(f"  {setting.name}: {yaml_value(default)}")
    return "\n".join(lines) + "\n"


def yaml_value(value) -> str:
    """A default as YAML writes it in flow style, on one line ("" for an empty string)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1000).split("\n")[0]
    return '""' if text == "''" else text


def write_defaults(path: Path = DEFAULT_CONFIG_FILE) -> None:
    """Write configs/default.yaml from the schema, whole or not at all."""
    from ddpkit import writes

    writes.write_text(path, default_yaml())


def main(argv: list[str]) -> int:
    """`python config.py [--world-size N] [--config FILE] [key=value ...]`: check, print YAML;
    `python config.py --write-defaults`: write configs/default.yaml from the schema."""
    if argv == ["--write-defaults"]:
        write_defaults()
        print(f"wrote {DEFAULT_CONFIG_FILE.relative_to(PROJECT_DIR)} from ddpkit/schema.py")
        return 0
    world_size = None
    try:
        if argv[:1] == ["--world-size"]:
            if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
                raise UserError("--world-size needs a whole number of processes, at least 1")
            world_size, argv = int(argv[1]), argv[2:]
        cfg = load_config(argv, world_size)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if world_size is None:
        print(OmegaConf.to_yaml(cfg), end="")
    return 0
