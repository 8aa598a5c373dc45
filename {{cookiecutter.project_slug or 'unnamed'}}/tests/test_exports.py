"""Exports others can load (export.py --format): an FSDP checkpoint of the built-in GPT, written
by 2 processes, consolidated into model.safetensors that reloads into a fresh model built from
its metadata's config with the outputs of model.pt; a Hugging Face model trained through a
builder of one's own, written as a save_pretrained folder with its data's tokenizer, which
from_pretrained opens with the trained logits; and the one-line refusals."""

import json
import sys

import numpy as np
import pytest
import torch
from test_language_model import TEXT, token_folder, word_tokenizer

import export
from conftest import needs_extra, run
from ddpkit import __version__
from ddpkit.config import UserError, config_from_dict
from ddpkit.parallel import build_model

VOCABULARY = 11
# The built-in GPT (its head shares the token embedding's weights), 4 steps under FSDP.
GPT = ["data.dataset=tokens", "data.block_size=16", "model.name=gpt", "model.hidden_dim=16",
       "model.num_layers=1", "model.dropout=0", "train.global_batch_size=4", "train.max_steps=4",
       "parallel.strategy=fsdp", "train.progress_bar=false", "train.plot_curves=false",
       "train.limit_val_batches=2", "train.estimate_windows=8"]
USAGE = ("(usage: python export.py [-h] [--best] [--format pt|safetensors|hf] [--weights "
         "auto|averaged|trained] source [output])")


@pytest.fixture(scope="module")
def fsdp_gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exports")
    tokens = token_folder(folder / "tokens", np.arange(400) % VOCABULARY,
                          np.arange(40) % VOCABULARY, np.arange(40) % VOCABULARY, VOCABULARY)
    run_dir = folder / "run"
    result = run(["./run.sh", *GPT, f"data.root={tokens}", f"run.dir={run_dir}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return run_dir


@pytest.mark.slow
def test_an_fsdp_checkpoint_exports_to_safetensors_that_reload_with_equal_outputs(fsdp_gpt):
    needs_extra("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_model

    result = run([sys.executable, "export.py", str(fsdp_gpt), "--format", "safetensors"])
    assert result.returncode == 0, result.stdout
    target, latest = fsdp_gpt / "model.safetensors", fsdp_gpt / "checkpoints" / "step-00000004"
    assert result.stdout.splitlines() == [
        f"wrote {target}: the trained weights of {latest} (step 4)"]
    assert target.stat().st_mode & 0o044 == 0o044  # readable by others, as model.pt is
    weights = torch.load(fsdp_gpt / "model.pt", weights_only=True)["model"]
    with safe_open(target, "pt") as file:
        metadata = file.metadata()
        stored = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
    (dropped,) = weights.keys() - stored.keys()  # the head and the token embedding: tied
    assert {dropped, metadata[dropped]} == {"head.weight", "token_embedding.weight"}
    assert all(torch.equal(stored[key], weights[key]) for key in stored)
    assert (metadata["step"], metadata["template_version"]) == ("4", __version__)
    cfg = config_from_dict(json.loads(metadata["config"]), "the export's metadata")
    fresh, reference = (build_model(cfg.model, (cfg.data.block_size,), VOCABULARY)
                        for _ in range(2))
    load_model(fresh, target)
    reference.load_state_dict(weights)
    tokens = torch.arange(32).reshape(2, 16) % VOCABULARY
    assert torch.equal(fresh.eval()(tokens), reference.eval()(tokens))

    # The run's data moved: data.root says where it is now; another key is one line.
    data = fsdp_gpt.parent / "tokens"
    moved = data.rename(fsdp_gpt.parent / "moved")
    try:
        again = run([sys.executable, "export.py", str(fsdp_gpt), "--format", "safetensors",
                     f"data.root={moved}", str(fsdp_gpt / "moved.safetensors")])
        other = run([sys.executable, "export.py", str(fsdp_gpt), "model.hidden_dim=8",
                     "--format", "safetensors"])
    finally:
        moved.rename(data)
    assert again.returncode == 0, again.stdout
    with safe_open(fsdp_gpt / "moved.safetensors", "pt") as file:
        assert json.loads(file.metadata()["config"])["data"]["root"] == str(moved)
        assert all(torch.equal(file.get_tensor(key), stored[key]) for key in stored)
    assert other.returncode == 2 and other.stdout.splitlines() == [
        "error: model.hidden_dim: export.py takes data.* settings only (where the run's data is "
        "now); the model and the task come from the checkpoint"], other.stdout


@pytest.mark.slow
def test_hf_of_a_model_that_is_not_a_hugging_face_model_is_one_line(fsdp_gpt):
    needs_extra("transformers")  # without it, --format hf first says to install it
    result = run([sys.executable, "export.py", str(fsdp_gpt), "--format", "hf"])
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == [
        "error: --format hf: model.name=gpt builds a TinyGPT, not a Hugging Face "
        "PreTrainedModel: export it with --format safetensors"]
    assert not list(fsdp_gpt.glob("*hf-model*"))  # nothing written, nothing left behind


BUILDER = '''
from ddpkit.lm import pretrained_causal_lm


def build(cfg, input_shape, num_outputs):
    return pretrained_causal_lm({folder!r}, input_shape, num_outputs)
'''


@pytest.mark.slow
def test_a_hugging_face_model_exports_a_folder_that_from_pretrained_opens(tmp_path):
    """A tiny GPT-2 and a word-level tokenizer saved in a folder (nothing downloaded), trained 3
    steps from it by a builder as the language-model recipe writes one, exported with --format
    hf: from_pretrained opens the folder with the trained weights, and its tokenizer."""
    needs_extra("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from ddpkit.tokens import prepare

    pretrained = tmp_path / "pretrained"
    word_tokenizer(pretrained)
    (tmp_path / "text.txt").write_text(TEXT)
    vocabulary = prepare([tmp_path / "text.txt"], tmp_path / "tokens", str(pretrained))[
        "vocab_size"]
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=vocabulary, n_positions=16, n_embd=16, n_layer=1,
                               n_head=2, bos_token_id=0, eos_token_id=0)).save_pretrained(
        pretrained)
    (tmp_path / "builder.py").write_text(BUILDER.format(folder=str(pretrained)))
    run_dir = tmp_path / "run"
    trained = run([sys.executable, "train.py", *GPT[:2], f"data.root={tmp_path / 'tokens'}",
                   f"model.name={tmp_path / 'builder.py'}:build", "train.global_batch_size=4",
                   "train.max_steps=3", "optim.lr=0.01", "optim.warmup_steps=0", *GPT[-4:],
                   f"run.dir={run_dir}"])
    assert trained.returncode == 0, trained.stdout
    result = run([sys.executable, "export.py", str(run_dir), "--format", "hf"])
    assert result.returncode == 0, result.stdout
    folder = run_dir / "hf-model"
    # (Its last line: with torchao installed, transformers imports it, which warns first.)
    assert result.stdout.splitlines()[-1] == (
        f"wrote {folder}: the trained weights of {run_dir / 'checkpoints' / 'step-00000003'} "
        "(step 3)")
    with pytest.raises(UserError) as error:  # a folder of something else: never replaced
        export.main([str(run_dir), str(tmp_path), "--format", "hf"])
    assert str(error.value) == (f"{tmp_path} exists and is not a Hugging Face model's folder: "
                                "give another output folder, or remove it")
    tokens = torch.tensor(AutoTokenizer.from_pretrained(folder)(TEXT[:60])["input_ids"])[None]
    assert tokens.shape[1] > 4 and AutoTokenizer.from_pretrained(pretrained)(TEXT[:60])[
        "input_ids"] == tokens[0].tolist()
    opened = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    start = reference(tokens).logits
    reference.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True)["model"])
    assert torch.equal(opened(tokens).logits, reference(tokens).logits)
    assert not torch.equal(opened(tokens).logits, start)  # the trained weights, not the start


def test_a_mistake_in_the_arguments_is_one_line():
    with pytest.raises(UserError) as error:
        export.main(["runs/x", "--format", "onnx"])
    assert str(error.value) == f"--format onnx is not one of pt, safetensors, hf {USAGE}"


def test_a_format_whose_package_is_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if it were not installed
    with pytest.raises(UserError) as error:
        export.main(["runs/x", "--format", "safetensors"])
    assert str(error.value) == ("--format safetensors needs the safetensors package: install "
                                "the safetensors extra (pip install -e '.[safetensors]')")
