"""Language models (ddpkit/tokens.py, ddpkit/lm.py): token files and the command that writes
them, training windows drawn by a plan (the same global batches at any process count, memory
independent of the corpus), the next-token task, the built-in GPT, its FLOPs and its sampling,
and a real two-process run that trains it, evaluates it exactly at 1 and 2 processes and writes
text with sample.py."""

import itertools
import json
import pickle
import re
import shutil
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import needs_extra, only_run_dir, run
from ddpkit import flops
from ddpkit.checkpoint_files import MODEL_FILE, list_checkpoints
from ddpkit.collate import stacking_collate
from ddpkit.config import UserError, load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.estimates import estimate_loader, estimate_streams
from ddpkit.lm import build_gpt, flops_per_token, generate, pretrained_causal_lm
from ddpkit.parallel import fsdp_blocks
from ddpkit.run_state import train_step
from ddpkit.splits import Splits
from ddpkit.streams import DataError, RankStream, TrainPlan
from ddpkit.tasks import build_task
from ddpkit.tokens import PREPARE, TokenFile, TokenWindows, prepare, tokens

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))


def token_folder(folder, train, val, test, vocab: int, dtype: str = "uint16"):
    """A token folder written by hand: the three splits' tokens as they are, and meta.json."""
    folder.mkdir()
    for split, part in (("train", train), ("val", val), ("test", test)):
        np.asarray(part, dtype=dtype).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype}))
    return folder


def data_config(*extra: str):
    return load_config(["data.dataset=tokens", "model.name=gpt", *extra]).data


# --- token files ---------------------------------------------------------------------------------

def test_prepare_writes_character_tokens_that_decode_to_the_text(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "tokens", val_fraction=0.1,
                   test_fraction=0.2)
    assert meta["tokenizer"] == "characters" and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == len(set(TEXT)) == len(meta["characters"])
    decoded = "".join(
        "".join(meta["characters"][t] for t in np.fromfile(tmp_path / "tokens" / f"{s}.bin",
                                                           dtype=np.uint16))
        for s in ("train", "val", "test"))
    assert decoded == TEXT
    assert sum(meta["tokens"].values()) == len(TEXT)
    assert meta["tokens"]["test"] == pytest.approx(0.2 * len(TEXT), abs=1)


def word_tokenizer(folder: Path):
    """A word-level tokenizer of TEXT, saved in `folder` as a Hugging Face tokenizer."""
    needs_extra("transformers", "tokenizers")  # (transformers brings it)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    return words


def test_prepare_with_a_saved_tokenizer_and_bits_per_character(tmp_path):
    words = word_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "a.txt").write_text(TEXT)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "tokens", str(tmp_path / "tokenizer"))
    assert meta["vocab_size"] == words.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["token_characters"][words.token_to_id("quick")] == len("quick")
    splits = tokens(data_config(f"data.root={tmp_path / 'tokens'}", "data.block_size=8"))
    assert splits.task == "next_token" and splits.num_classes == meta["vocab_size"]
    assert splits.train.token_characters[words.token_to_id("brown")] == len("brown")


@pytest.mark.parametrize("case", ["cut", "vocabulary", "block"])
def test_bad_token_data_is_one_line(tmp_path, case):
    folder = token_folder(tmp_path / "t", np.arange(300) % 7, [1] * 50, [2] * 50, vocab=7)
    fix = f"write it again with `{PREPARE}`"
    block = "data.block_size=16"
    if case == "cut":
        with open(folder / "val.bin", "ab") as handle:
            handle.write(b"\0")
        expected = (DataError, f"{folder / 'val.bin'} is 101 bytes, not a whole number of "
                               f"uint16 tokens (2 bytes each): {fix}")
    elif case == "vocabulary":
        np.asarray([1, 2, 9, 3], dtype=np.uint16).tofile(folder / "test.bin")
        block = "data.block_size=2"
        expected = (DataError, f"{folder / 'test.bin'} holds the token id 9, at or above the "
                               f"vocabulary size 7 of its meta.json: {fix}")
    else:
        block = "data.block_size=50"
        expected = (UserError, f"data.block_size=50 is larger than the val split of {folder} "
                               "(50 tokens, one more than a window's inputs needed): lower "
                               "data.block_size, or give that split more text")
    with pytest.raises(expected[0]) as error:
        tokens(data_config(f"data.root={folder}", block))
    assert str(error.value) == expected[1]


# --- windows by plan -----------------------------------------------------------------------------

def global_batches(stream, world: int, epoch: int, step: int, count: int, micro: int = 1):
    """`count` global batches from (epoch, step) on, made by `world` ranks in this process: the
    inputs of each step's counted windows, ranks' shares in rank order."""
    steps = {}
    for rank in range(world):
        plan = TrainPlan(len(stream), 12, world, rank, micro, drop_last=False)
        ranks_stream = RankStream(stream, plan, 5, stacking_collate)
        ranks_stream.start(epoch, step)
        for item_epoch, index, weight, (inputs, _) in itertools.islice(
                iter(ranks_stream), count * micro):
            if weight:  # a stand-in at weight 0 (a rank with no share of a last step) adds nothing
                steps.setdefault((item_epoch, index), []).append(inputs)
    return [torch.cat(parts) for _, parts in sorted(steps.items())][:count]


def test_windows_are_the_same_global_batches_at_any_process_count_and_resume(tmp_path):
    """62 windows an epoch at a global batch of 12: 5 full steps and one of 2, split over 3
    ranks as 1, 1 and a stand-in. Every process count, with accumulation or not, gives the
    same global batches; a resume at another count continues the same sequence."""
    folder = token_folder(tmp_path / "t", np.arange(1000) % 97, [1] * 20, [2] * 20, vocab=97)
    stream = tokens(data_config(f"data.root={folder}", "data.block_size=16")).train
    assert len(stream) == 62
    one = global_batches(stream, 1, 0, 0, 12)
    assert [len(batch) for batch in one] == [12] * 5 + [2] + [12] * 5 + [2]
    assert len({batch[0, 0].item() for batch in one}) > 6  # drawn anew each step and epoch
    for world, micro in ((2, 1), (2, 2), (3, 1), (4, 1)):
        batches = global_batches(stream, world, 0, 0, 12, micro)
        assert all(torch.equal(a, b) for a, b in zip(batches, one, strict=True)), world
    resumed = global_batches(stream, 3, 1, 2, 4)  # epoch 1, step 2, at another process count
    assert all(torch.equal(a, b) for a, b in zip(resumed, one[8:], strict=True))


def test_with_max_steps_one_epoch_is_the_whole_run_and_draws_the_same_windows(tmp_path):
    folder = token_folder(tmp_path / "t", np.arange(1000) % 97, [1] * 20, [2] * 20, vocab=97)
    common = ["data.dataset=tokens", f"data.root={folder}", "data.block_size=16",
              "model.name=gpt", "train.global_batch_size=12"]
    passes, run = (DataModule(load_config([*common, *extra]), DistEnv(0, 0, 1, False),
                              torch.device("cpu")) for extra in ([], ["train.max_steps=50"]))
    assert (passes.steps_per_epoch, run.steps_per_epoch) == (6, 50)  # 62 windows a pass
    first = [next(data.train_steps(0, skip_steps=3))[0][0] for data in (passes, run)]
    assert torch.equal(*first)


def test_sampled_estimates_score_the_same_windows_at_any_process_count(tmp_path):
    """train.estimate_windows: the K windows of each split, ranks' blocks in rank order, are the
    same at 1, 2 and 3 processes; the val estimate reads the val split."""
    folder = token_folder(tmp_path / "t", np.arange(1000) % 50, 50 + np.arange(300) % 40,
                          [2] * 20, vocab=97)
    cfg = load_config(["data.dataset=tokens", f"data.root={folder}", "data.block_size=16",
                       "model.name=gpt", "train.global_batch_size=12", "eval.batch_size=4"])

    def estimate_windows(world: int) -> dict[str, torch.Tensor]:
        parts = {"train": [], "val": []}
        for rank in range(world):
            data = DataModule(cfg, DistEnv(rank, rank, world, False), torch.device("cpu"))
            for split, stream in estimate_streams(data).items():
                parts[split] += [inputs for inputs, _ in estimate_loader(data, stream, 11)]
        return {split: torch.cat(batches) for split, batches in parts.items()}

    one = estimate_windows(1)
    assert one["train"].shape == one["val"].shape == (11, 16)
    assert one["train"].max() < 50 <= one["val"].min()
    for world in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(estimate_windows(world).values(),
                                                     one.values(), strict=True))


def test_the_plan_does_not_grow_with_the_corpus(tmp_path):
    """A 4 GiB sparse token file (2^31 tokens): the rank's stream, what its loader workers get,
    holds no list of windows or steps, and starting deep into an epoch draws one step's."""
    path = tmp_path / "train.bin"
    with open(path, "wb") as handle:
        handle.truncate(2**32)
    stream = TokenWindows(TokenFile(path, "uint16", 50_304, "fix it"), 128)
    plan = TrainPlan(len(stream), 64, 2, 1, 2, drop_last=False)
    assert plan.steps == 2**31 // 128 // 64  # 262,144 steps an epoch
    ranks_stream = RankStream(stream, plan, 0, stacking_collate)
    assert len(pickle.dumps(ranks_stream)) < 2_000
    tracemalloc.start()
    try:
        ranks_stream.start(0, 200_000)
        epoch, step, weight, (inputs, targets) = next(iter(ranks_stream))
        assert len(ranks_stream) == 2 * plan.steps
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (epoch, step, weight, inputs.shape) == (0, 200_000, 1.0, (16, 128))
    assert peak < 1_000_000, f"{peak:,} bytes"


# --- the task and the model ----------------------------------------------------------------------

class CausalLMOutput(dict):
    """What a Hugging Face causal LM returns: a dict that also has attributes."""

    def __getattr__(self, name):
        return self[name]


def test_next_token_task_takes_logits_pairs_and_hugging_face_outputs():
    splits = Splits(SimpleNamespace(token_characters=torch.full((5,), 2.0)), None, None,
                    task="next_token", num_classes=5)
    task = build_task(load_config([]), splits)
    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    targets = torch.randint(0, 5, (3, 4))
    batch = (torch.zeros(3, 4, dtype=torch.long), targets)
    expected = torch.nn.functional.cross_entropy(logits.reshape(12, 5), targets.reshape(12))
    for outputs in (logits, (logits, torch.tensor(99.0)), CausalLMOutput(logits=logits)):
        assert task.loss(outputs, batch).item() == pytest.approx(expected.item(), rel=1e-12)
    rows = task.rows(logits, batch)
    metrics = task.metrics(torch.cat([rows, rows]))
    assert metrics["bits_per_token"] == pytest.approx(expected.item() / np.log(2), rel=1e-12)
    assert metrics["bits_per_character"] == pytest.approx(metrics["bits_per_token"] / 2)
    assert metrics["perplexity"] == pytest.approx(np.exp(expected.item()), rel=1e-12)
    accuracy = (logits.argmax(-1) == targets).double().mean().item()
    assert metrics["accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert task.summary_metrics(task.summarize(rows, 0), 0) == task.metrics(rows)
    # Evaluation hands it the logits as they are (no float64 copy of batch x time x vocab):
    # float32 and bfloat16 logits score in float32, each window's sum kept in float64.
    assert not task.outputs_in_float64
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        rounded = task.rows(logits.to(dtype), batch)
        assert rounded.dtype == torch.float64
        assert rounded.numpy() == pytest.approx(rows.numpy(), rel=tolerance)
        assert task.loss(logits.to(dtype), batch).dtype == torch.float32
    with pytest.raises(UserError, match=r"needs the logits of every position, \[batch, time, "
                       r"vocab\] = \[3, 4, 5\], and the model returned \[3, 1, 5\]"):
        task.loss(logits[:, -1:], batch)


def test_gpt_counts_six_flops_a_parameter_and_attention_per_token():
    cfg = load_config(["model.name=gpt", "model.hidden_dim=64", "model.num_layers=2"]).model
    model = build_gpt(cfg, (32,), 50)
    assert model.head.weight is model.token_embedding.weight
    assert fsdp_blocks(model) == list(model.blocks)  # FSDP2 shards block by block
    batch = torch.randint(0, 50, (2, 32))

    def loss(network, tokens_):
        return network(tokens_).logsumexp(-1).mean()

    counted = flops.count_training_flops(lambda: build_gpt(cfg, (32,), 50), loss, batch)
    # The counter leaves out what is not a matrix product (the LayerNorms' weights).
    assert counted / 2 / 32 == pytest.approx(flops_per_token(model, 32), rel=0.01)
    with pytest.raises(UserError, match="model.name=gpt reads windows of token ids"):
        build_gpt(cfg, (1, 8, 8), 10)


def test_generation_is_seeded_and_greedy_at_temperature_0():
    cfg = load_config(["model.name=gpt", "model.hidden_dim=32", "model.num_layers=1"]).model
    torch.manual_seed(0)
    model = build_gpt(cfg, (8,), 11).eval()
    prompt = torch.tensor([[1, 2, 3]])

    def continued(temperature, top_k, seed):
        generator = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 12, 8, temperature, top_k, generator)

    drawn = continued(1.0, 0, seed=4)
    assert drawn.shape == (1, 15) and torch.equal(drawn[:, :3], prompt)
    assert torch.equal(continued(1.0, 0, seed=4), drawn)
    assert not torch.equal(continued(1.0, 0, seed=5), drawn)
    greedy = continued(0.0, 0, seed=4)
    assert torch.equal(continued(1.0, 1, seed=9), greedy)  # top-1: the likeliest token
    assert greedy[0, 3] == model(prompt)[0, -1].argmax()


def test_a_pretrained_hugging_face_model_trains_and_writes_without_a_wrapper(tmp_path):
    """A causal LM saved in a folder (nothing downloaded), loaded as a builder in model.py
    loads it (pretrained_causal_lm, which refuses a folder that does not fit the data): its
    output object is scored as it is, it learns, and it continues text."""
    needs_extra("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=13, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(
        tmp_path / "pretrained")
    folder = token_folder(tmp_path / "t", np.arange(2000) % 13, np.arange(100) % 13,
                          np.arange(100) % 13, vocab=13)
    cfg = load_config(["data.dataset=tokens", f"data.root={folder}", "data.block_size=16",
                       "train.global_batch_size=8"])
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    model = pretrained_causal_lm(str(tmp_path / "pretrained"), (16,), 13)
    assert isinstance(model, GPT2LMHeadModel)
    refusals = {(str(tmp_path), (16,), 13): "is not a folder written by save_pretrained",
                (str(tmp_path / "pretrained"), (16,), 14): "knows 13 tokens, fewer than the "
                                                           "data's 14",
                (str(tmp_path / "pretrained"), (17,), 13): "data.block_size=17 is more than "
                                                           "the 16 positions"}
    for arguments, refusal in refusals.items():
        with pytest.raises(UserError, match=refusal):
            pretrained_causal_lm(*arguments)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)
    steps = itertools.chain.from_iterable(data.train_steps(epoch) for epoch in range(2))
    losses = [train_step(model, optimizer, next(steps), task, torch.device("cpu"))[0]["loss"]
              for _ in range(20)]
    assert losses[-1] < losses[0] / 4
    model.eval()
    continued = generate(model, torch.tensor([[3, 4, 5]]), 5, 16, temperature=0)
    assert continued.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]  # it learned to count mod 13


# --- real runs ----------------------------------------------------------------------------------

# The built-in GPT on the project's own text, a checkpoint every 10 steps, validation with
# sampled estimates at the end. No dropout: its masks differ at another process count.
LM_RUN = ["data.dataset=tokens", "data.block_size=64", "model.name=gpt", "model.hidden_dim=64",
          "model.num_layers=2", "model.dropout=0", "train.global_batch_size=12",
          "train.max_steps=30", "train.log_every=5", "train.ckpt_every=10",
          "train.keep_checkpoints=0", "optim.lr=0.003", "optim.warmup_steps=5",
          "train.progress_bar=false", "train.plot_curves=false", "train.limit_val_batches=4",
          "train.estimate_windows=32"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory) -> tuple[Path, list[str], str]:
    """Token files prepared from the project's docs, and a 2-process run of 30 steps on them:
    (the run folder, its settings, its output)."""
    root = tmp_path_factory.mktemp("lm")
    prepared = run([sys.executable, "-m", "ddpkit.tokens", "docs", "README.md", "--out",
                    str(root / "tokens")])
    assert prepared.returncode == 0, prepared.stdout
    assert prepared.stdout.startswith(f"wrote {root / 'tokens'}: ")
    settings = [*LM_RUN, f"data.root={root / 'tokens'}"]
    result = run(["./run.sh", *settings, f"run.output_dir={root / 'runs'}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return only_run_dir(root / "runs"), settings, result.stdout


@pytest.mark.slow
def test_two_processes_train_the_gpt_by_steps_with_estimates_and_tokens_per_s(trained_lm):
    run_dir, _, output = trained_lm
    assert "next_token task" in output and "MFLOP per token" in output
    assert "30 steps of windows drawn with replacement (no epochs)" in output
    assert "step    30/30  train_loss" in output and output.count("epoch") == 1  # no epochs
    windows = records(run_dir / "train_log.jsonl")
    assert [w["step"] for w in windows] == [1, 5, 10, 15, 20, 25, 30]
    assert windows[-1]["loss"] < min(windows[1]["loss"], windows[0]["loss"] - 0.8)  # it learns
    (validation,) = records(run_dir / "metrics.jsonl")
    assert "epoch" not in validation and "epoch_seconds" not in validation
    assert validation["val_sampled_val_loss"] < windows[0]["loss"]  # estimates beside the loss
    assert validation["val_sampled_train_loss"] < windows[0]["loss"]
    assert "epoch" not in json.loads((run_dir / "summary.json").read_text())
    rates = [w for w in windows if "samples_per_s" in w]
    assert rates and all(w["tokens_per_s"] == pytest.approx(64 * w["samples_per_s"])
                         for w in rates)


@pytest.mark.slow
def test_the_gpt_evaluates_exactly_at_1_2_and_3_processes(trained_lm, tmp_path):
    run_dir = trained_lm[0]
    evaluated = {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"eval{nproc}"
        command = ["./run.sh", "evaluate.py", f"eval.checkpoint={run_dir}",
                   f"eval.output_dir={out}", "eval.batch_size=7"]
        done = run([sys.executable, *command[1:]] if nproc == 1 else command,
                   NPROC_PER_NODE=str(nproc))
        assert done.returncode == 0, done.stdout
        evaluated[nproc] = json.loads((out / "metrics.json").read_text())
    one = evaluated[1]
    assert one["num_samples"] > 100 and one["bits_per_character"] == one["bits_per_token"]
    for nproc in (2, 3):
        assert evaluated[nproc]["num_samples"] == one["num_samples"]
        for name in ("loss", "perplexity", "bits_per_token", "bits_per_character", "accuracy"):
            # (float32 forward passes over other batches round apart)
            assert evaluated[nproc][name] == pytest.approx(one[name], rel=1e-6), (nproc, name)


@pytest.mark.slow
def test_sample_py_writes_text_from_the_trained_model(trained_lm, tmp_path):
    run_dir = trained_lm[0]
    # The prompt continued, one character a token, seeded.
    sampled = run([sys.executable, "sample.py", str(run_dir / "model.pt"), "--prompt", "The ",
                   "--tokens", "50", "--seed", "3", "--top-k", "10"])
    assert sampled.returncode == 0, sampled.stdout
    said, text = sampled.stdout.split("\n", 1)  # which weights (stderr), then the text
    assert said == f"sampling the trained weights of {run_dir / 'model.pt'} (step 30)"
    assert text.startswith("The ") and text.endswith("\n" + "-" * 40 + "\n")
    assert len(text) == len("The ") + 50 + 1 + 40 + 1
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    nothing = run([sys.executable, "sample.py", str(tmp_path / "empty")])
    assert (nothing.returncode, nothing.stdout) == (
        2, f"error: no checkpoint in {tmp_path / 'empty' / 'checkpoints'}: expected "
           f"{tmp_path / 'empty' / 'checkpoints'}/step-<N>/\n")


@pytest.mark.slow
def test_a_killed_lm_run_resumes_bitwise(trained_lm, tmp_path):
    """SIGKILL to a worker past step 12; torchrun restarts the workers, which resume from the
    newest checkpoint (step 10, or 20 on a slow machine) and end with the uninterrupted run's
    weights, bit for bit."""
    from test_checkpoints import assert_bitwise_equal, final_weights
    from test_faults import finish, kill_worker, launch, logged_steps, wait_for

    uninterrupted, settings, _ = trained_lm
    launcher = launch([*settings, "train.log_every=1", f"run.output_dir={tmp_path}"])
    wait_for(lambda: logged_steps(tmp_path) >= 12, launcher, "step 12")
    kill_worker(launcher, 1)
    output = finish(launcher)
    assert launcher.returncode == 0, output
    assert output.count("resumed from") == 1, output
    assert re.search(r"resumed from \S+: step (10|20)\n", output), output
    run_dir = only_run_dir(tmp_path)
    assert_bitwise_equal(final_weights(run_dir), final_weights(uninterrupted))
    assert [r["step"] for r in records(run_dir / "train_log.jsonl")] == list(range(1, 31))


@pytest.mark.slow
def test_a_stop_in_the_validation_at_the_end_of_a_run_by_steps_is_validated_again(trained_lm,
                                                                                   tmp_path):
    """SIGTERM inside the run's only validation, after its last step: the command the run
    prints validates, and the records end as the uninterrupted run's."""
    from test_faults import epoch_records
    from test_same_command import (
        final_validation_state,
        run_printed,
        stopped_in_last_validation,
        summary_without_timings,
    )

    uninterrupted, settings, _ = trained_lm
    run_dir, printed = stopped_in_last_validation(
        tmp_path, ["./run.sh", "tests/preempt_in_validation.py", *settings,
                   f"run.output_dir={tmp_path}"], 1, NPROC_PER_NODE="2")
    assert not (run_dir / "metrics.jsonl").exists()
    again = run_printed(printed)
    assert again.returncode == 0, again.stdout
    assert epoch_records(run_dir) == epoch_records(uninterrupted)  # but for *_seconds
    assert summary_without_timings(run_dir) == summary_without_timings(uninterrupted)
    # The checkpoint of step 30, saved again, holds the validation's outcome (the uninterrupted
    # run's was saved at step 30 by train.ckpt_every, before its validation).
    state = final_validation_state(run_dir)
    assert state["best"]["checkpoint"] == "step-00000030" and state["interrupted_at_end"] == -1


@pytest.mark.slow
def test_resumed_at_3_processes_under_fsdp_the_gpt_trains_on_the_same_windows(trained_lm,
                                                                             tmp_path):
    """The DDP run resumed from its checkpoint of step 10 at 3 processes, its blocks sharded by
    FSDP2 (the checkpoint resharded by DCP): the same global batches (each rank draws its share
    of each step's windows), so the same losses as at 2 processes, but for the order in which a
    gradient's sum adds its terms."""
    uninterrupted, settings, _ = trained_lm
    copy = tmp_path / "run"
    shutil.copytree(uninterrupted, copy)
    for later in list_checkpoints(copy / "checkpoints")[1:]:
        shutil.rmtree(later)
    (copy / MODEL_FILE).unlink()
    resumed = run(["./run.sh", *settings, "parallel.strategy=fsdp", f"run.dir={copy}"],
                  NPROC_PER_NODE="3")
    assert resumed.returncode == 0, resumed.stdout
    assert "world 2 -> 3 at step 10" in resumed.stdout
    assert "parallel.strategy ddp -> fsdp" in resumed.stdout
    at_2, at_3 = ({r["step"]: r["loss"] for r in records(folder / "train_log.jsonl")}
                  for folder in (uninterrupted, copy))
    assert at_3.keys() == at_2.keys() == {1, 5, 10, 15, 20, 25, 30}
    # Steps 11 to 15 (from the same weights): the same windows give the same mean loss; other
    # windows would differ in the third digit, as the next window's does.
    assert at_3[15] == pytest.approx(at_2[15], rel=1e-5)
    assert abs(at_2[20] - at_2[15]) > 1e-3
    # Later, Adam's steps grow the sums' rounding apart (by about 0.2% at step 30).
    assert [at_3[step] for step in (20, 25, 30)] == pytest.approx(
        [at_2[step] for step in (20, 25, 30)], rel=0.01)


@pytest.mark.slow
def test_check_equivalence_passes_for_the_gpt(trained_lm, tmp_path):
    """2 processes train the built-in GPT like one process: losses and final weights agree."""
    root = next(s for s in trained_lm[1] if s.startswith("data.root="))
    checked = run([sys.executable, "check_equivalence.py", "--workdir", str(tmp_path),
                   "data.dataset=tokens", root, "data.block_size=32", "model.name=gpt",
                   "model.hidden_dim=64", "model.num_layers=2", "optim.lr=0.001",
                   "optim.warmup_steps=3", "--steps", "8"])
    assert checked.returncode == 0, checked.stdout
    assert "PASS: 2 process(es) x 1 accumulation step(s) train like 1 process (losses within " \
           "1e-05 relative for 8 steps)" in checked.stdout


@pytest.mark.slow
def test_sample_py_continues_a_prompt_with_a_hugging_face_model_folder(tmp_path):
    """A causal LM and its tokenizer saved in one folder (nothing downloaded): sample.py writes
    the continuation the model's own greedy choice gives; a folder without a tokenizer is one
    line."""
    needs_extra("transformers")
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "hf"
    words = word_tokenizer(folder)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=words.get_vocab_size(), n_positions=32,
                                       n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                       eos_token_id=0)).eval()
    model.save_pretrained(folder)
    prompt = AutoTokenizer.from_pretrained(folder)("the quick brown", add_special_tokens=False)
    greedy = generate(model, torch.tensor([prompt["input_ids"]]), 6, 32, temperature=0)
    expected = AutoTokenizer.from_pretrained(folder).decode(greedy[0].tolist())
    sampled = run([sys.executable, "sample.py", str(folder), "--prompt", "the quick brown",
                   "--tokens", "6", "--temperature", "0"])
    assert sampled.returncode == 0, sampled.stdout
    assert sampled.stdout.splitlines()[-2:] == [expected, "-" * 40]  # (after transformers' bars)
    assert expected.startswith("the quick brown ") and len(expected.split()) == 3 + 6
    (folder / "tokenizer_config.json").unlink()
    untokenized = run([sys.executable, "sample.py", str(folder)])
    assert (untokenized.returncode, untokenized.stdout) == (
        2, f"error: {folder} holds a model but no tokenizer: save the model's tokenizer to the "
           "same folder (tokenizer.save_pretrained)\n")


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_weights_under_ddp_and_fsdp(trained_lm,
                                                                             tmp_path):
    """speed.activation_checkpointing: the run of 2 processes under DDP with every block
    recomputed ends with the weights of the run without it, bit for bit; under FSDP2, 1 block
    in 2 recomputed, with those of FSDP2 without it."""
    from test_checkpoints import assert_bitwise_equal, final_weights

    plain, settings, _ = trained_lm
    runs, outputs = {}, {}
    for name, extra in {"ddp-checkpointed": ["speed.activation_checkpointing=1"],
                        "fsdp": ["parallel.strategy=fsdp"],
                        "fsdp-checkpointed": ["parallel.strategy=fsdp",
                                              "speed.activation_checkpointing=2"]}.items():
        result = run(["./run.sh", *settings, *extra, f"run.output_dir={tmp_path / name}"],
                     NPROC_PER_NODE="2")
        assert result.returncode == 0, result.stdout
        runs[name], outputs[name] = only_run_dir(tmp_path / name), result.stdout
    assert "activation checkpointing of every block" in outputs["ddp-checkpointed"]
    assert "activation checkpointing of 1 block in 2" in outputs["fsdp-checkpointed"]
    assert_bitwise_equal(final_weights(runs["ddp-checkpointed"]), final_weights(plain))
    assert_bitwise_equal(final_weights(runs["fsdp-checkpointed"]), final_weights(runs["fsdp"]))


@pytest.mark.slow
def test_compiled_blocks_train_to_the_same_losses(trained_lm, tmp_path):
    """speed.compile=blocks: each block's forward compiled (one graph for both), the rest eager;
    the losses those of the eager run but for the compiled kernels' rounding, which this run's
    rate (0.003) grows after step 20 (as in the resume at 3 processes): measured up to 1%."""
    eager, settings, _ = trained_lm
    result = run(["./run.sh", *settings, "speed.compile=blocks",
                  f"run.output_dir={tmp_path}"], NPROC_PER_NODE="2", timeout=600)
    assert result.returncode == 0, result.stdout
    assert "precision fp32, torch.compile of each block (default) |" in result.stdout
    assert re.search(r"torch.compile: [\d.]+ s spent compiling \(rank 0\)", result.stdout)
    compiled = {r["step"]: r["loss"] for r in records(only_run_dir(tmp_path) / "train_log.jsonl")}
    losses = {r["step"]: r["loss"] for r in records(eager / "train_log.jsonl")}
    assert compiled.keys() == losses.keys()
    for step, loss in losses.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-4 if step <= 15 else 0.03), step
