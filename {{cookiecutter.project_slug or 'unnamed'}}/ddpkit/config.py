"""Experiment configuration: one typed schema holds every default.

A run's configuration is built in three layers, each overriding the one before:

    the dataclasses below  <-  configs/default.yaml (or --config FILE)  <-  key=value arguments

Unknown keys and values of the wrong type are rejected with one line that names the key.
This module does not import torch, so `run.sh` can check a command line in a fraction of a
second before it starts any worker (`python config.py --world-size 2 optim.lr=0.01`).
"""

import difflib
import functools
import math
import sys
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ddpkit import recipes
from ddpkit.project import PROJECT_DIR, UserError

DEFAULT_CONFIG_FILE = PROJECT_DIR / "configs" / "default.yaml"


@dataclass
class RunConfig:
    name: str = "digits-mlp"  # prefix of the run folder's name
    output_dir: str = "runs"  # run folders are created here
    dir: str = ""  # use exactly this run folder instead of a new timestamped one
    seed: int = 0  # model init and data order; the same on every rank


# The data, model and task sections are extended by your classes in settings.py (see schema()):
# a field declared there is a setting of that section like the ones below.
@dataclass
class DataConfig:
    # A key of DATASETS: digits, digits_files, synthetic, images, breast_cancer, diabetes, or
    # yours (data_sources.py); or module:function for a builder in another module.
    dataset: str = "digits"
    root: str = ""  # where a dataset read from disk lives ("": the dataset's own default)
    augment: bool = True  # training-split augmentation, for datasets that have one
    val_fraction: float = 0.15
    test_fraction: float = 0.2
    split_seed: int = 0  # fixes the train/val/test split, independent of run.seed
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process)
    worker_start_method: str = "forkserver"  # forkserver | spawn | fork (fork is unsafe with CUDA)
    synthetic_samples: int = 2000  # synthetic and images
    synthetic_features: int = 32  # synthetic
    synthetic_classes: int = 4  # synthetic and images
    image_size: int = 32  # images: 3 x image_size x image_size


@dataclass
class ModelConfig:
    name: str = "mlp"  # a key of MODELS: mlp (any input) | cnn (image inputs), or yours (model.py)
    hidden_dim: int = 256  # mlp: width of the hidden layers
    channels: int = 32  # cnn: channels of the first convolution (doubling in each later one)
    num_layers: int = 2  # mlp: hidden layers; cnn: resolution-halving convolutions
    dropout: float = 0.1
    batchnorm: bool = False  # BatchNorm after each hidden (mlp) or convolution (cnn) layer
    sync_batchnorm: bool = False  # convert BatchNorm to SyncBatchNorm (statistics over all ranks)


@dataclass
class TaskConfig:
    # What is predicted and how it is scored: a key of TASKS (multiclass, binary,
    # regression, or yours) or module:Class; "": the task the dataset is made for.
    name: str = ""
    pos_weight: float = 1.0  # binary: weight of the positive class in the loss (1: unweighted)
    # Dict samples: the key of the target; every other key reaches the model as a keyword argument
    target_key: str = "target"


@dataclass
class OptimConfig:
    # Any torch.optim optimizer by class name, case-insensitive (adamw, adam, sgd, rmsprop, ...),
    # or a key of OPTIMIZERS (model.py). docs/optimization.md
    name: str = "adamw"
    lr: float = 0.002  # each parameter group's base rate (your groups may set their own)
    # Biases and normalisation weights get none (or your groups' own, optim.param_groups)
    weight_decay: float = 0.01
    # The optimizer's other keyword arguments: optim.args.momentum=0.9 optim.args.nesterov=true
    args: dict[str, Any] = field(default_factory=dict)
    param_groups: str = ""  # a key of PARAM_GROUPS (model.py); "": decay / no-decay groups
    warmup_steps: int = 20  # linear warmup from lr / warmup_steps to lr
    # After warmup: cosine | linear | step | multistep | constant | plateau, or a key of
    # SCHEDULES (model.py)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0  # the floor of every schedule, as a share of each group's lr
    step_size: int = 0  # step: optimizer steps between decays (counted from step 0)
    milestones: list[int] = field(default_factory=list)  # multistep: the steps that decay
    gamma: float = 0.1  # step, multistep, plateau: the factor of each decay
    plateau_patience: int = 2  # plateau: validations without improvement before a decay
    grad_clip: float = 0.0  # clip the global gradient norm to this; 0: no clipping


@dataclass
class TrainConfig:
    epochs: int = 30
    global_batch_size: int = 64  # summed over all processes; each rank takes 1/world_size of it
    grad_accum_steps: int = 1  # micro-batches per optimizer step (each rank: batch / this)
    # Samples per process in one forward pass; 0: global batch / (processes x grad_accum_steps).
    # Set, the accumulation steps follow from it at each world size (global / (processes x
    # this)): an elastic job that shrinks keeps each process's memory and the global batch.
    micro_batch_size: int = 0
    max_steps: int = 0  # stop after this many optimizer steps; 0: run all epochs
    log_every: int = 50  # steps between logged (and cross-rank reduced) training scalars
    ckpt_every: int = 200  # steps between checkpoints; 0 saves only at the end
    keep_checkpoints: int = 3  # keep the newest k checkpoints of a run; 0 keeps all
    checkpoint_async: bool = False  # write checkpoints in the background; training goes on
    resume: str = "auto"  # auto (this run's last checkpoint, if any) | never | <run or checkpoint>
    device: str = "auto"  # auto (cuda when available) | cuda | cpu
    progress_bar: bool = True  # tqdm bar on rank 0 when attached to a terminal
    plot_curves: bool = True  # rank 0 draws <run>/curves.png (loss, metric, lr) at the end
    # A smoke test in seconds: 2 training steps, a checkpoint, 1 validation and 1 test batch on
    # every rank, in a temporary folder removed at the end; prints ok or the first error
    fast_dev_run: bool = False
    # Shorter epochs for short real runs: N >= 1 a number of batches, 0 < f < 1 a fraction of
    # them, 0 all. Training: global batches (optimizer steps) per epoch; validation: batches of
    # eval.batch_size per rank (its metrics are then those of the part seen)
    limit_train_batches: float = 0.0
    limit_val_batches: float = 0.0
    # Validation (ddpkit/validation.py): after every epoch, and every N steps besides; 0: only
    # at the end of each epoch
    val_every_steps: int = 0
    # Keep the checkpoint of the best validation (train.best_metric) beside the newest k
    keep_best: bool = True
    best_metric: str = ""  # a validation metric (accuracy, loss, ...); "": the task's headline
    best_mode: str = "auto"  # auto (loss-like names lower, others higher) | max | min
    early_stop_patience: int = 0  # stop after N validations without improvement; 0: never
    early_stop_min_delta: float = 0.0  # the least change of best_metric that counts as one
    export: str = "last"  # last | best: the weights model.pt is written from at the end


@dataclass
class ProfileConfig:
    # torch.profiler over a few training steps: one trace per rank in <run>/profile/ (TensorBoard
    # or https://ui.perfetto.dev), and the top operations printed by rank 0
    enabled: bool = False
    start_step: int = 10  # the first step recorded (the step before it warms the profiler up)
    steps: int = 5  # steps recorded
    memory: bool = True  # tensor allocations and frees (the memory view)
    with_stack: bool = True  # the Python stack of every operation (larger traces)
    top_ops: int = 15  # rows of the table printed at the end


@dataclass
class TrackingConfig:
    # Experiment trackers beside TensorBoard, logged by rank 0 (trackers.py). One tracker run
    # per job, continued after a restart, a resume or a requeue.
    mlflow: bool = False  # needs pip install -e '.[mlflow]'
    mlflow_uri: str = ""  # "": sqlite:///<run.output_dir>/mlflow.db (artifacts beside it)
    wandb: bool = False  # needs pip install -e '.[wandb]'
    wandb_mode: str = "auto"  # auto (online when logged in, else offline) | online | offline
    project: str = ""  # MLflow experiment / W&B project; "": the project folder's name
    run_name: str = ""  # "": the run folder's name
    # A tracker call (MLflow / W&B) that takes longer is given up, and the tracker dropped for
    # the rest of the run: a server that never answers does not hold training up.
    timeout_seconds: float = 30.0


@dataclass
class DDPConfig:
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout_minutes: float = 10.0  # a collective waiting longer than this fails instead of hanging
    find_unused_parameters: bool = False  # needed only if forward skips some parameters
    static_graph: bool = False  # same used parameters every step: lets DDP optimise
    gradient_as_bucket_view: bool = True  # gradients alias DDP's buckets: saves a copy
    # PyTorch's distributed debug mode for this run (TORCH_DISTRIBUTED_DEBUG=INFO, or DETAIL if
    # the environment sets it): DDP names the parameters that got no gradient and logs its
    # set-up and timing statistics
    debug: bool = False


@dataclass
class ParallelConfig:
    # ddp: every process holds the whole model, its gradients and optimizer state (settings in
    # ddp.*) | fsdp: FSDP2, each process holds 1/N of them and gathers a block's weights while
    # it runs: for models that do not fit one device
    strategy: str = "ddp"
    reshard_after_forward: bool = True  # fsdp: free gathered weights after forward (less memory)
    cpu_offload: bool = False  # fsdp: keep the weight and optimizer shards in CPU memory


@dataclass
class SpeedConfig:
    precision: str = "auto"  # auto (bf16 on GPUs that have it, else fp32) | fp32 | bf16 | fp16
    tf32: bool = True  # TensorFloat-32 for float32 matmuls and convolutions (Ampere+ GPUs only)
    channels_last: bool | None = None  # null: auto (true for image batches on CUDA)
    compile: bool = False  # torch.compile the model: faster steps after a slower first one
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune
    # null: auto (true on CUDA and CPU): optim.name=adamw or adam in one kernel where torch has it
    fused_adamw: bool | None = None


@dataclass
class EvalConfig:
    checkpoint: str = ""  # a run folder, a checkpoint folder or a model.pt; "": the newest run
    split: str = "test"  # test | val
    batch_size: int = 256  # per process; evaluation has no global-batch semantics
    output_dir: str = ""  # default: <run folder>/eval-<split>
    save_predictions: bool = False  # also write predictions.npz (split order) for your own use
    curve_points: int = 200  # points kept per curve in curves.json, plots and TensorBoard
    plot_classes: int = 10  # multiclass plots: the classes with the lowest AP, plus micro average
    # 0: exact metrics from every sample's row (memory: samples x row width per rank);
    # N: constant memory, curves and AP counted at N score thresholds (splits of millions)
    binned_thresholds: int = 0


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


EXTENDED = {"data": (DataConfig, "DataSettings"), "model": (ModelConfig, "ModelSettings"),
            "task": (TaskConfig, "TaskSettings")}


@functools.cache
def schema() -> type:
    """Config with its data, model and task sections extended by your classes in settings.py
    (yours come first; a name the template's section has too is the template's)."""
    settings = recipes.load_settings()
    sections = []
    for name, (template, yours) in EXTENDED.items():
        mine = getattr(settings, yours, None)
        if not is_dataclass(mine):
            raise UserError(f"settings.py must define the dataclass {yours} (keep it, even empty)")
        section = dataclass(type(template.__name__, (template, mine), {}))
        sections.append((name, section, field(default_factory=section)))
    return make_dataclass("Config", sections, bases=(Config,))


# The built-in schedules (ddpkit/schedules.py); optim.schedule may also name one of yours.
SCHEDULE_NAMES = ("cosine", "linear", "step", "multistep", "constant", "plateau")
CHOICES = {
    "data.worker_start_method": ("forkserver", "spawn", "fork"),
    "train.device": ("auto", "cuda", "cpu"),
    "tracking.wandb_mode": ("auto", "online", "offline"),
    "ddp.backend": ("auto", "nccl", "gloo"),
    "parallel.strategy": ("ddp", "fsdp"),
    "speed.precision": ("auto", "fp32", "bf16", "fp16"),
    "speed.compile_mode": ("default", "reduce-overhead", "max-autotune"),
    "eval.split": ("test", "val"),
    "train.best_mode": ("auto", "max", "min"),
    "train.export": ("last", "best"),
}
POSITIVE = (
    "data.synthetic_samples", "data.synthetic_features", "data.image_size", "model.hidden_dim",
    "model.channels",
    "optim.lr",
    "train.epochs", "train.global_batch_size", "train.grad_accum_steps", "train.log_every",
    "profile.start_step", "profile.steps", "profile.top_ops",
    "ddp.timeout_minutes", "task.pos_weight", "tracking.timeout_seconds",
    "eval.batch_size", "eval.plot_classes",
)
NON_NEGATIVE = (
    "data.num_workers", "model.num_layers", "optim.weight_decay", "optim.warmup_steps",
    "optim.grad_clip", "optim.step_size", "optim.plateau_patience",
    "train.ckpt_every", "train.max_steps", "train.micro_batch_size", "train.keep_checkpoints",
    "eval.binned_thresholds",
    "train.limit_train_batches", "train.limit_val_batches", "train.val_every_steps",
    "train.early_stop_patience", "train.early_stop_min_delta",
)
TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
              bool | None: "true, false or null (null: chosen automatically)",
              list[int]: "a list of whole numbers, e.g. [100,200]",
              dict[str, Any]: "a mapping of names to values, e.g. optim.args.momentum=0.9"}

# Old launchers (`python -m torch.distributed.launch`) append --local_rank=N / --local-rank=N.
# torchrun puts the same value in LOCAL_RANK, which is what dist_utils reads.
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


SEEDS = ("run.seed", "data.split_seed")  # numpy takes seeds from 0 to 2**32 - 1
MIN_TIMEOUT_MINUTES = 0.5  # the stall watchdog samples every few seconds: shorter is all noise


def _check_numbers(cfg: DictConfig) -> None:
    """Values every key must meet whatever its meaning: finite, seeds numpy takes."""
    for key, value in _leaves(OmegaConf.to_container(cfg, resolve=False)):
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key}={value} is not valid: it must be a finite number")
    for key in SEEDS:
        if not 0 <= OmegaConf.select(cfg, key) < 2**32:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} is not valid: a seed must be "
                            f"between 0 and {2**32 - 1}")
    if not 0 <= cfg.model.dropout < 1:
        raise UserError(f"model.dropout={cfg.model.dropout} is not valid: it must be at least 0 "
                        "and below 1")
    if cfg.ddp.timeout_minutes < MIN_TIMEOUT_MINUTES:
        raise UserError(f"ddp.timeout_minutes={cfg.ddp.timeout_minutes} is too short: below "
                        f"{MIN_TIMEOUT_MINUTES} every healthy step would be reported as a stall")


def _leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every value of a config, as OmegaConf.to_container gives it."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_values(cfg: DictConfig, world_size: int | None) -> None:
    _check_numbers(cfg)
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value} is not valid: choose one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not OmegaConf.select(cfg, key) > 0:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} is not valid: it must be > 0")
    for key in NON_NEGATIVE:
        if OmegaConf.select(cfg, key) < 0:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} is not valid: it must be >= 0")
    for key in ("data.val_fraction", "data.test_fraction"):
        if not 0 < OmegaConf.select(cfg, key) < 1:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} must be between 0 and 1")
    if cfg.data.val_fraction + cfg.data.test_fraction >= 1:
        raise UserError("data.val_fraction + data.test_fraction must leave samples to train on")
    if cfg.eval.save_predictions and cfg.eval.binned_thresholds:
        raise UserError("eval.save_predictions=true needs every sample's row, which "
                        "eval.binned_thresholds does not keep: set one of them to its default")
    if cfg.parallel.strategy == "fsdp" and cfg.speed.precision == "fp16":
        raise UserError("parallel.strategy=fsdp does not take speed.precision=fp16 (its loss "
                        "scaler is not shard-aware): use speed.precision=bf16 or fp32")
    if cfg.eval.curve_points < 2:
        raise UserError(f"eval.curve_points={cfg.eval.curve_points} is not valid: it must be >= 2")
    for key in ("train.limit_train_batches", "train.limit_val_batches"):
        value = OmegaConf.select(cfg, key)
        if value >= 1 and value != int(value):
            raise UserError(f"{key}={value} is not valid: give a whole number of batches, a "
                            "fraction below 1, or 0 for all of them")
    if cfg.train.export == "best" and not cfg.train.keep_best:
        raise UserError("train.export=best needs the best checkpoint: set train.keep_best=true, "
                        "or train.export=last")
    if cfg.parallel.cpu_offload and cfg.parallel.strategy != "fsdp":
        raise UserError("parallel.cpu_offload=true keeps FSDP's shards in CPU memory, which "
                        f"parallel.strategy={cfg.parallel.strategy} does not have: set "
                        "parallel.strategy=fsdp, or leave parallel.cpu_offload=false")
    if cfg.train.max_steps:
        check_profile_steps(cfg, cfg.train.max_steps)  # with the data known: run_setup too
    _check_schedule(cfg.optim)
    if world_size is not None:
        check_batch_divides(cfg, world_size)


def check_profile_steps(cfg: DictConfig, total_steps: int) -> None:
    """The profiled steps start within a run of `total_steps` steps."""
    profile = cfg.profile
    if profile.enabled and profile.start_step > total_steps:
        raise UserError(f"profile.start_step={profile.start_step} comes after the run's last "
                        f"step ({total_steps}), so nothing would be profiled: set "
                        "profile.start_step to a step of the run")


def _check_schedule(optim: DictConfig) -> None:
    """The schedule's numbers (its name is checked when it is built: yours live in model.py)."""
    if not 0 <= optim.min_lr_ratio <= 1:
        raise UserError(f"optim.min_lr_ratio={optim.min_lr_ratio} is not valid: it must be "
                        "between 0 and 1 (a share of each group's learning rate)")
    if not 0 < optim.gamma < 1:
        raise UserError(f"optim.gamma={optim.gamma} is not valid: it must be above 0 and below 1 "
                        "(the factor of each decay)")
    milestones = list(optim.milestones)
    if any(m <= 0 for m in milestones) or milestones != sorted(set(milestones)):
        raise UserError(f"optim.milestones={milestones} is not valid: give increasing step "
                        "numbers above 0, e.g. optim.milestones=[1000,2000]")
    if optim.schedule == "step" and not optim.step_size:
        raise UserError("optim.schedule=step needs optim.step_size, the optimizer steps between "
                        "decays, e.g. optim.step_size=1000")
    if optim.schedule == "multistep" and not milestones:
        raise UserError("optim.schedule=multistep needs optim.milestones, the steps that decay, "
                        "e.g. optim.milestones=[1000,2000]")


# Settings that act only with another setting's value: (that setting, the values it acts with).
# Given while that setting has another value, they cannot take effect: inactive_settings says so.
ACTS_ONLY_WITH = {
    "parallel.reshard_after_forward": ("parallel.strategy", ("fsdp",)),
    "ddp.find_unused_parameters": ("parallel.strategy", ("ddp",)),
    "ddp.static_graph": ("parallel.strategy", ("ddp",)),
    "ddp.gradient_as_bucket_view": ("parallel.strategy", ("ddp",)),
    "optim.step_size": ("optim.schedule", ("step",)),
    "optim.milestones": ("optim.schedule", ("multistep",)),
    "optim.gamma": ("optim.schedule", ("step", "multistep", "plateau")),
    "optim.plateau_patience": ("optim.schedule", ("plateau",)),
    "speed.compile_mode": ("speed.compile", (True,)),
    "tracking.mlflow_uri": ("tracking.mlflow", (True,)),
    "tracking.wandb_mode": ("tracking.wandb", (True,)),
    "train.early_stop_min_delta": ("train.early_stop_patience", None),  # None: any but 0
    **{f"profile.{key}": ("profile.enabled", (True,))
       for key in ("start_step", "steps", "memory", "with_stack", "top_ops")},
}


def inactive_settings(cfg: DictConfig, given: list[str]) -> list[str]:
    """One line for each setting the command line (or a config file) gives that cannot take
    effect with the others: a schedule's numbers under another schedule, a DDP option under
    FSDP, a profiler setting with the profiler off. A schedule of yours may read any of them."""
    found = []
    for key in given:
        if key not in ACTS_ONLY_WITH:
            continue
        other, values = ACTS_ONLY_WITH[key]
        value = OmegaConf.select(cfg, other)
        if other == "optim.schedule" and value not in SCHEDULE_NAMES:
            continue
        if value in values if values is not None else value:
            continue
        wanted = (" or ".join(str(v).lower() for v in values) if values is not None
                  else "a value above 0")
        found.append(f"{key}={OmegaConf.select(cfg, key)} has no effect with {other}="
                     f"{str(value).lower()}: it acts only with {other}={wanted}")
    return found


def accumulation_steps(cfg: DictConfig, world_size: int) -> int:
    """The micro-batches of an optimizer step at this world size: train.grad_accum_steps, or,
    with train.micro_batch_size, what the global batch needs at that many samples a pass."""
    micro = cfg.train.micro_batch_size
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


def main(argv: list[str]) -> int:
    """`python config.py [--world-size N] [--config FILE] [key=value ...]`: check, print YAML."""
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

