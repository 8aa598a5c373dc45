"""Damaged and missing data files: one line naming the file and what is wrong with it, exit 2,
no traceback. Shards are checked at start-up (sizes and headers, not contents); a per-sample
file is named when it is read, in a loader worker or on one rank of several (ddpkit/streams.py,
ddpkit/datasets.py)."""

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run
from ddpkit.config import UserError, load_config
from ddpkit.datasets import digits_files, digits_shards, write_digits_folder, write_digits_shards
from ddpkit.splits import split_indices
from ddpkit.streams import DataError, ShardedStream, check_npy

# A short run: a damage found only when it is read shows at the validation after step 2.
SHORT = ["train.max_steps=2", "train.progress_bar=false", "train.plot_curves=false"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """The two folders the built-in datasets write, made once for the module (in-process)."""
    base = tmp_path_factory.mktemp("written")
    write_digits_shards(base / "shards", load_config([]).data)
    write_digits_folder(base / "files")
    return {"shards": base / "shards", "files": base / "files"}


@pytest.fixture
def shards(written, tmp_path) -> Path:
    return Path(shutil.copytree(written["shards"], tmp_path / "shards"))


@pytest.fixture
def files(written, tmp_path) -> Path:
    return Path(shutil.copytree(written["files"], tmp_path / "files"))


def one_line(result, line: str, code: int = 2) -> None:
    """The command ended with `code`, saying `line` once and no traceback."""
    assert result.returncode == code, result.stdout
    assert result.stdout.count("error:") == 1 and line in result.stdout.splitlines(), result.stdout
    assert "Traceback" not in result.stdout, result.stdout


def train(dataset: str, root: Path, tmp_path: Path, *extra: str):
    return run([sys.executable, "train.py", f"data.dataset={dataset}", f"data.root={root}", *SHORT,
                f"run.output_dir={tmp_path / 'runs'}", *extra])


# --- the start-up check of shards, with real runs ---------------------------------------------

# The findings: each damages a shard file and returns what the line says of it.

def emptied(path: Path) -> str:
    path.write_bytes(b"")
    return "is empty (0 bytes)"


def cut_to_half(path: Path) -> str:
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[:full // 2])
    return (f"is {full // 2} bytes, but its header (a (128, 1, 8, 8) float32 array) says {full} "
            "(cut short or damaged)")


def header_cut(path: Path) -> str:
    path.write_bytes(path.read_bytes()[:60])
    return "is not a .npy file (bad header: damaged or cut short)"


def deleted(path: Path) -> str:
    path.unlink()
    return "is missing"


DAMAGES = {"empty": ("x", emptied), "half": ("x", cut_to_half), "header cut": ("y", header_cut),
           "missing": ("x", deleted)}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_or_missing_shard_is_one_line_at_start_up(shards, tmp_path, damage):
    part, change = DAMAGES[damage]
    path = shards / f"val-00000.{part}.npy"  # read only by the validation, after training
    said = change(path)
    result = train("digits_shards", shards, tmp_path)
    one_line(result, f"error: {path} {said}: write the shards again")
    assert "run folder:" not in result.stdout  # found before the run started
    assert not any((tmp_path / "runs").glob("*"))


# --- the checks themselves, in-process ---------------------------------------------------------

def test_check_npy_reads_only_what_it_needs_and_says_what_is_wrong(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((5, 3), np.float32))
    assert check_npy(path, rows=5) == (5, 3)
    with pytest.raises(UserError, match=re.escape(f"{path} holds 5 rows where 4 are expected: "
                                                  "write it again")):
        check_npy(path, rows=4)
    path.write_bytes(b"not an array at all, but long enough to hold a header" * 3)
    with pytest.raises(UserError, match=re.escape(f"{path} is not a .npy file (bad header: "
                                                  "damaged or cut short): fix me")):
        check_npy(path, fix="fix me")
    np.save(path, np.array([{"a": 1}], dtype=object))  # an object array: its size is unknown
    assert check_npy(path) == (1,)


def test_a_stream_names_a_missing_local_shard_and_leaves_other_shards_alone(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b-00000.x.npy").write_text("")
    ShardedStream([str(tmp_path / "a.jsonl"), tmp_path / "b-00000"], list, [1, 1])  # a prefix
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'c.jsonl'} is missing: write the "
                                                  "shard again, or leave it out of the")):
        ShardedStream([str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")], list, [1, 1])
    # Not local paths: a URL, a folder that is not here, a bare name, an object: the reader's.
    ShardedStream(["s3://bucket/part-0", "elsewhere/part-0", "part-0", (0, 1)], list, [1] * 4)
    ShardedStream([str(tmp_path / "c.jsonl")], list, [1], check=False)


COUNTS = {  # counts.json as written, and what the line says of it
    '{"train": ': "is not valid JSON (Expecting value: line 1 column 11 (char 10))",
    '{"train": {"train-00000": 128}}': "gives no sample counts of the val split (an object "
                                       "of shard names and their samples)",
    '["train"]': "gives no sample counts of the train split (an object of shard names and "
                 "their samples)",
}


@pytest.mark.parametrize("text", COUNTS)
def test_a_malformed_counts_json_is_one_line(shards, text):
    (shards / "counts.json").write_text(text)
    cfg = load_config(["data.dataset=digits_shards", f"data.root={shards}"]).data
    with pytest.raises(UserError, match=re.escape(
            f"{shards / 'counts.json'} {COUNTS[text]}: write the shards again")):
        digits_shards(cfg)


def test_counts_that_do_not_match_a_shard_are_one_line(shards):
    np.save(shards / "train-00001.y.npy", np.zeros(5, np.int64))
    cfg = load_config(["data.dataset=digits_shards", f"data.root={shards}"]).data
    with pytest.raises(UserError, match=re.escape(
            f"{shards / 'train-00001.y.npy'} holds 5 rows where 128 are expected: write the "
            "shards again")):
        digits_shards(cfg)


LABELS = {  # labels.csv as written, and what the line says of it
    "file,label\n00000.npy,x\n": "line 2: the label 'x' is not a whole number from 0",
    "file,label\n00000.npy,1\n00001.npy\n": "line 3 gives no label",
    "name,lab\n00000.npy,1\n": "has the columns ['name', 'lab'], not file and label",
    "file,label\n": "lists no samples",
}


@pytest.mark.parametrize("text", LABELS)
def test_a_malformed_labels_csv_is_one_line(files, text):
    (files / "labels.csv").write_text(text)
    cfg = load_config(["data.dataset=digits_files", f"data.root={files}"]).data
    with pytest.raises(UserError, match=re.escape(
            f"{files / 'labels.csv'} {LABELS[text]}: write it again")):
        digits_files(cfg)


def test_a_sample_file_listed_but_missing_is_one_line_at_start_up(files):
    (files / "00042.npy").unlink()
    cfg = load_config(["data.dataset=digits_files", f"data.root={files}"]).data
    with pytest.raises(UserError, match=re.escape(
            f"{files / '00042.npy'} is missing (labels.csv lists it): write it again")):
        digits_files(cfg)


# --- a sample file damaged, found when it is read ----------------------------------------------

def last_val_sample(files: Path) -> Path:
    """The file of the validation split's last sample: read at the validation, by the last rank
    (each rank evaluates a contiguous block of the split)."""
    cfg = load_config(["data.dataset=digits_files", f"data.root={files}"]).data
    rows = (files / "labels.csv").read_text().splitlines()[1:]
    labels = np.array([int(row.split(",")[1]) for row in rows])
    return files / rows[split_indices(cfg, len(rows), labels)["val"][-1]].split(",")[0]


BAD_HEADER = "is not a .npy file (bad header: damaged or cut short): write it again"


def test_a_damaged_sample_read_in_a_loader_worker_is_one_line(files, tmp_path):
    sample = last_val_sample(files)
    sample.write_bytes(sample.read_bytes()[:100])
    result = train("digits_files", files, tmp_path, "data.num_workers=1",
                   "data.worker_start_method=fork")
    one_line(result, f"error: {sample} {BAD_HEADER}")


@pytest.mark.slow
def test_a_damaged_sample_read_by_one_rank_ends_the_job_at_once_in_one_line(files, tmp_path):
    # At once: not after the collective timeout the other rank waits in (a hang would outlive
    # the test's limit); and not retried (MAX_RESTARTS: the restart leaves at once).
    sample = last_val_sample(files)
    sample.write_bytes(sample.read_bytes()[:100])
    result = run(["./run.sh", "data.dataset=digits_files", f"data.root={files}", *SHORT,
                  f"run.output_dir={tmp_path / 'runs'}", "ddp.timeout_minutes=0.5"],
                 timeout=240, NPROC_PER_NODE="2", MAX_RESTARTS="1")
    one_line(result, f"error: rank 1: {sample} {BAD_HEADER}")
    assert result.stdout.count("run folder:") == 1, result.stdout  # not started again
