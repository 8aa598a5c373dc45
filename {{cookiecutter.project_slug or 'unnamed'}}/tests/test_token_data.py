"""Token folders checked before use (ddpkit/tokens.py): meta.json against its files, a folder
written again in place refused on resume (its fingerprint), the preparation's lock, leftovers,
permissions and failed writes, and sample.py's checks of its numbers and of the vocabulary."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from conftest import run
from ddpkit import checkpoint, recipes
from ddpkit import tokens as tokens_module
from ddpkit.config import UserError, load_config
from ddpkit.lm import build_gpt, generate
from ddpkit.parallel import build_model
from ddpkit.streams import DataError
from ddpkit.tokens import PREPARE, fingerprint, prepare, tokens

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))
FIX = f"write it again with `{PREPARE}`"


def prepared(folder: Path, text: str = TEXT) -> Path:
    source = folder.with_name(f"{folder.name}.txt")
    source.write_text(text)
    prepare([source], folder)
    return folder


def data_config(folder: Path, *extra: str):
    return load_config(["data.dataset=tokens", f"data.root={folder}", "data.block_size=8",
                        "model.name=gpt", *extra]).data


def edit_meta(folder: Path, **changes) -> dict:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))
    return meta


# --- meta.json against the files ---------------------------------------------------------------

@pytest.mark.parametrize("case", ["uint32 files", "counts", "vocabulary", "one character"])
def test_a_folder_whose_meta_json_disagrees_with_its_files_is_one_line(tmp_path, case):
    folder = prepared(tmp_path / "tokens")
    meta = json.loads((folder / "meta.json").read_text())
    train, val = folder / "train.bin", folder / "val.bin"
    count = meta["tokens"]["train"]
    if case == "uint32 files":  # the ids are right, written 4 bytes each under uint16
        np.fromfile(train, dtype=np.uint16).astype(np.uint32).tofile(train)
        expected = (f"{train} is {4 * count} bytes, not the {count} uint16 tokens "
                    f"({2 * count} bytes) its meta.json gives (its tokens are uint32): {FIX}")
    elif case == "counts":
        edit_meta(folder, tokens={**meta["tokens"], "val": meta["tokens"]["val"] + 3})
        written = meta["tokens"]["val"]
        expected = (f"{val} is {2 * written} bytes, not the {written + 3} uint16 tokens "
                    f"({2 * written + 6} bytes) its meta.json gives (it does not belong with "
                    f"that meta.json): {FIX}")
    elif case == "vocabulary":
        edit_meta(folder, vocab_size=meta["vocab_size"] + 5)
        expected = (f"{folder / 'meta.json'} gives a vocab_size of {meta['vocab_size'] + 5} "
                    f"and {meta['vocab_size']} characters, one per token id: {FIX}")
    else:
        with pytest.raises(UserError) as error:
            prepared(tmp_path / "one", "aaaa")
        assert str(error.value) == ("the text is one character ('a') over and over: a language "
                                    "model needs a vocabulary of 2 or more, give it more text")
        assert not (tmp_path / "one").exists()
        return
    with pytest.raises(DataError) as error:
        tokens(data_config(folder))
    assert str(error.value) == expected


def test_the_fingerprint_sees_a_folder_written_again_and_reads_a_bounded_part(tmp_path,
                                                                             monkeypatch):
    folder = prepared(tmp_path / "tokens")
    first = fingerprint(folder)
    assert fingerprint(folder) == first == tokens(data_config(folder)).train.fingerprint()
    train = folder / "train.bin"
    ids = np.fromfile(train, dtype=np.uint16)
    ((ids + 1) % len(set(TEXT))).astype(np.uint16).tofile(train)  # same sizes, shifted ids
    assert fingerprint(folder) != first
    # A big file: 16 parts of 64 KiB are read, not the whole file (a sparse 1 GiB one).
    with open(train, "r+b") as handle:
        handle.truncate(2**30)
    reads = []

    class CountedReads(io.FileIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    monkeypatch.setattr(tokens_module, "open", CountedReads, raising=False)
    fingerprint(folder)
    assert reads == [2**16] * (16 + 1 + 1)  # train's 16 parts; val and test, small, whole


# --- the preparation -----------------------------------------------------------------------------

def test_a_folder_and_its_files_follow_the_umask(tmp_path):
    source = tmp_path / "a.txt"
    source.write_text(TEXT)
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        previous = os.umask(umask)
        try:
            prepare([source], tmp_path / f"tokens-{umask:o}")
        finally:
            os.umask(previous)
        out = tmp_path / f"tokens-{umask:o}"
        assert out.stat().st_mode & 0o777 == folder_mode
        assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {file_mode}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "tokens-22",
                                                                 "tokens-27"]  # no lock left


@contextlib.contextmanager
def mounted(folder: Path, options: str):
    """A tmpfs at `folder` with mount options (root only)."""
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_folder_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, fault):
    source = tmp_path / "a.txt"
    source.write_text(TEXT * 20)  # 65 kB of tokens
    if fault == "read-only" and os.geteuid() != 0:
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o555)
        where = contextlib.nullcontext(parent)
        reason = "Permission denied"
    elif os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    else:
        where = mounted(tmp_path / fault, "ro" if fault == "read-only" else "size=32k")
        reason = "Read-only file system" if fault == "read-only" else "No space left on device"
    with where as parent:
        with pytest.raises(UserError) as error:
            prepare([source], parent / "tokens")
        assert str(error.value).startswith(f"cannot write {parent / 'tokens'}: {reason}")
        if fault == "full":
            assert str(error.value).endswith(" MB needed); free space there, or write the "
                                             "folder to a larger disk")
        assert list(parent.iterdir()) == []


# --- resuming on a folder written again ---------------------------------------------------------

LM_RUN = ["data.dataset=tokens", "data.block_size=16", "model.name=gpt", "model.hidden_dim=16",
          "model.num_layers=1", "train.global_batch_size=4", "train.progress_bar=false",
          "train.plot_curves=false", "train.limit_val_batches=1", "optim.warmup_steps=0"]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error")]


def test_a_folder_written_again_in_place_is_not_resumed_unless_asked(tmp_path):
    folder = prepared(tmp_path / "tokens")
    settings = [*LM_RUN, f"data.root={folder}", f"run.dir={tmp_path / 'run'}"]
    trained = run([sys.executable, "train.py", *settings, "train.max_steps=2"])
    assert trained.returncode == 0, trained.stdout
    train = folder / "train.bin"  # the same sizes and vocabulary, other ids
    ((np.fromfile(train, dtype=np.uint16) + 1) % len(set(TEXT))).astype(np.uint16).tofile(train)
    refused = run([sys.executable, "train.py", *settings, "train.max_steps=3"])
    assert refused.returncode == 2, refused.stdout
    assert error_lines(refused.stdout) == [
        f"error: the data in data.root={folder} changed since the checkpoint was written (its "
        "fingerprint differs: written again in place?): put that data back, or set "
        "data.resume_changed=true to resume on it as it is now"], refused.stdout
    assert "Traceback" not in refused.stdout
    resumed = run([sys.executable, "train.py", *settings, "train.max_steps=3",
                   "data.resume_changed=true"])
    assert resumed.returncode == 0, resumed.stdout
    assert "resuming on it as it is now (data.resume_changed=true)" in resumed.stdout
    assert "resumed from" in resumed.stdout and ": step 2\n" in resumed.stdout


# --- sample.py -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, Path]:
    """A token folder and two untrained models of it in model.pt files: the built-in GPT, and
    one whose outputs are padded past the vocabulary (tests/fixtures.py:padded_gpt)."""
    root = tmp_path_factory.mktemp("sample")
    folder = prepared(root / "tokens")
    files = {}
    recipes.load()
    for name in ("gpt", "tests/fixtures.py:padded_gpt"):
        cfg = load_config([*LM_RUN, f"data.root={folder}", f"model.name={name}"])
        model = build_model(cfg.model, (16,), len(set(TEXT)))
        path = root / f"{name.split(':')[-1]}.pt"
        checkpoint.export_model(model.state_dict(), path, 0, cfg, "trained")
        files[name.split(":")[-1]] = path
    files["tokens"] = folder
    return files


def test_sample_py_refuses_a_model_that_predicts_ids_its_vocabulary_cannot_decode(
        model_files):
    padded = model_files["padded_gpt"]
    with pytest.raises(UserError) as error:  # (one line, exit 2, through run_main)
        sample.main([str(padded), "--tokens", "5"])
    assert str(error.value) == (
        f"the model of {padded} predicts 64 token ids, and its vocabulary decodes "
        f"{len(set(TEXT))}: sample with the token data (data.root) or the tokenizer it was "
        "trained with")


@pytest.mark.parametrize("option, value, expected", [
    ("--temperature", "inf", "give a finite number, 0 or more (0: always the likeliest token)"),
    ("--temperature", "nan", "give a finite number, 0 or more (0: always the likeliest token)"),
    ("--temperature", "-1", "give a finite number, 0 or more (0: always the likeliest token)"),
    ("--tokens", "0", "give a whole number, 1 or more"),
    ("--tokens", "1e3", "give a whole number, 1 or more"),
    ("--samples", "-2", "give a whole number, 1 or more"),
    ("--top-k", "-1", "give a whole number, 0 or more"),
    ("--seed", str(2**64), f"give a whole number, from 0 to {2**64 - 1}"),
])
def test_sample_py_numbers_are_checked_in_one_line(option, value, expected):
    with pytest.raises(UserError) as error:  # (what run_main prints in one line, exit 2)
        sample.arguments(["runs/x", option, value])
    assert str(error.value) == f"{option} {value}: {expected}"


def test_a_tiny_temperature_draws_the_likeliest_tokens():
    """Any finite temperature above 0 that sample.py takes draws (it was a NaN distribution
    below about 1e-38): a tiny one, the likeliest token each time."""
    cfg = load_config(["model.name=gpt", "model.hidden_dim=16", "model.num_layers=1"]).model
    model = build_gpt(cfg, (8,), 11).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, 6, 8, temperature=0)
    for temperature in (1e-300, 5e-324):
        assert torch.equal(generate(model, prompt, 6, 8, temperature, 3,
                                    torch.Generator().manual_seed(0)), greedy)
