"""The config schema: defaults, overrides, and the one-line errors for bad input."""

import difflib
import inspect
import shutil
import subprocess
import sys
import types
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from ddpkit.config import (
    DEFAULT_CONFIG_FILE,
    PROJECT_DIR,
    UserError,
    given_keys,
    inactive_settings,
    load_config,
    lookup,
    parse_args,
    schema_type,
    write_defaults,
)
from ddpkit.schema import Config, DataConfig, ModelConfig, TaskConfig, declarations
from settings import DataSettings, ModelSettings, TaskSettings

# The sections that extend settings.py's classes: (section, the template's class, yours).
EXTENDED = (("data", DataConfig, DataSettings), ("model", ModelConfig, ModelSettings),
            ("task", TaskConfig, TaskSettings))


def test_default_yaml_is_what_the_schema_writes(tmp_path):
    # One source of every default and doc: ddpkit/schema.py. The YAML is written from it.
    written = tmp_path / "default.yaml"
    write_defaults(written)
    assert list(tmp_path.iterdir()) == [written]  # no temporary file left beside it
    diff = list(difflib.unified_diff(DEFAULT_CONFIG_FILE.read_text().splitlines(),
                                     written.read_text().splitlines(), "configs/default.yaml",
                                     "what ddpkit/schema.py declares", lineterm="", n=0))
    assert not diff, ("configs/default.yaml is not what ddpkit/schema.py declares: run `python "
                      "config.py --write-defaults` to rewrite it\n" + "\n".join(diff[:12]))
    # ... and what it shows is what a run gets: the schema's defaults, read back by YAML.
    shown = OmegaConf.to_container(OmegaConf.load(DEFAULT_CONFIG_FILE))
    assert shown == OmegaConf.to_container(OmegaConf.structured(Config))


def test_what_the_declarations_name_exists():
    # A choice, a range and acts_with are read by the checks; one that names nothing (a key
    # renamed, a value that is not a choice) would silently check nothing.
    defaults = OmegaConf.structured(Config)
    for key, declared in declarations().items():
        assert declared.doc.endswith((".", ")")) and "  " not in declared.doc, key
        assert declared.problem(OmegaConf.select(defaults, key)) is None, key
        if declared.acts_with:
            other, *values = declared.acts_with
            assert other in declarations() and isinstance(schema_type(other),
                                                          type | types.UnionType), key
            choices = declarations()[other].choices or declarations()[other].known
            assert all(value in choices for value in values) if choices else True, key


def test_a_setting_given_where_it_cannot_act_is_named():
    cfg = load_config(["optim.gamma=0.5", "ddp.static_graph=true", "profile.steps=3",
                       "train.early_stop_min_delta=0.1", "parallel.strategy=fsdp"])
    given = ["optim.gamma", "ddp.static_graph", "profile.steps", "train.early_stop_min_delta",
             "parallel.strategy", "optim.args.momentum"]
    assert inactive_settings(cfg, given) == [
        "optim.gamma=0.5 has no effect with optim.schedule=cosine: it acts only with "
        "optim.schedule=step or multistep or plateau",
        "ddp.static_graph=True has no effect with parallel.strategy=fsdp: it acts only with "
        "parallel.strategy=ddp",
        "profile.steps=3 has no effect with profile.enabled=false: it acts only with "
        "profile.enabled=true",
        "train.early_stop_min_delta=0.1 has no effect with train.early_stop_patience=0: it acts "
        "only with train.early_stop_patience=a value above 0"]
    # A schedule of yours (model.py) may read any of the schedules' numbers: nothing is said.
    cfg = load_config(["optim.schedule=my_schedule", "optim.gamma=0.5"])
    assert inactive_settings(cfg, ["optim.gamma"]) == []


def test_a_data_setting_the_dataset_does_not_read_is_named():
    # Which built-in datasets read each setting: tests/test_examples.py records it.
    given = ["data.block_size", "data.synthetic_samples"]
    cfg = load_config(["data.block_size=64", "data.synthetic_samples=500"])
    assert inactive_settings(cfg, given) == [
        "data.block_size=64 has no effect with data.dataset=digits: it acts only with "
        "data.dataset=tokens",
        "data.synthetic_samples=500 has no effect with data.dataset=digits: it acts only with "
        "data.dataset=synthetic or images"]
    cfg = load_config(["data.dataset=tokens", "data.block_size=64", "data.val_fraction=0.3"])
    assert inactive_settings(cfg, ["data.block_size", "data.val_fraction"]) == [
        "data.val_fraction=0.3 has no effect with data.dataset=tokens: it acts only with "
        "data.dataset=digits or digits_files or digits_shards or breast_cancer or diabetes or "
        "synthetic or images"]
    # A dataset of yours may read any of them: nothing is said.
    cfg = load_config(["data.dataset=data_sources.py:mine", "data.block_size=64"])
    assert inactive_settings(cfg, ["data.block_size"]) == []


def test_your_settings_do_not_reuse_a_template_key():
    # A field of settings.py named like one of the template's section would be silently
    # replaced by the template's (its default and its type): refuse it here.
    for name, template, yours in EXTENDED:
        clash = sorted({f.name for f in fields(yours)} & set(inspect.get_annotations(template)))
        assert not clash, (
            f"settings.py: {yours.__name__} declares {', '.join(clash)}, which the template's "
            f"{name} section already has ({name}.{clash[0]}): give yours another name")


YOUR_SETTINGS = '''from dataclasses import dataclass

from ddpkit.schema import setting


@dataclass
class DataSettings:
    scan_weight: float = setting(0.5, "The weight of a scan in the loss.", above=0)


@dataclass
class ModelSettings:
    aux_head: bool = False


@dataclass
class TaskSettings:
    pass
'''
PROBE = '''import sys
from ddpkit.config import UserError, load_config
cfg = load_config([])
print(cfg.model.aux_head, cfg.data.scan_weight)
cfg = load_config(["--config", "exp.yaml", "data.scan_weight=2"])
print(cfg.model.aux_head, cfg.data.scan_weight)
for bad in ("model.aux_hed=true", "model.aux_head=maybe", "data.scan_weight=-1"):
    try:
        load_config([bad])
    except UserError as error:
        print(error)
'''


def test_a_setting_of_yours_is_a_key_like_any_other(tmp_path):
    # The engine in a folder of its own, beside a settings.py that declares two fields.
    shutil.copytree(PROJECT_DIR / "ddpkit", tmp_path / "ddpkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_DIR / "config.py", tmp_path)
    (tmp_path / "configs").mkdir()
    shutil.copy(DEFAULT_CONFIG_FILE, tmp_path / "configs")
    (tmp_path / "settings.py").write_text(YOUR_SETTINGS)
    (tmp_path / "exp.yaml").write_text("model:\n  aux_head: true\n")
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                           text=True, check=False)
    assert probe.returncode == 0, probe.stderr
    defaults, given, unknown, wrong_type, out_of_range = probe.stdout.splitlines()
    assert defaults == "False 0.5"  # the defaults of settings.py
    assert given == "True 2.0"  # from a YAML file and the command line, typed
    assert unknown.startswith("model.aux_hed is not a config key (command line); section model "
                              "has: aux_head, name, ")
    assert unknown.endswith("; did you mean model.aux_head?")
    assert wrong_type == ("model.aux_head=maybe is not valid (command line): model.aux_head must "
                          "be true or false")
    # Declared with the schema's setting(): checked as the template's settings are.
    assert out_of_range == "data.scan_weight=-1.0 is not valid: it must be > 0"
    shown = subprocess.run([sys.executable, "config.py", "model.aux_head=true"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert "  aux_head: true\n" in shown and "  scan_weight: 0.5\n" in shown


def test_overrides_are_typed_and_applied():
    cfg = load_config(["optim.lr=1e-2", "train.epochs=7", "model.batchnorm=true"])
    assert cfg.optim.lr == pytest.approx(0.01)
    assert cfg.train.epochs == 7 and cfg.model.batchnorm is True


def test_config_file_and_launcher_flags(tmp_path):
    custom = tmp_path / "exp.yaml"
    custom.write_text("train:\n  epochs: 4\n")
    # --local_rank / --local-rank come from python -m torch.distributed.launch: accepted quietly.
    argv = ["--local_rank=1", "--config", str(custom), "--local-rank", "1", "optim.lr=0.5"]
    cfg = load_config(argv)
    assert cfg.train.epochs == 4 and cfg.optim.lr == 0.5
    assert parse_args(argv)[1] == ["optim.lr=0.5"]


@pytest.mark.parametrize(
    ("argv", "world_size", "expected"),
    [
        (["optim.lrr=0.1"], None, "optim.lrr is not a config key"),
        (["optim.lrr=0.1"], None, "did you mean optim.lr?"),
        (["train.epochs=abc"], None, "train.epochs=abc is not valid"),
        (["train.epochs=2.5"], None, "must be a whole number"),
        (["train.epochs=0"], None, "train.epochs=0 is not valid"),
        (["eval.split=train"], None, "choose one of test, val"),
        (["eval.binned_thresholds=100", "eval.save_predictions=true"], None,
         "eval.save_predictions=true needs every sample's row"),
        (["parallel.strategy=fsdp", "speed.precision=fp16"], None,
         "parallel.strategy=fsdp does not take speed.precision=fp16"),
        (["parallel.strategy=zero"], None, "choose one of ddp, fsdp"),
        (["train=3"], None, "train is a section"),
        (["epochs"], None, "not a key=value override"),
        (["--bogus"], None, "unknown option --bogus"),
        (["train.global_batch_size=64"], 3, "does not divide by the 3 processes"),
        (["train.micro_batch_size=16", "train.grad_accum_steps=2"], 2,
         "train.micro_batch_size=16 and train.grad_accum_steps=2 both set the accumulation"),
        (["train.micro_batch_size=16"], 3, "train.global_batch_size=64 does not divide into "
         "micro-batches of train.micro_batch_size=16 on the 3 processes: use a multiple of 48"),
        (["train.micro_batch_size=-1"], None, "train.micro_batch_size=-1 is not valid"),
        (["optim.lr=nan"], None, "optim.lr=nan is not valid: it must be a finite number"),
        (["optim.grad_clip=inf"], None, "optim.grad_clip=inf is not valid"),
        (["data.split_seed=-1"], None, "a seed must be between 0 and 4294967295"),
        (["run.seed=4294967296"], None, "run.seed=4294967296 is not valid"),
        (["model.dropout=1"], None, "model.dropout=1.0 is not valid"),
        (["ddp.timeout_minutes=0.01"], None, "every healthy step would be reported as a stall"),
        (["data.val_fraction=1"], None,
         "data.val_fraction=1.0 is not valid: it must be above 0 and below 1"),
        (["data.synthetic_classes=1"], None,
         "data.synthetic_classes=1 is not valid: it must be >= 2"),
        (["train.limit_val_batches=2.5"], None, "train.limit_val_batches=2.5 is not valid: give "
         "a whole number of batches, a fraction below 1, or 0 for all of them"),
    ],
)
def test_bad_input_names_the_key(argv, world_size, expected):
    with pytest.raises(UserError, match=expected.replace("?", r"\?")):
        load_config(argv, world_size)


def test_bad_key_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: 0.1\n  momentum: 0.9\n")
    with pytest.raises(UserError, match=f"optim.momentum is not a config key \\({bad}\\)"):
        load_config(["--config", str(bad)])


def test_preflight_cli_is_one_line_and_fast_to_import():
    result = subprocess.run(
        [sys.executable, "config.py", "--world-size", "2", "train.epochs=abc"],
        cwd=PROJECT_DIR, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: train.epochs=abc is not valid (command line): train.epochs must be a whole number"
    ]
    # run.sh calls config.py before every launch: it must not pay for importing torch.
    probe = ("import sys, config; from ddpkit.config import load_config; load_config([]); "
             "print('torch' in sys.modules, 'settings' in sys.modules)")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_DIR, text=True,
                              capture_output=True, check=True)
    assert imported.stdout.strip() == "False True"


def test_given_keys_are_the_overrides_and_a_custom_files_keys(tmp_path):
    custom = tmp_path / "exp.yaml"
    custom.write_text("model:\n  hidden_dim: 64\ndata:\n  root: /data/x\n")
    assert given_keys(["optim.lr=0.1", "--config", str(custom)]) == [
        "model.hidden_dim", "data.root", "optim.lr"]
    assert given_keys(["--config", str(DEFAULT_CONFIG_FILE)]) == []  # the defaults: none given


def test_lookup_by_registry_key_module_or_file(tmp_path):
    registry = {"a": 1}
    assert lookup(registry, "a", "data.dataset", "a dataset") == 1
    assert lookup(registry, "math:pi", "data.dataset", "a dataset") > 3.14
    source = tmp_path / "my_builders_for_lookup.py"
    source.write_text("def build(cfg):\n    return 'built'\n")
    assert lookup(registry, f"{source}:build", "data.dataset", "a dataset")(None) == "built"
    with pytest.raises(UserError, match="data.dataset=b is not a dataset: choose one of a"):
        lookup(registry, "b", "data.dataset", "a dataset")
    with pytest.raises(UserError, match="cannot import it"):
        lookup(registry, f"{source}:missing", "data.dataset", "a dataset")
    with pytest.raises(UserError, match="no such file"):
        lookup(registry, "nowhere/none.py:build", "model.name", "a model")
