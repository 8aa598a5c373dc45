"""Token data: a language model's text as binary token files, and the splits the engine reads.

A token folder holds one file per split and a small metadata file:

    train.bin, val.bin, test.bin   the split's tokens one after another, no header: uint16 for
                                   a vocabulary of up to 65,536 tokens, else uint32 (the
                                   machine's byte order, as numpy's tofile writes them)
    meta.json                      {"vocab_size": V, "dtype": "uint16" or "uint32",
                                    "tokens": {"train": N, "val": N, "test": N},
                                    "tokenizer": "characters" or the tokenizer folder,
                                    "characters": the vocabulary of character data, ...}

Each is checked before use: meta.json against the files (a file's size is its token count
times the dtype's bytes; character data has one character per id) and every id against the
vocabulary (whole for files up to SCAN_LIMIT tokens, else each window as it is read). A
training run's checkpoints record the folder's fingerprint (meta.json, the files' sizes and
sampled parts of them), and a resume on a folder written again since is refused.

Write one from text files with `python -m ddpkit.tokens TEXT... --out FOLDER`: character by
character (no download), or with a Hugging Face tokenizer saved in a folder (`--tokenizer DIR`,
the `transformers` extra). The folder appears whole or not at all (writes.write_whole), one
preparation at a time (a lock beside it); a stop or a failure leaves nothing half written.
`data.dataset=tokens` reads the folder at data.root; left empty, the built-in example: the
project's own docs, character by character, written on first use.

The files are memory-mapped: a process reads only the windows it uses. Training draws windows
of data.block_size + 1 tokens with replacement (`TokenWindows`, a streams.SampledStream): where
the window at each position of the plan starts is a pure function of (run.seed, epoch,
position), so memory does not grow with the corpus and the global batches, and a resume, are
the same at any process count. An epoch is as many windows as the split holds side by side.
Evaluation cuts a split into consecutive windows (`TokenBlocks`), each scored once.
"""

import argparse
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from ddpkit.config import PROJECT_DIR, UserError
from ddpkit.splits import Splits
from ddpkit.streams import DataError, SampledStream
from ddpkit.writes import remove_leftovers, write_whole, writing_alone

SPLITS = ("train", "val", "test")
META_FILE = "meta.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
DEFAULT_BLOCK = 128  # data.block_size when the config has none
DRAW_BLOCK = 1024  # positions drawn from one generator: a draw's cost and memory
ESTIMATE_KEY = 2**63  # in place of the epoch: an estimate's draws differ from training's
SCAN_LIMIT = 2**28  # token files up to this many tokens are checked whole at start-up
FINGERPRINT_PARTS = 16  # parts of each file a fingerprint reads, spread over it
FINGERPRINT_PART = 2**16  # bytes of each part
PREPARE = "python -m ddpkit.tokens"


# --- reading -------------------------------------------------------------------------------------

class TokenFile:
    """One split's token file, memory-mapped on first use in each process (a loader worker
    maps it itself: the map is not pickled). A file whose size is not the token count meta.json
    gives (`count`), or without one not a whole number of tokens, or a token at or above the
    vocabulary, is a DataError naming the file."""

    def __init__(self, path: Path, dtype: str, vocab_size: int, fix: str,
                 count: int | None = None):
        self.path, self.vocab_size, self.fix = path, vocab_size, fix
        self.dtype = np.dtype(DTYPES[dtype])
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{path} is missing: {fix}") from None
        if count is not None and size != count * self.dtype.itemsize:
            written_as = [name for name, kind in DTYPES.items()
                          if count and size == count * np.dtype(kind).itemsize]
            why = (f"its tokens are {written_as[0]}" if written_as
                   else "it does not belong with that meta.json")
            raise DataError(f"{path} is {size} bytes, not the {count} {dtype} tokens "
                            f"({count * self.dtype.itemsize} bytes) its meta.json gives ({why}): "
                            f"{fix}")
        if size % self.dtype.itemsize:
            raise DataError(f"{path} is {size} bytes, not a whole number of {dtype} tokens "
                            f"({self.dtype.itemsize} bytes each): {fix}")
        self.length = size // self.dtype.itemsize
        self._tokens = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [len(starts), length]: the tokens from each start on."""
        rows = self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)
        if rows.size and rows.max() >= self.vocab_size:
            self._refuse(int(rows.max()))
        return rows

    def check_vocabulary(self) -> None:
        """Every token below the vocabulary size: read whole, a chunk at a time, for files up to
        SCAN_LIMIT tokens (larger ones are checked window by window as they are read)."""
        if self.length > SCAN_LIMIT:
            return
        for first in range(0, self.length, 2**24):
            largest = int(self.tokens[first:first + 2**24].max())
            if largest >= self.vocab_size:
                self._refuse(largest)

    def _refuse(self, token: int):
        raise DataError(f"{self.path} holds the token id {token}, at or above the vocabulary "
                        f"size {self.vocab_size} of its meta.json: {self.fix}")


def window_starts(seed: int, epoch: int | None, first: int, end: int, count: int) -> np.ndarray:
    """Where the windows at positions first .. end - 1 of an epoch start, each in 0 .. count - 1:
    every block of DRAW_BLOCK positions is drawn by its own generator, seeded by (seed, epoch,
    block), so a position's draw does not depend on which positions are asked for with it."""
    key = ESTIMATE_KEY if epoch is None else epoch
    parts = []
    for block in range(first // DRAW_BLOCK, (end - 1) // DRAW_BLOCK + 1):
        base = block * DRAW_BLOCK
        draws = np.random.default_rng([seed, key, block]).integers(count, size=DRAW_BLOCK)
        parts.append(draws[max(first, base) - base:min(end, base + DRAW_BLOCK) - base])
    return np.concatenate(parts)


def as_pairs(windows: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of each window: its first `block` tokens and the `block` after the
    first (each target is the token that follows its input)."""
    rows = torch.from_numpy(windows)
    return [(row[:-1], row[1:]) for row in rows]


class TokenWindows(SampledStream):
    """A training split: windows of `block` + 1 tokens drawn with replacement (the module's
    docstring). Its length, the positions of an epoch, is the windows the split holds side by
    side."""

    def __init__(self, file: TokenFile, block: int):
        super().__init__((file.length - 1) // block)
        self.file, self.block = file, block

    def draw(self, seed: int, epoch: int | None, first: int, end: int) -> list:
        starts = window_starts(seed, epoch, first, end, self.file.length - self.block)
        return as_pairs(self.file.windows(starts, self.block + 1))


class TokenBlocks(Dataset):
    """An evaluated split: consecutive windows of `block` + 1 tokens, window i starting at token
    i x block (its targets are the next window's inputs), so every token but the split's first
    and its last partial window's is predicted exactly once. A list of indices reads a batch at
    once (batch_indexing)."""

    batch_indexing = True

    def __init__(self, file: TokenFile, block: int):
        self.file, self.block = file, block

    def __len__(self) -> int:
        return (self.file.length - 1) // self.block

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            inputs, targets = self[[int(index)]]
            return inputs[0], targets[0]
        windows = self.file.windows(np.asarray(index, dtype=np.int64) * self.block,
                                    self.block + 1)
        rows = torch.from_numpy(windows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (pinned and copied whole)


def read_meta(root: Path, fix: str) -> dict:
    """meta.json of a token folder, checked: a vocabulary size and a dtype that holds it, and
    what it says of the tokens (meta_agrees)."""
    path = root / META_FILE
    if not path.is_file():
        raise UserError(f"data.root={root} has no {META_FILE}: point data.root at a folder "
                        f"written by `{PREPARE}`")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path} is not valid JSON ({' '.join(str(error).split())}): {fix}"
                        ) from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if type(vocab) is not int or vocab < 2 or dtype not in DTYPES:
        raise DataError(f"{path} gives no vocab_size (a whole number, at least 2) and dtype "
                        f"(uint16 or uint32): {fix}")
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise DataError(f"{path}: a vocabulary of {vocab} tokens does not fit {dtype}: {fix}")
    meta_agrees(meta, path, fix)
    return meta


def meta_agrees(meta: dict, path: Path, fix: str) -> None:
    """What meta.json says beside the vocabulary size, where it says it: a token count per
    split, one character per id of character data, one length per id of a tokenizer's."""
    vocab, counts = meta["vocab_size"], meta.get("tokens")
    if counts is not None and not (isinstance(counts, dict) and all(
            type(counts.get(split)) is int and counts[split] >= 0 for split in SPLITS)):
        raise DataError(f"{path}: its tokens entry ({counts!r}) is not a count for each split "
                        f"({', '.join(SPLITS)}): {fix}")
    if meta.get("tokenizer") == "characters":
        characters = meta.get("characters")
        if not isinstance(characters, str) or len(set(characters)) != len(characters):
            raise DataError(f"{path} gives character data without its characters, each once: "
                            f"{fix}")
        if len(characters) != vocab:
            raise DataError(f"{path} gives a vocab_size of {vocab} and {len(characters)} "
                            f"characters, one per token id: {fix}")
    lengths = meta.get("token_characters")
    if lengths is not None and (not isinstance(lengths, list) or len(lengths) != vocab):
        raise DataError(f"{path}: its token_characters are not one length per token id (its "
                        f"vocab_size is {vocab}): {fix}")


def fingerprint(root: Path) -> str:
    """What a checkpoint records of a token folder (the training split's fingerprint(), read by
    data.DataFingerprint): meta.json's entries, each file's size, and FINGERPRINT_PARTS parts of
    each file spread evenly over it (a small file whole). A folder written again, with other
    text or other ids, gives another; reading it costs the same at any corpus size."""
    meta = json.loads((root / META_FILE).read_text())
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for split in SPLITS:
        path = root / f"{split}.bin"
        size = path.stat().st_size
        digest.update(f"{split} {size}".encode())
        last = max(size - FINGERPRINT_PART, 0)
        starts = (range(0, size, FINGERPRINT_PART) if size <= FINGERPRINT_PARTS * FINGERPRINT_PART
                  else [last * part // (FINGERPRINT_PARTS - 1)
                        for part in range(FINGERPRINT_PARTS)])
        with open(path, "rb") as handle:
            for start in starts:
                handle.seek(start)
                digest.update(handle.read(FINGERPRINT_PART))
    return digest.hexdigest()


def token_characters(meta: dict) -> torch.Tensor | None:
    """The characters each token id stands for (bits per character): 1 each for character
    data, the decoded lengths a tokenizer's preparation wrote, or None."""
    if meta.get("tokenizer") == "characters":
        return torch.ones(meta["vocab_size"], dtype=torch.float64)
    lengths = meta.get("token_characters")
    return torch.tensor(lengths, dtype=torch.float64) if lengths else None


def tokens(cfg: DictConfig) -> Splits:
    """The splits of the token folder at data.root (the module's docstring); data.root empty:
    the built-in example, written from the project's docs on first use."""
    root = Path(cfg.root) if cfg.root else PROJECT_DIR / "data" / "tokens-example"
    if not cfg.root and not (root / META_FILE).is_file():
        write_example(root)
    fix = (f"delete the folder {root} and the next run writes it anew" if not cfg.root
           else f"write it again with `{PREPARE}`")
    meta = read_meta(root, fix)
    block = int(cfg.get("block_size") or DEFAULT_BLOCK)
    files = {}
    for split in SPLITS:
        files[split] = TokenFile(root / f"{split}.bin", meta["dtype"], meta["vocab_size"], fix,
                                 (meta.get("tokens") or {}).get(split))
        if files[split].length - 1 < block:
            raise UserError(f"data.block_size={block} is larger than the {split} split of "
                            f"{root} ({files[split].length} tokens, one more than a window's "
                            "inputs needed): lower data.block_size, or give that split more text")
        files[split].check_vocabulary()
    train = TokenWindows(files["train"], block)
    train.token_characters = token_characters(meta)  # read by the next-token task
    train.meta = meta  # read by sample.py (Vocabulary)
    train.fingerprint = functools.partial(fingerprint, root)  # recorded by checkpoints
    train.val_windows = TokenWindows(files["val"], block)  # sampled estimates (estimates.py)
    return Splits(train, TokenBlocks(files["val"], block), TokenBlocks(files["test"], block),
                  task="next_token", num_classes=meta["vocab_size"])


class Vocabulary:
    """Text to token ids and back, as a token folder's meta.json says: one id per character of
    its `characters`, or its tokenizer (a saved Hugging Face tokenizer's folder)."""

    def __init__(self, meta: dict):
        self.characters = meta.get("characters") if meta.get("tokenizer") == "characters" else None
        self.tokenizer = None
        if self.characters is None:
            folder = meta.get("tokenizer") or ""
            if not Path(folder, "tokenizer_config.json").is_file():
                raise UserError(f"the token data's meta.json names no saved tokenizer "
                                f"(tokenizer: {folder!r}) and no characters: write it with "
                                f"`{PREPARE}`, or save the tokenizer to that folder again")
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        unknown = sorted(set(text) - set(self.characters))
        if unknown:
            raise UserError(f"the prompt holds {''.join(unknown)!r}, which the vocabulary of "
                            "the token data lacks: leave those characters out")
        return [self.characters.index(character) for character in text]

    @property
    def size(self) -> int:
        """The token ids it decodes: 0 .. size - 1."""
        return len(self.tokenizer) if self.tokenizer is not None else len(self.characters)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(self.characters[token] for token in ids)


# --- writing -------------------------------------------------------------------------------------

def read_text(sources: list[Path]) -> str:
    """The text of the given files and folders (a folder: its .txt and .md files, in sorted
    order, at any depth), joined in the order given."""
    files = []
    for source in sources:
        if source.is_dir():
            files += sorted(p for p in source.rglob("*") if p.suffix in (".txt", ".md")
                            and p.is_file())
        elif source.is_file():
            files.append(source)
        else:
            raise UserError(f"{source} is neither a file nor a folder: name the text to prepare")
    try:
        text = "\n".join(path.read_text(encoding="utf-8") for path in files)
    except UnicodeDecodeError as error:
        raise UserError(f"a text file is not UTF-8 ({error.reason}): convert it, or leave it "
                        "out") from None
    if not text:
        raise UserError(f"{', '.join(map(str, sources))}: no text found (.txt or .md files)")
    return text


def split_text(text: str, val_fraction: float, test_fraction: float) -> dict[str, str]:
    """train, val and test as consecutive parts of the text, in that order."""
    val_start = round(len(text) * (1 - val_fraction - test_fraction))
    test_start = round(len(text) * (1 - test_fraction))
    return {"train": text[:val_start], "val": text[val_start:test_start],
            "test": text[test_start:]}


def character_encoder(text: str):
    """Character data: the vocabulary is every character of the text, sorted; a function
    encoding a text with it, and the meta.json entries that describe it."""
    codes = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32))
    if len(codes) < 2:
        raise UserError(f"the text is one character ({chr(codes[0])!r}) over and over: a "
                        "language model needs a vocabulary of 2 or more, give it more text")

    def encode(part: str) -> np.ndarray:
        return np.searchsorted(codes, np.frombuffer(part.encode("utf-32-le"), dtype=np.uint32))

    characters = "".join(map(chr, codes.tolist()))
    return encode, {"tokenizer": "characters", "vocab_size": len(codes),
                    "characters": characters}


def tokenizer_encoder(folder: str):
    """A Hugging Face tokenizer saved in `folder` (nothing is downloaded): an encoding
    function and the meta.json entries that describe it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("--tokenizer needs the transformers extra: pip install -e "
                        "'.[transformers]'") from None
    if not Path(folder, "tokenizer_config.json").is_file():
        raise UserError(f"--tokenizer {folder} is not a saved tokenizer (no "
                        "tokenizer_config.json): save one with tokenizer.save_pretrained")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = sys.maxsize  # a whole file is one text: no length warning

    def encode(part: str) -> np.ndarray:
        return np.asarray(tokenizer(part, add_special_tokens=False)["input_ids"], np.int64)

    vocab = len(tokenizer)
    lengths = [len(tokenizer.decode([token])) for token in range(vocab)]
    return encode, {"tokenizer": str(Path(folder).resolve()), "vocab_size": vocab,
                    "token_characters": lengths}


def prepare(sources: list[Path], out: Path, tokenizer: str = "", val_fraction: float = 0.1,
            test_fraction: float = 0.1) -> dict:
    """Write the new token folder `out` from text files (the module's docstring); returns its
    meta.json. A folder `out` that exists, or that another preparation is writing, is one
    line."""
    if min(val_fraction, test_fraction) <= 0 or val_fraction + test_fraction >= 1:
        raise UserError("--val-fraction and --test-fraction must be above 0, with a sum below 1")
    with writing_alone(out):
        if os.path.lexists(out):
            raise UserError(f"--out {out} exists: choose a new folder, or delete that one")
        return write_tokens(sources, out, tokenizer, val_fraction, test_fraction)


def write_tokens(sources: list[Path], out: Path, tokenizer: str = "", val_fraction: float = 0.1,
                 test_fraction: float = 0.1) -> dict:
    """prepare's work, under its lock: what a killed preparation of `out` left is removed, and
    the folder written whole (writes.write_whole)."""
    remove_leftovers(out)
    text = read_text(sources)
    encode, meta = tokenizer_encoder(tokenizer) if tokenizer else character_encoder(text)
    dtype = "uint16" if meta["vocab_size"] <= 2**16 else "uint32"
    parts = {split: encode(part).astype(DTYPES[dtype])
             for split, part in split_text(text, val_fraction, test_fraction).items()}
    meta.update(dtype=dtype, tokens={split: len(part) for split, part in parts.items()})

    def write(folder: Path) -> None:
        for split, part in parts.items():
            with open(folder / f"{split}.bin", "wb") as handle:  # (numpy's tofile: no errno)
                handle.write(part.data)
        (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")

    write_whole(out, write, folder=True, exists="refuse",
                needed=sum(part.nbytes for part in parts.values()),
                advice="free space there, or write the folder to a larger disk")
    return meta


def write_example(root: Path) -> None:
    """The built-in example: the project's README and docs, character by character. Ranks that
    start at once: the first writes it, the others wait for it."""
    sources = [path for path in (PROJECT_DIR / "README.md", PROJECT_DIR / "docs") if path.exists()]
    if not sources:
        raise UserError("data.dataset=tokens with data.root empty reads the project's README.md "
                        f"and docs/, which are gone: set data.root to a folder written by "
                        f"`{PREPARE}`")
    with writing_alone(root, wait=True):
        if not (root / META_FILE).is_file():
            write_tokens(sources, root)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog=PREPARE, description="Write a token folder (train.bin, val.bin, test.bin, "
        "meta.json) from text files, for data.dataset=tokens data.root=OUT.")
    parser.add_argument("text", nargs="+", type=Path, help="text files, or folders of .txt "
                        "and .md files")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (new)")
    parser.add_argument("--tokenizer", default="", help="a Hugging Face tokenizer's folder; "
                        "default: one token per character")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    if os.path.lexists(args.out):  # (said before the text is read; prepare checks it again)
        raise UserError(f"--out {args.out} exists: choose a new folder, or delete that one")
    meta = prepare(args.text, args.out, args.tokenizer, args.val_fraction, args.test_fraction)
    counts = ", ".join(f"{split} {count:,}" for split, count in meta["tokens"].items())
    print(f"wrote {args.out}: {meta['vocab_size']:,} tokens in the vocabulary "
          f"({'characters' if meta['tokenizer'] == 'characters' else 'tokenizer'}), "
          f"{meta['dtype']}; tokens per split: {counts}")


if __name__ == "__main__":
    from ddpkit import lifecycle

    lifecycle.run_main(main, one_shot=True)
