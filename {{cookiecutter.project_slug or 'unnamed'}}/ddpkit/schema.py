"""The settings: each declared once, on its field, with its type, default, doc and the values it
takes. config.py checks a run's values against these declarations, and writes
configs/default.yaml from them (`python config.py --write-defaults`; a test keeps it so).

    lr: float = setting(0.002, "The base learning rate ...", above=0)

No torch here: run.sh checks every command line with this schema before it starts a worker.
"""

import difflib
import functools
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

from ddpkit import recipes
from ddpkit.declare import (
    DECLARED,
    Declared,
    increasing_steps,
    micro_batch_rule,
    setting,
    whole_or_fraction,
)
from ddpkit.project import UserError

__all__ = ["DECLARED", "Declared", "setting"]  # (declare.py's, for settings.py and config.py)

SEED = {"at_least": 0, "at_most": 2**32 - 1, "what": "a seed"}  # the seeds numpy takes
# The built-in schedules (ddpkit/schedules.py); optim.schedule may also name one of yours.
SCHEDULE_NAMES = ("cosine", "linear", "step", "multistep", "constant", "plateau")
# The built-in datasets (ddpkit/datasets.py's DATASETS); data.dataset may also name one of yours.
# A data setting that only some of them read says which in its acts_with (a test records what
# each one reads): given with another, it is named at the start as having no effect.
DATASET_NAMES = ("digits", "digits_files", "digits_shards", "breast_cancer", "diabetes",
                 "synthetic", "images", "tokens")
SPLIT_HERE = ("data.dataset", *(name for name in DATASET_NAMES if name != "tokens"))
FROM_DISK = ("data.dataset", "digits_files", "digits_shards", "tokens")


@dataclass
class RunConfig:
    """Where the run folder goes, and the seed."""

    name: str = setting("digits-mlp", "The start of the run folder's name; the date and time "
                        "the run started follow it.")
    output_dir: str = setting("runs", "The folder the run folders are created in.")
    dir: str = setting("", "Use exactly this run folder, instead of a new one named by run.name "
                       "and the time.")
    seed: int = setting(0, "Seeds the model's initial weights and the data order; the same on "
                        "every rank.", **SEED)


@dataclass
class DataConfig:
    """The data: which dataset, how it is split and how it is loaded. Settings of yours join
    this section from settings.py (DataSettings)."""

    dataset: str = setting("digits", "The dataset: a key of DATASETS (digits, digits_files, "
                           "synthetic, images, breast_cancer, diabetes, tokens, or one of "
                           "yours in data_sources.py), or module:function for a builder "
                           "elsewhere.", known=DATASET_NAMES)
    root: str = setting("", "Where a dataset read from disk lives; empty: the dataset's own "
                        "default folder.", acts_with=FROM_DISK)
    augment: bool = setting(True, "Augment the training split, for datasets that have an "
                            "augmentation.", acts_with=SPLIT_HERE)
    val_fraction: float = setting(0.15, "The share of the samples held out for validation.",
                                  above=0, below=1, acts_with=SPLIT_HERE)
    test_fraction: float = setting(0.2, "The share of the samples held out for the test split.",
                                   above=0, below=1, acts_with=SPLIT_HERE)
    split_seed: int = setting(0, "Fixes which samples fall in the train, validation and test "
                              "splits, independently of run.seed.", **SEED, acts_with=SPLIT_HERE)
    num_workers: int = setting(0, "DataLoader worker processes per rank; 0 loads the data in "
                               "the training process itself.", at_least=0)
    worker_start_method: str = setting("forkserver", "How DataLoader workers are started; fork "
                                       "is unsafe with CUDA.",
                                       choices=("forkserver", "spawn", "fork"))
    synthetic_samples: int = setting(2000, "The number of samples of the synthetic and images "
                                     "datasets.", above=0,
                                     acts_with=("data.dataset", "synthetic", "images"))
    synthetic_features: int = setting(32, "The number of features of each synthetic sample.",
                                      above=0, acts_with=("data.dataset", "synthetic"))
    synthetic_classes: int = setting(4, "The classes of the synthetic and images datasets.",
                                     at_least=2, acts_with=("data.dataset", "synthetic", "images"))
    image_size: int = setting(32, "The images dataset's pictures are 3 x image_size x "
                              "image_size pixels.", above=0, acts_with=("data.dataset", "images"))
    block_size: int = setting(128, "tokens: the tokens of each training and evaluation "
                              "window, a language model's context.", above=0,
                              acts_with=("data.dataset", "tokens"))
    resume_changed: bool = setting(False, "Resume a checkpoint whose data changed since it was "
                                   "written (its fingerprint differs: token data written again "
                                   "in place); false refuses.")


@dataclass
class ModelConfig:
    """The model: which builder, and its size. Settings of yours join this section from
    settings.py (ModelSettings)."""

    name: str = setting("mlp", "The model: a key of MODELS, mlp (any input), cnn (image "
                        "inputs) or gpt (token windows: a language model), or one of yours "
                        "in model.py.")
    hidden_dim: int = setting(256, "mlp: the width of each hidden layer.", above=0)
    channels: int = setting(32, "cnn: the channels of the first convolution; each later one "
                            "doubles them.", above=0)
    num_layers: int = setting(2, "mlp: the number of hidden layers; cnn: the number of "
                              "convolutions, each halving the resolution.", at_least=0)
    dropout: float = setting(0.1, "The dropout probability after each hidden layer.",
                             at_least=0, below=1)
    batchnorm: bool = setting(False, "BatchNorm after each hidden layer (mlp) or convolution "
                              "(cnn).")
    sync_batchnorm: bool = setting(False, "Turn BatchNorm into SyncBatchNorm, whose statistics "
                                   "cover the whole global batch, on all ranks.")


@dataclass
class TaskConfig:
    """What is predicted and how it is scored. Settings of yours join this section from
    settings.py (TaskSettings)."""

    name: str = setting("", "The task: a key of TASKS (multiclass, binary, regression, or one "
                        "of yours) or module:Class; empty: the task the dataset is made for.")
    pos_weight: float = setting(1.0, "binary: the weight of the positive class in the loss; 1 "
                                "leaves the loss unweighted.", above=0)
    target_key: str = setting("target", "For samples that are dicts: the key of the target. "
                              "Every other key reaches the model as a keyword argument.")


@dataclass
class OptimConfig:
    """The optimizer and the learning-rate schedule (docs/optimization.md)."""

    name: str = setting("adamw", "Any torch.optim optimizer by its class name, in any case "
                        "(adamw, adam, sgd, rmsprop, ...), or a key of OPTIMIZERS (model.py).")
    lr: float = setting(0.002, "The base learning rate of each parameter group (groups of yours "
                        "may set their own).", above=0)
    weight_decay: float = setting(0.01, "Weight decay; biases and normalisation weights get "
                                  "none (or what optim.param_groups gives them).", at_least=0)
    args: dict[str, Any] = setting({}, "The optimizer's other keyword arguments, given one key "
                                   "at a time (optim.args.momentum=0.9 optim.args.nesterov=true).")
    param_groups: str = setting("", "A key of PARAM_GROUPS (model.py) that splits the parameters "
                                "into groups (optimizers.decay_groups keeps biases and norm "
                                "weights out of the decay); empty: one group with weight decay, "
                                "one without.")
    warmup_steps: int = setting(20, "Steps of linear warmup, from lr / warmup_steps up to lr, "
                                "before every built-in schedule (step and plateau too); 0: none.",
                                at_least=0)
    schedule: str = setting("cosine", "The schedule after warmup: cosine, linear, step, "
                            "multistep, constant, plateau, or a key of SCHEDULES (model.py).",
                            known=SCHEDULE_NAMES)
    min_lr_ratio: float = setting(0.0, "The floor of every schedule, as a share of each group's "
                                  "learning rate.", at_least=0, at_most=1,
                                  why="a share of each group's learning rate")
    step_size: int = setting(0, "step: the optimizer steps between two decays, counted from "
                             "step 0.", at_least=0, acts_with=("optim.schedule", "step"))
    milestones: list[int] = setting([], "multistep: the steps at which the rate decays.",
                                    rule=increasing_steps,
                                    acts_with=("optim.schedule", "multistep"))
    gamma: float = setting(0.1, "step, multistep and plateau: the factor of each decay.",
                           above=0, below=1, why="the factor of each decay",
                           acts_with=("optim.schedule", "step", "multistep", "plateau"))
    plateau_patience: int = setting(2, "plateau: the validations without improvement before a "
                                    "decay.", at_least=0, acts_with=("optim.schedule", "plateau"))
    grad_clip: float = setting(0.0, "Clip the global gradient norm to this; 0: no clipping.",
                               at_least=0)


@dataclass
class TrainConfig:
    """The training loop: the batch, the run's length, checkpoints, validation and early
    stopping (docs/checkpoints.md)."""

    epochs: int = setting(30, "The number of passes over the training split.", above=0)
    global_batch_size: int = setting(64, "Samples per optimizer step, summed over all "
                                     "processes: each rank takes 1 / world size of it.", above=0)
    grad_accum_steps: int = setting(1, "Micro-batches per optimizer step: each rank's share of "
                                    "the batch is split into this many forward passes.", above=0)
    micro_batch_size: int | str = setting(0, "Samples per process in one forward pass; 0: the "
                                          "global batch / (processes x grad_accum_steps). When "
                                          "it is set, the accumulation steps follow from it at "
                                          "each world size, so an elastic job that shrinks keeps "
                                          "each process's memory and the global batch. auto (on "
                                          "GPUs): the largest that fits, found by trying at the "
                                          "start.", rule=micro_batch_rule)
    max_steps: int = setting(0, "Stop after this many optimizer steps; 0 runs all the epochs.",
                             at_least=0)
    log_every: int = setting(50, "Steps between two logged training lines (their scalars are "
                             "reduced over the ranks).", above=0)
    ckpt_every: int = setting(200, "Steps between two checkpoints; 0 saves only at the end.",
                              at_least=0)
    keep_checkpoints: int = setting(3, "Keep the newest k checkpoints of a run; 0 keeps them "
                                    "all.", at_least=0)
    checkpoint_async: bool = setting(False, "Write checkpoints in the background while "
                                     "training goes on.")
    resume: str = setting("auto", "auto: this run's latest checkpoint, if it has one; never: "
                          "start afresh; or a run or checkpoint folder to start from.")
    device: str = setting("auto", "Where the model trains; auto picks cuda when there is a GPU.",
                          choices=("auto", "cuda", "cpu"))
    progress_bar: bool = setting(True, "A tqdm progress bar on rank 0, when it writes to a "
                                 "terminal.")
    plot_curves: bool = setting(True, "Rank 0 draws <run>/curves.png (loss, metric, learning "
                                "rate) at the end.")
    fast_dev_run: bool = setting(False, "A smoke test of a few seconds: 2 training steps, a "
                                 "checkpoint, 1 validation and 1 test batch on every rank, in a "
                                 "temporary folder removed at the end; prints ok or the first "
                                 "error.")
    limit_train_batches: float = setting(0.0, "Shorter epochs, for short real runs: N >= 1 "
                                         "optimizer steps per epoch, a fraction 0 < f < 1 of "
                                         "them, or 0 for all of them.", at_least=0,
                                         rule=whole_or_fraction)
    limit_val_batches: float = setting(0.0, "The same for validation, in batches of "
                                       "eval.batch_size per rank (its metrics are then those of "
                                       "the part seen).", at_least=0, rule=whole_or_fraction)
    estimate_windows: int = setting(0, "Data drawn with replacement (data.dataset=tokens): "
                                    "each validation also gives the loss over this many random "
                                    "windows of the training and of the validation split "
                                    "(sampled_train_loss, sampled_val_loss); 0: none.",
                                    at_least=0)
    val_every_steps: int = setting(0, "Validate every N steps as well as after every epoch; 0: "
                                   "only after every epoch.", at_least=0)
    keep_best: bool = setting(True, "Keep the checkpoint of the best validation "
                              "(train.best_metric) beside the newest ones.")
    best_metric: str = setting("", "The validation metric that decides the best checkpoint "
                               "(accuracy, loss, ...); empty: the task's headline metric.")
    best_mode: str = setting("auto", "Whether a higher or lower best_metric is better; auto: "
                             "lower for loss-like names, higher for the others.",
                             choices=("auto", "max", "min"))
    early_stop_patience: int = setting(0, "Stop after N validations without improvement; 0 "
                                       "never stops early.", at_least=0)
    early_stop_min_delta: float = setting(0.0, "The least change of best_metric that counts as "
                                          "an improvement.", at_least=0,
                                          acts_with=("train.early_stop_patience",))
    export: str = setting("last", "What model.pt holds at the end: the last step's weights or "
                          "the best checkpoint's (averaged where the run keeps averages); ema: "
                          "deprecated, as last.", choices=("last", "best", "ema"))
    ema_decay: float = setting(0.0, "Keep an average of the weights, each step moving 1 - this "
                               "of the way to them (e.g. 0.999): the run's weights then, which "
                               "validation scores and model.pt holds. 0: off.",
                               at_least=0, below=1)


WITH_PROFILER = ("profile.enabled", True)  # the profile settings act only with the profiler on


@dataclass
class ProfileConfig:
    """torch.profiler over a few training steps: one trace per rank in <run>/profile/ (open it
    in TensorBoard or https://ui.perfetto.dev), and the top operations printed by rank 0."""

    enabled: bool = setting(False, "Run the profiler over the steps set below.")
    start_step: int = setting(10, "The first step recorded; the step before it warms the "
                              "profiler up.", above=0, acts_with=WITH_PROFILER)
    steps: int = setting(5, "The number of steps recorded.", above=0, acts_with=WITH_PROFILER)
    memory: bool = setting(True, "Record tensor allocations and frees (the memory view).",
                           acts_with=WITH_PROFILER)
    with_stack: bool = setting(True, "Record the Python stack of every operation (larger "
                               "traces).", acts_with=WITH_PROFILER)
    top_ops: int = setting(15, "The rows of the table of operations printed at the end.",
                           above=0, acts_with=WITH_PROFILER)


@dataclass
class TrackingConfig:
    """Experiment trackers beside TensorBoard, logged by rank 0 (ddpkit/extras/trackers.py): one
    tracker run per job, continued after a restart, a resume or a requeue."""

    mlflow: bool = setting(False, "Log to MLflow; needs pip install -e '.[mlflow]'.")
    mlflow_uri: str = setting("", "The MLflow tracking URI; empty: "
                              "sqlite:///<run.output_dir>/mlflow.db, artifacts beside it.",
                              acts_with=("tracking.mlflow", True))
    wandb: bool = setting(False, "Log to Weights & Biases; needs pip install -e '.[wandb]'.")
    wandb_mode: str = setting("auto", "How W&B logs; auto: online when logged in, offline "
                              "otherwise.",
                              choices=("auto", "online", "offline"),
                              acts_with=("tracking.wandb", True))
    project: str = setting("", "The MLflow experiment and W&B project; empty: the project "
                           "folder's name.")
    run_name: str = setting("", "The tracker run's name; empty: the run folder's name.")
    timeout_seconds: float = setting(30.0, "A tracker call that takes longer is given up and the "
                                     "tracker dropped for the rest of the run, so a server that "
                                     "never answers does not hold training up.", above=0)


UNDER_DDP = ("parallel.strategy", "ddp")  # the DDP options act only under DDP


@dataclass
class DDPConfig:
    """The process group, and DistributedDataParallel's options (docs/distributed.md)."""

    backend: str = setting("auto", "The collective backend; auto: nccl on CUDA, gloo on CPU.",
                           choices=("auto", "nccl", "gloo"))
    timeout_minutes: float = setting(10.0, "A collective that waits longer than this fails "
                                     "instead of hanging.", at_least=0.5,
                                     why="below it, every healthy step would be reported as a "
                                         "stall")
    find_unused_parameters: bool = setting(False, "Needed only when forward leaves some "
                                           "parameters unused (ddp.debug names them).",
                                           acts_with=UNDER_DDP)
    static_graph: bool = setting(False, "Every step uses the same parameters, which lets DDP "
                                 "optimise.", acts_with=UNDER_DDP)
    gradient_as_bucket_view: bool = setting(True, "Gradients alias DDP's buckets, which saves "
                                            "a copy.", acts_with=UNDER_DDP)
    debug: bool = setting(False, "PyTorch's distributed debug mode (TORCH_DISTRIBUTED_DEBUG=INFO, "
                          "or DETAIL if the environment sets it): DDP names the parameters "
                          "that got no gradient and logs its set-up and timings.")


@dataclass
class ParallelConfig:
    """How the model is spread over the processes (docs/distributed.md)."""

    strategy: str = setting("ddp", "ddp: every process holds the whole model, its gradients and "
                            "optimizer state (options in ddp.*); fsdp: FSDP2, each process holds "
                            "1/N of them, for models that do not fit one device.",
                            choices=("ddp", "fsdp"))
    reshard_after_forward: bool = setting(True, "fsdp: free the gathered weights after forward, "
                                          "which saves memory.",
                                          acts_with=("parallel.strategy", "fsdp"))
    cpu_offload: bool = setting(False, "fsdp: keep the weight and optimizer shards in CPU "
                                "memory.")


@dataclass
class SpeedConfig:
    """Precision, compilation and kernels (docs/speed.md)."""

    precision: str = setting("auto", "The precision of forward and backward; auto: bf16 on GPUs "
                             "that have it, fp32 otherwise.",
                             choices=("auto", "fp32", "bf16", "fp16"))
    tf32: bool = setting(True, "TensorFloat-32 for float32 matmuls and convolutions (Ampere and "
                         "newer GPUs only).")
    channels_last: bool | None = setting(None, "The NHWC memory layout for 4-D inputs and "
                                         "convolution weights; null: on for image batches on "
                                         "CUDA.")
    compile: bool | str = setting(False, "torch.compile: true the whole model (faster steps after "
                                  "a slow first one), blocks each repeated block and the rest "
                                  "eager (a far shorter compile).",
                                  choices=(False, True, "blocks"))
    compile_mode: str = setting("default", "torch.compile's mode.",
                                choices=("default", "reduce-overhead", "max-autotune"),
                                acts_with=("speed.compile",))
    float8: bool = setting(False, "Linear layers in float8 through torchao (the float8 extra): "
                           "GPUs with float8 tensor cores only (L4, RTX 40xx, H100 ...).")
    activation_checkpointing: int = setting(0, "Recompute blocks' activations in the backward "
                                            "instead of keeping them: 0 off, 1 every repeated "
                                            "block, k every k-th (ddpkit/blocks.py).",
                                            at_least=0)
    fused_adamw: bool | None = setting(None, "optim.name=adamw or adam: update all parameters in "
                                       "one kernel, where torch has one for their device; null: "
                                       "on.")


@dataclass
class EvalConfig:
    """evaluate.py: which checkpoint, which split, and what it writes (docs/evaluation.md)."""

    checkpoint: str = setting("", "A run folder, a checkpoint folder or a model.pt; empty: the "
                              "newest run.")
    split: str = setting("test", "The split evaluated.", choices=("test", "val"))
    weights: str = setting("auto", "Which weights: auto, the run's own (the averaged ones where "
                           "it kept them, train.ema_decay); averaged; trained.",
                           choices=("auto", "averaged", "trained"))
    batch_size: int = setting(256, "Samples per process; evaluation has no global batch.",
                              above=0)
    output_dir: str = setting("", "Where the results go; empty: <run folder>/eval-<split>.")
    save_predictions: bool = setting(False, "Also write predictions.npz, in the split's order, "
                                     "for your own use.")
    curve_points: int = setting(200, "The most points kept of each curve, in curves.json, the "
                                "plots and TensorBoard.", at_least=2)
    plot_classes: int = setting(10, "Multiclass plots show this many classes, those with the "
                                "lowest AP, and the micro average.", above=0)
    binned_thresholds: int = setting(0, "0: exact metrics from every sample's row (memory: "
                                     "samples x row width per rank); N: constant memory, curves "
                                     "and AP counted at N score thresholds (for splits of "
                                     "millions).", at_least=0)


@dataclass
class GuardConfig:
    """The step guard: a bad step skipped instead of ending the run (ddpkit/step_guard.py)."""

    enabled: bool = setting(False, "Skip a step whose loss or gradient norm is not finite (or a "
                            "loss spike): no update, the schedule kept; costs a device read a "
                            "step.")
    spike_factor: float = setting(0.0, "Also skip a step whose loss is above this many times "
                                  "the median of the last guard.window steps; 0: off.",
                                  at_least=0, acts_with=("guard.enabled", True))
    window: int = setting(100, "The updated steps whose median loss spike_factor compares with.",
                          above=0, acts_with=("guard.enabled", True))
    max_skips: int = setting(5, "This many skipped steps in a row end the run, naming them.",
                             above=0, acts_with=("guard.enabled", True))


@dataclass
class Config:
    """Every section of the template (schema() adds your settings.py to three of them)."""

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
    guard: GuardConfig = field(default_factory=GuardConfig)
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


@functools.cache
def declarations() -> dict[str, Declared]:
    """Every declared setting of schema() (yours included) by its dotted key."""
    return {f"{section.name}.{item.name}": item.metadata[DECLARED]
            for section in fields(schema()) for item in fields(section.type)
            if DECLARED in item.metadata}


def names_near_the_templates() -> list[str]:
    """One line for each setting of settings.py named like one of the template's in the section
    it joins (model.n_layer beside model.num_layers): meant as the template's, it would leave
    the config with two keys, one of them read by nobody."""
    settings = recipes.load_settings()
    lines = []
    for section, (template, yours) in EXTENDED.items():
        mine = getattr(settings, yours, None)
        theirs = [item.name for item in fields(template)]
        for item in fields(mine) if is_dataclass(mine) else ():
            close = difflib.get_close_matches(item.name, theirs, n=1, cutoff=0.75)
            if close and item.name not in theirs:
                lines.append(f"settings.py's {section}.{item.name} is named like the template's "
                             f"{section}.{close[0]}, and the config holds both: if yours means "
                             f"the same, drop it and read {section}.{close[0]}; if not, a name "
                             "less alike ends this warning")
    return lines
