"""The baked project's language-model recipe (docs/recipes/language-model.md), applied literally
to a fresh bake on 2 processes: the docs to character tokens, the built-in GPT trained (40 of
the recipe's 500 steps), text from sample.py, evaluate.py's metrics; then its pretrained start:
a small Hugging Face causal LM and its tokenizer saved in a folder by the test (nothing
downloaded; the weights in bfloat16), the text prepared with that tokenizer, the run started
from those weights in float32 and sample.py on it, and the builder's one-line refusal of a model
that knows fewer tokens than the data."""

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import apply_edit, recipe_blocks, run
from test_recipe import changed_files, two_bakes

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

RECIPE_FILES = {"settings.py", "model.py"}
TRAIN = """\
./run.sh run.name=chars data.dataset=tokens data.root=data/chars data.block_size=128 \\
    model.name=gpt model.hidden_dim=128 model.num_layers=4 \\
    train.global_batch_size=64 train.max_steps=500 train.val_every_steps=100 \\
    train.limit_val_batches=10 train.estimate_windows=256 \\
    optim.lr=0.001 optim.warmup_steps=50 optim.grad_clip=1.0
"""
SHORTER = " train.max_steps=40 train.val_every_steps=20"  # 500 steps: minutes on 2 cores
TUNE = """\
python -m ddpkit.tokens docs README.md --out data/subwords --tokenizer path/to/folder
./run.sh run.name=tuned data.dataset=tokens data.root=data/subwords data.block_size=128 \\
    model.name=pretrained model.pretrained=path/to/folder \\
    train.global_batch_size=64 train.max_steps=200 train.val_every_steps=50 \\
    train.limit_val_batches=10 optim.lr=0.0001 optim.warmup_steps=20 optim.grad_clip=1.0
"""
TUNE_SHORTER = " train.max_steps=4 train.val_every_steps=0"  # its start is what is checked
VAL_METRICS = {"val_loss", "val_perplexity", "val_bits_per_token", "val_bits_per_character",
               "val_accuracy", "val_sampled_train_loss", "val_sampled_val_loss"}
VOCABULARY = 90  # the saved tokenizer's and model's: fewer than the docs' characters


def run_block(project: Path, body: str) -> str:
    result = run(["bash", "-euo", "pipefail", "-c", body], cwd=project, NPROC_PER_NODE="2")
    assert result.returncode == 0, f"{body}\n{result.stdout}"
    return result.stdout


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    """Every block but the last (the pretrained start, which needs a saved model) in order."""
    fresh, project = two_bakes(tmp_path_factory.mktemp("recipe-lm"))
    blocks = recipe_blocks(project, "lm")
    assert [action for action, _ in blocks] == [
        "run", "run", "run", "run", 'insert settings.py after "    # model settings of your own:"',
        "append model.py", "run"]
    assert (blocks[1][1], blocks[-1][1]) == (TRAIN, TUNE)
    outputs = []
    for action, body in blocks[:-1]:
        if action != "run":
            apply_edit(project, action, body)
        else:  # the training block shortened for time: its later max_steps wins
            outputs.append(run_block(project, body.rstrip("\n") + SHORTER if body == TRAIN
                                     else body))
    (run_dir,) = (project / "runs").iterdir()
    return fresh, project, run_dir, outputs


def test_the_recipe_touches_only_the_files_it_names(applied):
    fresh, project, _, _ = applied
    assert changed_files(fresh, project) == RECIPE_FILES
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout


def test_two_processes_train_the_gpt_and_log_loss_tokens_per_s_and_validation(applied):
    _, _, run_dir, outputs = applied
    trained = outputs[1]
    assert "2 process(es) on cpu" in trained and "MFLOP per token" in trained
    assert "throughput: " in trained and " tokens/s, " in trained
    steps = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert (steps[0]["step"], steps[-1]["step"]) == (1, 40) and len(steps) > 2
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # from about ln(99) = 4.6: it learns
    assert {"loss", "accuracy"} <= set(steps[0]) and "tokens_per_s" not in steps[0]  # start-up
    for record in steps[1:]:
        assert {"loss", "accuracy", "samples_per_s", "tokens_per_s"} <= set(record), record
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [20, 40]
    for record in records:
        assert VAL_METRICS <= set(record), record


def test_sample_continues_the_prompt_and_evaluate_scores_the_test_split(applied):
    _, _, run_dir, outputs = applied
    # --prompt "The model" --tokens 300: one character a token, after sample.py's line (on
    # stderr) that names the weights
    said, sampled = outputs[2].split("\n", 1)
    assert said == (f"sampling the trained weights of runs/{run_dir.name}/checkpoints/"
                    "step-00000040 (step 40)")
    assert sampled.startswith("The model") and sampled.endswith("\n" + "-" * 40 + "\n")
    assert len(sampled) == len("The model") + 300 + 1 + 40 + 1
    assert "evaluating the newest run" in outputs[3]
    metrics = json.loads((run_dir / "eval-test" / "metrics.json").read_text())
    assert {"loss", "perplexity", "bits_per_token", "bits_per_character", "accuracy"} <= set(
        metrics)
    assert metrics["world_size"] == 2


@pytest.fixture(scope="module")
def pretrained(applied, tmp_path_factory):
    """A small GPT-2 and a word-level tokenizer of the project's README, saved in one folder; the
    model trained here for a few steps, so that its loss is far below a fresh model's, and saved
    in bfloat16."""
    pytest.importorskip("transformers")  # the baked project's [transformers] extra
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("pretrained")
    text = (applied[1] / "README.md").read_text()
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=VOCABULARY,
                                                                special_tokens=["[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCABULARY, n_positions=128, n_embd=32,
                                       n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(20):
        starts = torch.randint(0, len(ids) - 128, (16,)).tolist()
        windows = torch.stack([ids[start:start + 128] for start in starts])
        model(windows, labels=windows).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(folder)  # as many released models are saved
    return folder


def test_training_starts_from_the_saved_weights_in_float32(applied, pretrained):
    import torch

    _, project, _, _ = applied
    tune = TUNE.replace("path/to/folder", str(pretrained))
    output = run_block(project, tune.rstrip("\n") + TUNE_SHORTER)
    assert f"{VOCABULARY} tokens in the vocabulary (tokenizer)" in output
    (run_dir,) = (project / "runs").glob("tuned-*")
    first = json.loads((run_dir / "train_log.jsonl").read_text().splitlines()[0])
    # A fresh model's loss is about ln(90) = 4.5; the saved one learned the README's words.
    assert first["step"] == 1 and first["loss"] < math.log(VOCABULARY) - 1
    weights = torch.load(run_dir / "model.pt", weights_only=True)["model"]
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    sampled = run([sys.executable, "sample.py", str(run_dir), "--prompt", "the", "--tokens",
                   "5"], cwd=project)
    assert sampled.returncode == 0, sampled.stdout
    *_, text, dashes = sampled.stdout.splitlines()  # (before them: transformers' loading bar)
    assert text.startswith("the ") and dashes == "-" * 40


def test_a_model_that_knows_fewer_tokens_than_the_data_is_one_line(applied, pretrained):
    _, project, _, _ = applied
    characters = json.loads((project / "data/chars/meta.json").read_text())["vocab_size"]
    assert characters > VOCABULARY  # (99 at the time of writing)
    runs = set((project / "runs").iterdir())
    refused = run(["./run.sh", "data.dataset=tokens", "data.root=data/chars",
                   "model.name=pretrained", f"model.pretrained={pretrained}"], cwd=project,
                  NPROC_PER_NODE="2")
    assert refused.returncode == 2, refused.stdout
    expected = (f"error: model.pretrained={pretrained} knows {VOCABULARY} tokens, fewer than the "
                f"data's {characters}: prepare the text with its tokenizer (python -m "
                "ddpkit.tokens ... --tokenizer)")
    assert [line for line in refused.stdout.splitlines() if "error" in line] == [expected]
    assert "Traceback" not in refused.stdout
    assert set((project / "runs").iterdir()) == runs  # nothing left behind
