"""The optimizer and its parameter groups, from the config or from your code (the registries
PARAM_GROUPS and OPTIMIZERS, which model.py adds to).

`optim.name` is any `torch.optim` optimizer by class name, case-insensitive (sgd, adam, adamw,
rmsprop, ...), or a key of OPTIMIZERS; `optim.args` are the optimizer's other keyword arguments
(`optim.args.momentum=0.9 optim.args.nesterov=true`). The default parameter groups put no weight
decay on biases and normalisation weights (no_decay below); `optim.param_groups=<key>` names a
builder of PARAM_GROUPS that returns groups of your own (each with its own lr / weight_decay),
which decay_groups makes with the same rule for any part of the model. A group's "name" names
its learning rate in the logs (lr/<name>).
Frozen parameters (requires_grad False) are left out of every group. The groups come from the
model as parallel.wrap_model left it (the unwrapped module's names; under FSDP2 its sharded
parameters), so the same code serves DDP and FSDP, and a checkpoint keys the optimizer's state
by parameter name.
"""

import inspect
import logging
from collections.abc import Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddpkit.config import UserError, lookup
from ddpkit.parallel import unwrap

log = logging.getLogger("ddp")

# optim.param_groups=<key>: builder(model, cfg) -> [{"params": [...], "lr": ..., ...}, ...]
PARAM_GROUPS: dict[str, Callable[[nn.Module, DictConfig], list[dict]]] = {}
# optim.name=<key>: builder(param_groups, cfg) -> a torch.optim.Optimizer over those groups
OPTIMIZERS: dict[str, Callable[[list[dict], DictConfig], torch.optim.Optimizer]] = {}

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
               nn.RMSNorm)
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)  # what speed.fused_adamw turns on


def torch_optimizers() -> dict[str, type]:
    """torch.optim's optimizer classes by lower-case name (sgd, adam, adamw, ...)."""
    return {name.lower(): value for name, value in vars(torch.optim).items()
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer}


def optimizer_class(cfg: DictConfig) -> type | Callable:
    """What optim.name names: a builder of OPTIMIZERS, or a torch.optim class."""
    name = cfg.optim.name
    if name in OPTIMIZERS or ":" in name:
        return lookup(OPTIMIZERS, name, "optim.name", "an optimizer")
    known = torch_optimizers()
    if name.lower() not in known:
        yours = f", or yours ({', '.join(OPTIMIZERS)})" if OPTIMIZERS else ""
        raise UserError(f"optim.name={name} is not a torch.optim optimizer: choose one of "
                        f"{', '.join(sorted(known))}{yours}, or add a builder to OPTIMIZERS in "
                        "model.py")
    return known[name.lower()]


def optimizer_args(cfg: DictConfig) -> dict:
    """optim.args as plain keyword arguments (lists become tuples, as torch's betas are)."""
    args = OmegaConf.to_container(cfg.optim.args, resolve=True)
    return {key: tuple(value) if isinstance(value, list) else value
            for key, value in args.items()}


def check_optimizer(cfg: DictConfig) -> None:
    """optim.name and optim.args, tried on one parameter before any model is built: a name
    torch.optim lacks, an argument the optimizer does not take or a value it refuses is one line
    naming the key."""
    cls = optimizer_class(cfg)
    if not isinstance(cls, type):
        return  # your builder: its arguments are its own business
    accepted = inspect.signature(cls.__init__).parameters
    for key in optimizer_args(cfg):
        if key not in accepted or key in ("self", "params", "lr"):
            takes = [name for name in accepted if name not in ("self", "params")]
            raise UserError(f"optim.args.{key} is not an argument of torch.optim.{cls.__name__}: "
                            f"it takes {', '.join(takes)} (optim.lr is set on its own)")
    try:
        cls([nn.Parameter(torch.zeros(1))], **constructor_args(cls, cfg))
    except (TypeError, ValueError) as error:
        raise UserError(f"optim.name={cfg.optim.name} refuses its settings: {error} (check "
                        "optim.lr, optim.weight_decay and optim.args)") from None


def constructor_args(cls: type, cfg: DictConfig) -> dict:
    """lr, weight_decay (where the optimizer has it) and optim.args."""
    args = {"lr": cfg.optim.lr, **optimizer_args(cfg)}
    if "weight_decay" in inspect.signature(cls.__init__).parameters:
        args.setdefault("weight_decay", cfg.optim.weight_decay)
    elif cfg.optim.weight_decay:
        raise UserError(f"torch.optim.{cls.__name__} has no weight decay: set "
                        "optim.weight_decay=0")
    return args


def no_decay(model: nn.Module) -> set[str]:
    """The parameters that get no weight decay by default: every parameter of a normalisation
    layer (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...) and every parameter with fewer than 2
    dimensions (biases, gains, scalars). Decay pulls weights towards 0; a bias or a norm's scale
    has no reason to be small, and decaying it only fights the layer's job."""
    names = set()
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            if isinstance(module, NORM_LAYERS) or parameter.ndim < 2:
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def decay_groups(model: nn.Module, weight_decay: float, *,
                 only: Callable[[str], bool] | None = None, name: str = "",
                 **options) -> list[dict]:
    """The trainable parameters of `model` (with `only`, those whose full name passes it) in two
    groups: the weights, which decay by `weight_decay`, and the biases, gains and normalisation
    weights (no_decay), which do not. Each group carries `options` (lr=..., say) and a "name":
    `name` or "decay", and "<name>.no_decay" or "no_decay". An empty group is left out. A
    PARAM_GROUPS builder of yours keeps the rule with it, e.g. a head at ten times the rate:

        def head_faster(model, cfg):
            def is_head(name):
                return name.startswith("classifier.")
            decay = cfg.optim.weight_decay
            return [*decay_groups(model, decay, only=lambda n: not is_head(n), name="body"),
                    *decay_groups(model, decay, only=is_head, name="head", lr=cfg.optim.lr * 10)]
    """
    skip = no_decay(model)
    chosen = [(key, parameter) for key, parameter in model.named_parameters()
              if parameter.requires_grad and (only is None or only(key))]
    groups = [{"params": [p for key, p in chosen if key not in skip], "weight_decay": weight_decay,
               "name": name or "decay", **options},
              {"params": [p for key, p in chosen if key in skip], "weight_decay": 0.0,
               "name": f"{name}.no_decay" if name else "no_decay", **options}]
    return [group for group in groups if group["params"]]


def default_groups(model: nn.Module, cfg: DictConfig) -> list[dict]:
    """Two groups (decay_groups): the weights that decay (optim.weight_decay), named "decay",
    and the biases and normalisation weights that do not, "no_decay"."""
    return decay_groups(model, cfg.optim.weight_decay)


def parameter_groups(model: nn.Module, cfg: DictConfig) -> list[dict]:
    """The groups the optimizer gets: yours (optim.param_groups) or the default ones, frozen
    parameters left out of each and empty groups dropped."""
    if not cfg.optim.param_groups:
        return default_groups(model, cfg)
    builder = lookup(PARAM_GROUPS, cfg.optim.param_groups, "optim.param_groups",
                     "a parameter-group builder")
    groups = builder(model, cfg)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g
                                               for g in groups):
        raise UserError(f"optim.param_groups={cfg.optim.param_groups} must return a list of "
                        "dicts, each with 'params' (and its own 'lr', 'weight_decay', ...)")
    kept = [{**group, "params": [p for p in group["params"] if p.requires_grad]}
            for group in groups]
    return [group for group in kept if group["params"]]


def build_optimizer(model: nn.Module, cfg: DictConfig, fused: bool) -> torch.optim.Optimizer:
    """The run's optimizer over the wrapped model's parameters. `fused`: the speed settings ask
    for a fused Adam / AdamW kernel; it is used where the optimizer and every parameter's device
    have one (optimizer.defaults["fused"] says whether it is)."""
    groups = parameter_groups(unwrap(model), cfg)
    cls = optimizer_class(cfg)
    if not isinstance(cls, type):
        return cls(groups, cfg)
    args = constructor_args(cls, cfg)
    if fused and cls in FUSED_OPTIMIZERS and "fused" not in args and "foreach" not in args:
        params = [p for group in groups for p in group["params"]]
        args["fused"] = fused_supported(params) or None
    return cls(groups, **args)


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether PyTorch has a fused optimizer kernel for every parameter's device and dtype."""
    from torch.utils import _foreach_utils

    devices = getattr(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: ["cuda"])()
    return all(p.device.type in devices and p.is_floating_point() for p in params)


def rate_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names each parameter group's learning rate is logged under: `lr/<the group's "name">`
    (`lr/group<i>` for a group without one). Beside them the logs keep `lr`, the first group's,
    as logs before release 1.1.0 had it."""
    return [f"lr/{group.get('name') or f'group{index}'}"
            for index, group in enumerate(optimizer.param_groups)]


def describe_optimizer(optimizer: torch.optim.Optimizer, default_groups: bool = True) -> str:
    """One line: the optimizer, whether fused, its base rates and where weight decay applies."""
    name = type(optimizer).__name__
    if optimizer.defaults.get("fused"):
        name = f"fused {name}"
    decayed, plain = [], []
    for group in optimizer.param_groups:
        (decayed if group.get("weight_decay") else plain).extend(group["params"])
    rates = sorted({group.get("initial_lr", group["lr"]) for group in optimizer.param_groups})
    parts = [f"optimizer {name}, {len(optimizer.param_groups)} parameter group(s), lr "
             + ", ".join(f"{rate:g}" for rate in rates)]
    if "weight_decay" in optimizer.defaults:
        decays = sorted({group["weight_decay"] for group in optimizer.param_groups
                         if group["weight_decay"]})
        parts.append(f"weight decay {', '.join(f'{d:g}' for d in decays) or 0} on "
                     f"{len(decayed)} tensors ({count(decayed)} params), none on {len(plain)} "
                     f"{'biases/norm weights' if default_groups else 'tensors'} "
                     f"({count(plain)} params)")
    return ", ".join(parts)


def count(params: list[torch.Tensor]) -> str:
    return f"{sum(p.numel() for p in params):,}"
