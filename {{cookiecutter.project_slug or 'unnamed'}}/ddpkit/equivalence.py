"""What check_equivalence.py weighs, and how: the steps it compares (plan_steps), each final
parameter against its own tolerance (compare_parameters), the gradient signal that tells rounding
noise from a real divergence (no_signal), and the table of the worst parameters (table).

A parameter passes when max|a - b| <= rtol * max|a| + atol, a being its final value after one
process and b after N. Some parameters have no gradient to learn from: a bias that a softmax, a
normalisation or the loss cannot see (an attention key bias: softmax ignores what is added to
every score alike). Their true gradient is zero, so what they get is rounding noise, which
differs between one process and N; Adam divides it by its own size and turns it into steps as
large as any. Such elements may end far apart without anything being wrong: an element whose
float64 gradient, over the compared steps' data, is at most NO_SIGNAL times the whole model's
gradient norm, at the initial and at the final weights alike, is excused; the rest of its tensor
is still held to the tolerance.
"""

from dataclasses import dataclass

import torch

NO_SIGNAL = 1e-10  # an element's gradient at most this times the model's gradient norm: none
MIN_STEPS = 15  # compared steps at least, by default
PAST_WARMUP = 5  # and by default this many past the warmup


@dataclass
class ParameterCheck:
    """One final parameter (a state-dict entry) of the 1-process run (a) against the N-process
    run (b)."""

    name: str
    diff: float  # max |a - b|
    scale: float  # max |a|
    tolerance: float  # rtol * scale + atol
    signal_diff: float  # max |a - b| over the elements with a gradient signal

    @property
    def ratio(self) -> float:
        return self.diff / self.tolerance

    @property
    def passed(self) -> bool:
        return self.signal_diff <= self.tolerance

    @property
    def verdict(self) -> str:
        if self.diff <= self.tolerance:
            return "ok"
        return "no gradient signal (excused)" if self.passed else "FAIL"


def default_steps(warmup_steps: int, full_steps: int) -> int:
    """Steps compared without --steps: past the warmup, within the epoch's full batches."""
    return min(max(MIN_STEPS, warmup_steps + PAST_WARMUP), full_steps)


def warmup_note(steps: int, warmup_steps: int) -> str | None:
    """A line when every compared step is inside the warmup (small rates hide a divergence)."""
    if steps > warmup_steps:
        return None
    return (f"note: all {steps} compared steps are inside the warmup (optim.warmup_steps="
            f"{warmup_steps}): the rate is still small, so a divergence may not show yet; "
            "lower train.global_batch_size for more steps in an epoch, or optim.warmup_steps")


def compare_parameters(one: dict, many: dict, rtol: float, atol: float,
                       excused: dict | None = None) -> list[ParameterCheck]:
    """Each floating-point entry of `one` against `many`, worst (by ratio to its tolerance)
    first. `excused` maps names to boolean masks of elements without a gradient signal."""
    checks = []
    for name, a in one.items():
        if not a.is_floating_point():
            continue
        a, b = a.double(), many[name].double()
        gap = (a - b).abs()
        diff = gap.max().item() if gap.numel() else 0.0
        scale = a.abs().max().item() if a.numel() else 0.0
        mask = (excused or {}).get(name)
        signal_gap = gap if mask is None else gap[~mask]
        signal_diff = signal_gap.max().item() if signal_gap.numel() else 0.0
        checks.append(ParameterCheck(name, diff, scale, rtol * scale + atol, signal_diff))
    return sorted(checks, key=lambda check: check.ratio, reverse=True)


def table(checks: list[ParameterCheck], show: int) -> str:
    """The `show` worst parameters, and every failing one beyond them."""
    rows = [c for index, c in enumerate(checks) if index < show or not c.passed]
    width = max([len("parameter"), *(len(c.name) for c in rows)])
    lines = [f"{'parameter':<{width}} {'max|a-b|':>10} {'max|a|':>10} {'/ tolerance':>11}  verdict"]
    lines += [f"{c.name:<{width}} {c.diff:>10.3e} {c.scale:>10.3e} {c.ratio:>11.3g}  {c.verdict}"
              for c in rows]
    if len(checks) > len(rows):
        lines.append(f"({len(checks) - len(rows)} more parameter(s), all within tolerance)")
    return "\n".join(lines)


def build(cfg):
    """The data, task and model of a 1-process run, the model with its initial weights: built
    in start_run's order from the same seed, so the same weights."""
    from ddpkit.data import DataModule
    from ddpkit.dist_utils import DistEnv
    from ddpkit.parallel import build_model
    from ddpkit.tasks import build_task

    torch.manual_seed(cfg.run.seed)
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    model = build_model(cfg.model, task.input_shape(data.first_samples()[0]), task.num_outputs)
    return data, task, model


def gradients(model: torch.nn.Module, task, steps: list) -> dict[str, torch.Tensor]:
    """The float64 gradient of the mean loss over all the micro-batches of `steps`, by
    parameter name (tied parameters under each of their names; an unused one: zeros)."""
    from ddpkit.data import count_samples, map_tensors
    from ddpkit.run_state import forward_backward
    from ddpkit.speed import FLOAT32

    model.double().train()
    model.zero_grad(set_to_none=True)
    batches = [batch for micro_batches in steps for batch in micro_batches]
    total = sum(count_samples(batch) for batch in batches)
    for batch in batches:
        batch = map_tensors(lambda t: t.double() if t.is_floating_point() else t, batch)
        forward_backward(model, batch, task, torch.device("cpu"), FLOAT32, None,
                         count_samples(batch) / total)
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters(remove_duplicate=False)}


def silent(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masks of the elements whose gradient is at most NO_SIGNAL times the total norm."""
    unique = {id(g): g for g in grads.values()}.values()
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in unique)).item()
    return {name: g.abs() <= NO_SIGNAL * total for name, g in grads.items()}


def no_signal(cfg, steps: int, final_state: dict) -> dict[str, torch.Tensor]:
    """Masks, by parameter name, of the elements without a gradient signal at both the initial
    weights and `final_state` (the 1-process run's), over the first `steps` steps' data."""
    data, task, model = build(cfg)
    batches = []
    for micro_batches in data.train_steps(0):
        batches.append(micro_batches)
        if len(batches) == steps:
            break
    at_start = silent(gradients(model, task, batches))
    model.load_state_dict(final_state)
    at_end = silent(gradients(model, task, batches))
    return {name: mask & at_end[name] for name, mask in at_start.items()}
