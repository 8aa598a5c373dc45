"""check_equivalence.py's judgement (ddpkit/equivalence.py): each parameter against a relative
tolerance with a floor, the worst named in a table, a parameter without gradient signal told
apart from a real divergence, and the default steps past the warmup. The checks of real runs
train under torchrun (slow); the rest are quick."""

import re
import sys

import pytest
import torch

import check_equivalence
from conftest import TINY, fixture, needs_extra, run
from ddpkit import equivalence, recipes
from ddpkit.config import load_config

MODELS = "tests/equivalence_models.py"


def state(**tensors) -> dict:
    return {name: torch.tensor(value, dtype=torch.float32) for name, value in tensors.items()}


def test_tolerance_is_relative_to_the_weights_with_a_floor():
    one = state(big=[1000.0, -2000.0], small=[0.0, 1e-3], int_ignored=[1.0])
    one["int_ignored"] = torch.tensor([1])
    many = state(big=[1000.1, -2000.0], small=[5e-6, 1e-3])
    many["int_ignored"] = torch.tensor([2])
    checks = {c.name: c for c in equivalence.compare_parameters(one, many, 1e-4, 1e-5)}
    assert set(checks) == {"big", "small"}
    assert checks["big"].tolerance == pytest.approx(0.2 + 1e-5)  # 1e-4 x 2000, + the floor
    assert checks["big"].passed and checks["big"].verdict == "ok"  # 0.1 apart: inside
    assert checks["small"].passed  # 5e-6 apart: under the floor
    tight = {c.name: c for c in equivalence.compare_parameters(one, many, 1e-5, 1e-5)}
    assert not tight["big"].passed and tight["big"].verdict == "FAIL"


def test_only_elements_without_gradient_signal_are_excused():
    one, many = state(w=[1.0, 1.0, 1.0]), state(w=[1.5, 1.0, 1.0])
    excused = {"w": torch.tensor([True, False, False])}
    (check,) = equivalence.compare_parameters(one, many, 1e-4, 1e-5, excused)
    assert check.passed and check.verdict.startswith("no gradient signal")
    many = state(w=[1.5, 1.1, 1.0])  # one element with a signal differs too: a real divergence
    (check,) = equivalence.compare_parameters(one, many, 1e-4, 1e-5, excused)
    assert not check.passed and check.verdict == "FAIL"


def test_table_names_the_worst_first_and_every_failure():
    one = state(**{f"p{i}": [1.0] for i in range(5)})
    many = state(p0=[1.0], p1=[1.001], p2=[1.0], p3=[1.01], p4=[1.0])
    checks = equivalence.compare_parameters(one, many, 1e-4, 1e-5)
    lines = equivalence.table(checks, show=1).splitlines()
    assert lines[0].split()[:4] == ["parameter", "max|a-b|", "max|a|", "/"]
    assert [line.split()[0] for line in lines[1:3]] == ["p3", "p1"]  # both fail: both shown
    assert lines[1].endswith("FAIL") and lines[-1].startswith("(3 more parameter(s)")


@pytest.mark.parametrize(("warmup", "full", "steps"),
                         [(0, 100, 15), (20, 100, 25), (95, 100, 100), (20, 18, 18)])
def test_default_steps_run_past_the_warmup_within_the_epoch(warmup, full, steps):
    assert equivalence.default_steps(warmup, full) == steps
    assert (equivalence.warmup_note(steps, warmup) is None) == (steps > warmup)


def test_a_note_says_when_every_step_is_inside_the_warmup(capsys):
    # TINY: 228 training samples, 12 a step: 19 full steps in an epoch.
    assert check_equivalence.steps_to_compare([*TINY, "optim.warmup_steps=12"], None) == 17
    assert "note:" not in capsys.readouterr().out
    assert check_equivalence.steps_to_compare([*TINY, "optim.warmup_steps=30"], None) == 19
    note = capsys.readouterr().out
    assert "all 19 compared steps are inside the warmup (optim.warmup_steps=30)" in note
    assert check_equivalence.steps_to_compare([*TINY, "optim.warmup_steps=30"], 4) == 4


def test_attention_key_bias_has_no_gradient_signal():
    recipes.load()
    cfg = load_config([*TINY, f"model.name={MODELS}:attention", "model.hidden_dim=8"])
    _, _, model = equivalence.build(cfg)
    silent = equivalence.no_signal(cfg, 3, model.state_dict())
    key = torch.zeros(24, dtype=torch.bool)
    key[8:16] = True  # in_proj_bias packs the query, key and value biases
    assert torch.equal(silent["attention.in_proj_bias"], key)
    assert not any(mask.any() for name, mask in silent.items()
                   if name != "attention.in_proj_bias")


def test_a_model_that_cannot_run_in_float64_excuses_nothing(capsys):
    recipes.load()
    overrides = [*TINY, f"model.name={MODELS}:float32_only"]
    assert check_equivalence.gradient_signal(overrides, 2, {}) is None
    assert "note: no float64 gradient (RuntimeError" in capsys.readouterr().out


def check(tmp_path, *args: str, nproc: int = 2):
    result = run([sys.executable, "check_equivalence.py", "--nproc", str(nproc), "--workdir",
                  str(tmp_path), *TINY, *args], timeout=400)
    rows = result.stdout.split("the worst first:\n")[-1].splitlines()
    return result, rows


@pytest.mark.slow
def test_noise_in_a_parameter_without_gradient_signal_passes_and_is_named(tmp_path):
    # No --steps: past TINY's 12 warmup steps by 5.
    result, rows = check(tmp_path, f"model.name={MODELS}:attention", "optim.warmup_steps=12")
    assert result.returncode == 0, result.stdout
    assert "PASS" in result.stdout and "for 17 steps" in result.stdout
    assert "note:" not in result.stdout
    assert rows[0].split()[0] == "parameter"  # the table, on a pass too
    assert rows[1].startswith("attention.in_proj_bias"), result.stdout
    assert rows[1].endswith("no gradient signal (excused)"), result.stdout


@pytest.mark.slow
def test_a_divergence_that_depends_on_the_world_size_fails_naming_the_parameter(tmp_path):
    result, rows = check(tmp_path, f"model.name={MODELS}:world_size_drift", "--steps", "8")
    assert result.returncode == 1, result.stdout
    assert re.match(r"head\.bias +\S+ +\S+ +\S+ +FAIL$", rows[1]), result.stdout
    assert "parameters drift apart (head.bias" in result.stdout


@pytest.mark.slow
def test_a_hugging_face_bert_passes_at_3_processes(tmp_path):
    # The case: over a whole epoch (38 steps of 6) at 3 processes, Adam drives the
    # attention key biases apart on rounding noise alone; every other parameter agrees.
    needs_extra("transformers")
    result, rows = check(tmp_path, f"model.name={MODELS}:tiny_bert", "model.hidden_dim=16",
                         "ddp.find_unused_parameters=true", "train.global_batch_size=6",
                         "--steps", "38", nproc=3)
    assert result.returncode == 0, result.stdout
    verdicts = {row.split()[0]: row.split("  ")[-1] for row in rows[1:-2]}
    for layer in (0, 1):
        key_bias = f"bert.bert.encoder.layer.{layer}.attention.self.key.bias"
        assert verdicts[key_bias] == "no gradient signal (excused)", result.stdout
    assert sum(verdict != "ok" for verdict in verdicts.values()) == 2, result.stdout


@pytest.mark.slow
def test_sgd_with_parameter_groups_passes(tmp_path):
    result, _ = check(tmp_path, "optim.name=sgd", f"optim.param_groups={fixture('two_groups')}",
                      "optim.weight_decay=0.001", "--steps", "10", nproc=3)
    assert result.returncode == 0, result.stdout
