"""The optimizer and the schedule from the config or from the user's code: any torch.optim
optimizer by name with its arguments, default groups that do not decay biases and norm weights,
user hooks for groups / optimizer / schedule, each schedule's curve, the plateau schedule, a
resume that changes the rate or the decay, and bad settings in one line. The real-process tests
(slow) train SGD with two groups and a step schedule, killed and resumed bitwise at 2 processes,
and a plateau schedule under FSDP."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from test_checkpoints import assert_bitwise_equal, final_weights, saved_tensors
from test_faults import epoch_records, finish, kill_worker, launch, logged_steps, wait_for
from torch import nn
from torch.optim import lr_scheduler

import fixtures
from conftest import TINY, fixture, only_run_dir, run
from ddpkit import optimizers, schedules
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.config import UserError, load_config
from ddpkit.extras.sweep.space import parse_space
from ddpkit.position import Position
from ddpkit.resume_settings import apply_changed_settings
from ddpkit.run_setup import check_optim


def config(*overrides: str):
    return load_config([*TINY, *overrides])


class Normed(nn.Module):
    """Every kind of parameter the default groups tell apart, and a frozen one."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.batchnorm = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def names_in(groups: list[dict], model: nn.Module) -> list[set[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [{by_id[id(p)] for p in group["params"]} for group in groups]


def test_default_groups_decay_weights_only_and_leave_frozen_parameters_out():
    model = Normed()
    optimizer = optimizers.build_optimizer(model, config("optim.weight_decay=0.05"), fused=False)
    decayed, plain = optimizer.param_groups
    assert names_in([decayed, plain], model) == [
        {"embed.weight", "linear.weight"},
        {"linear.bias", "norm.weight", "norm.bias", "batchnorm.weight", "batchnorm.bias"}]
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.05, 0.0)
    assert optimizers.describe_optimizer(optimizer) == (
        "optimizer AdamW, 2 parameter group(s), lr 0.01, weight decay 0.05 on 2 tensors (144 "
        "params), none on 5 biases/norm weights (40 params)")


def test_any_torch_optimizer_by_name_with_its_arguments():
    model = nn.Linear(4, 2)
    sgd = optimizers.build_optimizer(model, config(
        "optim.name=SGD", "optim.args.momentum=0.9", "optim.args.nesterov=true"), fused=True)
    assert type(sgd) is torch.optim.SGD and not sgd.defaults.get("fused")
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.9, True)
    adam = optimizers.build_optimizer(model, config("optim.name=adam",
                                                    "optim.args.betas=[0.8,0.9]"), fused=True)
    assert adam.defaults["betas"] == (0.8, 0.9)
    # Fused only where PyTorch has the kernel (CPU and CUDA in recent versions), and said so.
    assert bool(adam.defaults["fused"]) == optimizers.fused_supported(list(model.parameters()))
    assert optimizers.describe_optimizer(adam).startswith(
        "optimizer fused Adam" if adam.defaults["fused"] else "optimizer Adam,")
    assert type(optimizers.build_optimizer(model, config("optim.name=rmsprop"), False)) is \
        torch.optim.RMSprop


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["optim.name=sgdd"], "optim.name=sgdd is not a torch.optim optimizer: choose one of"),
        (["optim.name=sgd", "optim.args.momentumm=0.9"],
         "optim.args.momentumm is not an argument of torch.optim.SGD: it takes"),
        (["optim.name=sgd", "optim.args.momentum=-1"], "optim.name=sgd refuses its settings"),
        (["optim.schedule=cosin"], "optim.schedule=cosin is not a schedule: choose one of cosine"),
        (["optim.param_groups=tests/fixtures.py:nothing"], "optim.param_groups=tests/fixtures"),
    ],
)
def test_a_bad_optimizer_or_schedule_is_one_line_naming_the_key(settings, message):
    cfg = config(*settings)
    with pytest.raises(UserError, match=None) as error:
        check_optim(cfg)
        optimizers.build_optimizer(nn.Linear(2, 2), cfg, fused=False)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["optim.milestones=[20,10]"], "optim.milestones=[20, 10] is not valid"),
        (["optim.schedule=multistep"], "optim.schedule=multistep needs optim.milestones"),
        (["optim.schedule=step"], "optim.schedule=step needs optim.step_size"),
        (["optim.gamma=1.5"], "optim.gamma=1.5 is not valid"),
        (["optim.min_lr_ratio=-0.1"], "optim.min_lr_ratio=-0.1 is not valid"),
        (["optim.args=3"], "optim.args must be a mapping"),
    ],
)
def test_bad_schedule_settings_are_refused_by_the_config_check(settings, message):
    with pytest.raises(UserError, match=None) as error:
        config(*settings)
    assert message in str(error.value)


def test_an_optimizer_argument_is_a_key_a_sweep_can_vary():
    space, fixed = parse_space(["optim.args.momentum=0.8,0.9", "optim.name=sgd"],
                               random_search=False)
    assert space == {"optim.args.momentum": ["0.8", "0.9"]} and fixed == ["optim.name=sgd"]


def lr_curve(cfg, steps: int, total: int, base_lrs=(1.0, 0.5)) -> list[list[float]]:
    """Each group's rate at steps 0 .. steps-1 of the run's schedule."""
    params = [nn.Parameter(torch.zeros(1)) for _ in base_lrs]
    optimizer = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, base_lrs,
                                                                            strict=True)])
    scheduler, plateau = schedules.build_schedule(optimizer, cfg, total, higher_is_better=True)
    assert plateau is None
    curve = []
    for _ in range(steps):
        curve.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return curve


def torch_curve(make, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make(optimizer)
    curve = []
    for _ in range(steps):
        curve.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return curve


@pytest.mark.parametrize(
    ("settings", "reference"),
    [
        (["optim.schedule=step", "optim.step_size=7", "optim.gamma=0.5"],
         lambda o: lr_scheduler.StepLR(o, 7, 0.5)),
        (["optim.schedule=multistep", "optim.milestones=[5,12]", "optim.gamma=0.2"],
         lambda o: lr_scheduler.MultiStepLR(o, [5, 12], 0.2)),
        (["optim.schedule=cosine"], lambda o: lr_scheduler.CosineAnnealingLR(o, 20)),
        (["optim.schedule=linear"], lambda o: lr_scheduler.LinearLR(o, 1.0, 0.0, 20)),
        (["optim.schedule=constant"], lambda o: lr_scheduler.ConstantLR(o, 1.0)),
    ],
    ids=["step", "multistep", "cosine", "linear", "constant"],
)
def test_without_warmup_each_schedule_is_torchs_and_scales_each_groups_own_rate(
        settings, reference):
    ours = lr_curve(config("optim.warmup_steps=0", *settings), 21, total=20)
    theirs = torch_curve(reference, 21)
    assert [a for a, _ in ours] == pytest.approx(theirs, abs=1e-12)
    assert [b for _, b in ours] == pytest.approx([0.5 * rate for rate in theirs], abs=1e-12)


def test_warmup_then_decay_to_the_floor():
    warmup, total, floor = 4, 24, 0.1
    cosine = lr_curve(config(f"optim.warmup_steps={warmup}", f"optim.min_lr_ratio={floor}"),
                      total + 2, total)
    for step, (rate, half) in enumerate(cosine):
        progress = min(1.0, (step - warmup) / (total - warmup))
        expected = ((step + 1) / warmup if step < warmup
                    else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert (rate, half) == pytest.approx((expected, expected / 2)), step
    assert cosine[-1][0] == pytest.approx(floor)
    step = lr_curve(config("optim.warmup_steps=0", "optim.schedule=step", "optim.step_size=2",
                           "optim.gamma=0.1", "optim.min_lr_ratio=0.05"), 8, 8)
    assert [rate for rate, _ in step] == pytest.approx([1, 1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])


def test_a_plateau_schedule_cuts_the_rate_after_a_flat_metric_and_keeps_it_after_warmup():
    cfg = config("optim.schedule=plateau", "optim.warmup_steps=2", "optim.plateau_patience=1",
                 "optim.gamma=0.5", "optim.min_lr_ratio=0.2")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    warmup, plateau = schedules.build_schedule(optimizer, cfg, 100, higher_is_better=True)
    rates = []
    for accuracy in (0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6):  # better once, then flat
        for _ in range(3):  # a few steps per epoch: the warmup leaves a cut rate alone
            optimizer.step()
            warmup.step()
        plateau.step(accuracy)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1, 1, 1, 0.5, 0.5, 0.25, 0.25, 0.2])


def test_user_hooks_give_groups_an_optimizer_and_a_scheduler(monkeypatch):
    made = []
    monkeypatch.setitem(optimizers.OPTIMIZERS, "mine", lambda groups, cfg: made.append(groups)
                        or torch.optim.SGD(groups, lr=cfg.optim.lr))
    monkeypatch.setitem(schedules.SCHEDULES, "steps",
                        lambda optimizer, cfg, total: lr_scheduler.StepLR(optimizer, total // 2))
    model = fixtures.mlp(OmegaConf.create({"hidden_dim": 8, "num_layers": 1, "dropout": 0.0,
                                           "batchnorm": False}), (4,), 2)
    model.net[-1].bias.requires_grad_(False)  # frozen: left out of its group
    cfg = config("optim.name=mine", f"optim.param_groups={fixture('two_groups')}",
                 "optim.schedule=steps")
    optimizer = optimizers.build_optimizer(model, cfg, fused=True)
    first, rest = names_in(made[0], model)
    assert first == {"net.0.weight", "net.0.bias"} and rest == {"net.3.weight"}
    assert [g["lr"] for g in optimizer.param_groups] == [0.005, 0.01]
    assert optimizer.param_groups[0]["weight_decay"] == 0.0
    scheduler, plateau = schedules.build_schedule(optimizer, cfg, 10, higher_is_better=False)
    assert isinstance(scheduler, lr_scheduler.StepLR) and plateau is None


def resumed(cfg, saved, optimizer, scheduler):
    """The state a resume leaves after apply_changed_settings, checkpoint config `saved`."""
    run = SimpleNamespace(cfg=cfg, optimizer=optimizer, scheduler=scheduler, plateau=None,
                          env=SimpleNamespace(is_main=False), position=Position(step=3))
    apply_changed_settings(run, OmegaConf.to_container(saved))


def test_a_resume_scales_each_groups_own_rate_and_decay_by_new_over_old():
    saved = config("optim.weight_decay=0.1")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.005, "weight_decay": 0.2},
              {"params": [model[1].weight]}, {"params": [model[1].bias], "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=0.01, weight_decay=0.1)
    scheduler = lr_scheduler.LambdaLR(optimizer, schedules.factor_of(saved, 100))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    factor = schedules.factor_of(saved, 100)(3)
    resumed(config("optim.lr=0.03", "optim.weight_decay=0.2"), saved, optimizer, scheduler)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [0.015 * factor, 0.03 * factor, 0.03 * factor])
    assert [g["weight_decay"] for g in optimizer.param_groups] == pytest.approx([0.4, 0.2, 0.0])


# SGD with Nesterov momentum, two groups of the user's (tests/fixtures.py:two_groups) and a step
# schedule, at 2 processes: a SIGKILL mid-epoch resumes bitwise.
SGD_GROUPS = [*TINY, "optim.name=sgd", "optim.args.momentum=0.9", "optim.args.nesterov=true",
              f"optim.param_groups={fixture('two_groups')}", "optim.schedule=step",
              "optim.step_size=10", "optim.gamma=0.5", "optim.lr=0.05", "train.log_every=1",
              "train.ckpt_every=5", "model.dropout=0.1"]
SGD_STEPS = 3 * 19


@pytest.mark.slow
def test_sgd_with_two_groups_and_a_step_schedule_resumes_bitwise_after_a_kill(tmp_path):
    reference = tmp_path / "reference"
    result = run(["./run.sh", *SGD_GROUPS, f"run.output_dir={reference}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    assert "optimizer SGD, 2 parameter group(s), lr 0.025, 0.05, weight decay 0.01 on" in \
        result.stdout
    killed = tmp_path / "killed"
    launcher = launch([*SGD_GROUPS, f"run.output_dir={killed}"])
    kill_after = random.Random(7).randrange(8, SGD_STEPS - 3)
    wait_for(lambda: logged_steps(killed) >= kill_after, launcher, f"step {kill_after}")
    kill_worker(launcher, 1)
    output = finish(launcher)
    assert launcher.returncode == 0, output
    assert output.count("resumed from") == 1, output
    ours, theirs = only_run_dir(killed), only_run_dir(reference)
    assert_bitwise_equal(final_weights(ours), final_weights(theirs))
    assert_bitwise_equal(saved_tensors(list_checkpoints(ours / "checkpoints")[-1]),
                         saved_tensors(list_checkpoints(theirs / "checkpoints")[-1]))
    assert epoch_records(ours) == epoch_records(theirs)
    # The first group's rate (half the base) halves every 10 steps (logged: the rate each step
    # trained with; step 11 is the first after 10 steps).
    lr = logged_rates(ours)
    assert (lr[10], lr[11], lr[21]) == pytest.approx((0.025, 0.0125, 0.00625))


def logged_rates(run_dir) -> dict[int, float]:
    """The first group's rate each logged step trained with, from train_log.jsonl."""
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {record["step"]: record["lr"] for record in records}


@pytest.mark.slow
def test_a_plateau_schedule_under_fsdp_cuts_the_rate_when_validation_stalls(tmp_path):
    # A rate so small that validation accuracy cannot move: every epoch after the first is flat.
    result = run(["./run.sh", *TINY, "parallel.strategy=fsdp", "optim.schedule=plateau",
                  "optim.lr=1e-9", "optim.plateau_patience=0", "optim.gamma=0.5",
                  "optim.warmup_steps=0", f"run.output_dir={tmp_path}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    assert "weight decay 0.01 on 3 tensors" in result.stdout, result.stdout
    lr = logged_rates(only_run_dir(tmp_path))
    assert (lr[5], lr[35]) == pytest.approx((1e-9, 1e-9))  # epochs 1 and 2
    assert lr[40] == pytest.approx(5e-10)  # epoch 3: cut once, after epoch 2's validation
