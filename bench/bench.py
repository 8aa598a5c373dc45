"""Benchmark: the baked project's train.py against a hand-written DDP loop (and Lightning).

    bash bench/run.sh                       # set up, then everything below with the defaults
    python bench/bench.py --pairs 7 --workloads tiny,cnn,tiny-1proc

It bakes the template with its default answers, then for each workload runs the contenders
one after another in rounds (A B C, A B C, ...: a warm-up round, then --pairs measured ones):

  template     the baked train.py with its defaults (validation with exact metrics each epoch,
               checkpoints, logs, TensorBoard)
  handwritten  bench/handwritten.py: the loop a user writes from the seed blog post
  lightning    bench/lightning_loop.py, when pytorch_lightning is installed

Workloads: `tiny` (the default digits MLP, where per-step overhead dominates) and `cnn` (a small
CNN on synthetic 3x32x32 images, where compute dominates), each under `torchrun
--nproc_per_node=2`, timed per epoch (training and validation); and `tiny-1proc`: one plain
process without DDP, the hand-written loop given the template's data path and fused AdamW
(--matched), timed per training step, which isolates the trainer's own cost per step.

`stream` and `stream-small` pit the template against itself instead: the digits read as a
stream of shard files (data.dataset=digits_shards, 2 loader workers per rank) against the same
split in memory, map-style (data.dataset=digits, read in the training process), at 2 processes,
same model, global batch and steps, without augmentation (digits has none); the ratio is of the
training samples/s the template logs (streamed / map-style, above 1: faster). A third contender,
`streamed-in-loop`, reads the shards in the training process (data.num_workers=0). `stream` uses
a wide MLP, whose step takes far longer than reading a batch; `stream-small` the default MLP.
bench/stream_wait.py measures how long the loop waits for each streamed batch.

`gpt` is a nanoGPT-class language model (bench/gpt.py: 12.2M parameters, a corpus of 4M tokens
generated on the spot, every offset a training sample), given to the baked train.py through its
extension points (model.name, data.dataset and task.name as path/file.py:name) with its defaults
otherwise, against nanoGPT's own loop in handwritten.py (`--workload gpt`: random windows per
rank, validation and a torch.save checkpoint on rank 0), 8 optimizer steps under torchrun
--nproc_per_node=2: where start-up and memory show.

`lm` is the template's language-model recipe (docs/recipes/language-model.md; the bake's docs as
character tokens) against a nanoGPT-style loop of the same model, data, optimizer and schedule
(bench/handwritten_lm.py). Each round has its own seed (run.seed, --seed); both sides are timed
per step after their first logging window and compared by the mean training loss of each
logging window at the same steps.

`switches`: lm's template side (40 steps) against itself, `off` (the recipe as is) against each
switch of issue 46 alone (SWITCHES: speed.activation_checkpointing=1, speed.compile=blocks,
train.ema_decay=0.999, guard.enabled=true); seconds per step after the first logging window, on
/ off. Compiling falls in the first step (results.md: its seconds; any run that compiled later).
`tiny-switches`: `ema` and `guard` on the digits MLP (no repeated blocks), timed as tiny.

Per run: the median time (the first epoch left out; lm, switches: their steps after the first
logging window), the final training loss (lm: of the last logging window), and for every
workload, recorded the same way for every contender by bench/peak.py (each training process is
its child; bench/probe/sitecustomize.py hooks the first optimizer step without touching the
contenders' code): the time from launch (this script starting the launcher) to the end of the
first optimizer step (the last rank's), and the peak resident memory of the largest training
process (its own ru_maxrss: torchrun's is left out). Each is compared with the base of the same
round: speed and memory as the median of the per-round ratios (contender / hand-written) with
their spread, start-up as the median of the per-round differences in seconds, since a shared
machine's slow spells hit a round's contenders alike. Writes results.json and results.md into
--out, and prints the table.
"""

import argparse
import functools
import itertools
import json
import math
import operator
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
GPT = BENCH / "gpt.py"
# The shards read by 2 loader workers per rank, the same shards read in the training process,
# the same split in memory map-style through 2 loader workers per rank, and in memory read in
# the training process (the base).
STREAM_CONTENDERS = {"streamed": ["data.dataset=digits_shards", "data.num_workers=2"],
                     "streamed-in-loop": ["data.dataset=digits_shards", "data.num_workers=0"],
                     "map-workers": ["data.dataset=digits", "data.num_workers=2"],
                     "map": ["data.dataset=digits"]}
WORKLOADS = {
    "tiny": {"overrides": [], "epochs": 40, "nproc": 2,
             "what": "digits MLP (1797 8x8 images, 64-256-256-10), global batch 64"},
    "cnn": {"overrides": ["model.name=cnn", "data.dataset=images", "data.augment=false"],
            "epochs": 5, "nproc": 2,
            "what": "3-layer CNN on 2000 synthetic 3x32x32 images, global batch 64"},
    # One plain process, no DDP, and a hand-written loop with the template's data path and
    # optimizer (--matched): what is left is the trainer's own cost per step.
    "tiny-1proc": {"overrides": [], "epochs": 40, "nproc": 1, "matched": True,
                   "what": "digits MLP, one process without DDP, training time per step"},
    # The template against itself: `contenders` names each one's overrides, `base` the one the
    # others are divided by, `key` the number compared (higher is better for samples/s).
    "stream": {"overrides": ["data.augment=false", "model.hidden_dim=1024",
                             "model.num_layers=3"],
               "epochs": 10, "nproc": 2, "key": "samples_per_second", "base": "map",
               "contenders": STREAM_CONTENDERS,
               "what": "digits shards streamed by 2 workers per rank against the digits in "
                       "memory, MLP 64-1024-1024-1024-10, global batch 64"},
    "stream-small": {"overrides": ["data.augment=false"],
                     "epochs": 20, "nproc": 2, "key": "samples_per_second", "base": "map",
                     "contenders": STREAM_CONTENDERS,
                     "what": "the same with the default MLP 64-256-256-10"},
    # A user's language model through the template's extension points, against nanoGPT's loop:
    # 8 steps, then validation and a checkpoint; timed per step (first step included).
    "gpt": {"overrides": [f"model.name={GPT}:build_gpt", f"data.dataset={GPT}:tokens",
                          f"task.name={GPT}:LanguageModel", "train.global_batch_size=16",
                          "eval.batch_size=16", "train.max_steps=8"],
            "script_args": ["--batch-size", "16", "--steps", "8"],
            "epochs": 1, "nproc": 2, "key": "seconds_per_step", "lightning": False,
            "what": "nanoGPT-class LM (6x384, context 64, vocabulary 4096: 12.2M parameters) on "
                    "4M generated tokens, global batch 16, 8 steps, then validation and a "
                    "checkpoint"},
}


def lm_workload(steps: int = 60, warmup: int = 6, log_every: int = 10, batch: int = 64) -> dict:
    """The recipe's sizes, its steps cut to keep a run under a minute on 2 cores; what neither
    side is given (weight decay, dropout, betas, eval batch) is the same by default."""
    return {
        "prepare": ["-m", "ddpkit.tokens", "docs", "README.md", "--out", "data/chars"],
        "overrides": ["data.dataset=tokens", "data.root=data/chars", "data.block_size=128",
                      "model.name=gpt", "model.hidden_dim=128", "model.num_layers=4",
                      f"train.global_batch_size={batch}", f"train.max_steps={steps}",
                      "optim.lr=0.001", f"optim.warmup_steps={warmup}", "optim.grad_clip=1.0",
                      f"train.log_every={log_every}"],
        "script": "handwritten_lm.py",
        "script_args": ["--data", "{project}/data/chars", "--steps", str(steps), "--warmup",
                        str(warmup), "--log-every", str(log_every), "--batch-size", str(batch)],
        "epochs": 1, "nproc": 2, "key": "seconds_per_step", "lightning": False, "seeded": True,
        "log_every": log_every, "global_batch": batch,
        "what": f"the language-model recipe: GPT 4x128 (0.82M parameters), context 128, on the "
                f"bake's docs as characters, global batch {batch}, {steps} steps ({warmup} "
                f"warmup, then cosine), then validation and a checkpoint"}


WORKLOADS["lm"] = lm_workload()
SWITCHES = {"activation_checkpointing": ["speed.activation_checkpointing=1"],
            "compile_blocks": ["speed.compile=blocks"], "ema": ["train.ema_decay=0.999"],
            "guard": ["guard.enabled=true"]}
WORKLOADS["switches"] = {**{k: v for k, v in lm_workload(steps=40).items() if "script" not in k},
                         "base": "off", "contenders": {"off": [], **SWITCHES}}  # lm's template
WORKLOADS["tiny-switches"] = {**WORKLOADS["tiny"], "key": "seconds_per_epoch", "base": "off",
                              "contenders": {"off": [], "ema": SWITCHES["ema"],
                                             "guard": SWITCHES["guard"]}}


def bake(where: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(REPO), no_input=True, output_dir=str(where)))


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    """The command that runs `script` on `nproc` processes (1: plain python, no torchrun), each
    under bench/peak.py, which records its peak memory and first optimizer step."""
    probed = [str(BENCH / "peak.py"), script, *args]
    if nproc == 1:
        return [sys.executable, *probed]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *probed]


class RunFailed(Exception):
    """A contender's run ended before its last epoch was recorded."""


def run_measured(command: list[str], cwd: Path, log: Path,
                 nproc: int = 2) -> tuple[float, float, float, int]:
    """Run a command (made by torchrun()) to its end; returns its launch time (unix), the end of
    its first optimizer step (unix, the last rank's; nan if none was recorded), the peak
    resident memory (MiB) of its largest training process, and its exit status. A failed run's
    log is kept in the temp folder (the bench's own goes at its end)."""
    probe = log.with_suffix(".probe.jsonl")
    # TMPDIR: the scratch folder, removed at the end, takes what torchrun leaves (its log folder)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
           "PYTHONUNBUFFERED": "1", "BENCH_PROBE_FILE": str(probe), "TMPDIR": str(log.parent)}
    with open(log, "w") as out:
        launched = time.time()
        status = subprocess.call(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if status != 0:
        kept = Path(tempfile.gettempdir()) / f"bench-failed-{log.name}"
        shutil.copyfile(log, kept)
        print(f"  {' '.join(command)} ended with exit status {status}; its output: "
              f"{kept}", flush=True)
    records = json_lines(probe) if probe.exists() else []
    first = [r["first_step"] for r in records if "first_step" in r]
    peaks = [r["peak_rss_mib"] for r in records if "peak_rss_mib" in r]
    return launched, max(first, default=math.nan), max(peaks, default=math.nan), status


def complete(epochs: list, workload: dict, status: int, log: Path) -> None:
    """A run that recorded every epoch counts even if it failed at its teardown (a peer's
    `terminate called without an active exception` after the last epoch); one that did not
    raises RunFailed (the round retries it)."""
    if len(epochs) < workload["epochs"]:
        raise RunFailed(f"{log.name}: {len(epochs)} of {workload['epochs']} epochs, exit "
                        f"status {status}")


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def summarise(epoch_seconds: list[float], step_seconds: list[float], first_step: float,
              launched: float, rss: float, loss: float, status: int, **more: float) -> dict:
    """A run's numbers; the first epoch (start-up, warm-up) is left out of the medians, unless
    it is the only one."""
    return {**more, "seconds_per_epoch": statistics.median(epoch_seconds[1:] or epoch_seconds),
            "seconds_per_step": statistics.median(step_seconds[1:] or step_seconds),
            "time_to_first_step": first_step - launched, "peak_rss_mib": rss,
            "final_loss": loss, "epoch_seconds": epoch_seconds, "exit_status": status}


def steady_seconds_per_step(records: list[dict], workload: dict) -> float:
    """The template's seconds per step over its logging windows after the first log_every steps
    (start-up left out, as the hand-written loop does): a window's samples over its samples/s."""
    timed = [(b["step"] - a["step"], b["samples_per_s"]) for a, b in itertools.pairwise(records)
             if b["step"] > workload["log_every"]]
    return sum(n * workload["global_batch"] / rate for n, rate in timed) / sum(n for n, _ in timed)


def run_template(project: Path, workload: dict, scratch: Path, tag: str, seed: int = 0,
                 name: str = "template", overrides: tuple = ()) -> dict:
    run_dir = scratch / f"{name}-{tag}"
    seeded = [f"run.seed={seed}"] if workload.get("seeded") else []
    command = torchrun("train.py", f"run.dir={run_dir}", f"train.epochs={workload['epochs']}",
                       "train.progress_bar=false", *workload["overrides"], *seeded, *overrides,
                       nproc=workload["nproc"])
    log = scratch / f"{name}-{tag}.log"
    launched, first_step, rss, status = run_measured(command, project, log, workload["nproc"])
    epochs = json_lines(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    complete(epochs, workload, status, log)
    records = json_lines(run_dir / "train_log.jsonl")
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 0}, *epochs], epochs, strict=False)]
    # The training samples/s of each logging window (all ranks together), the first (start-up)
    # left out. An epoch shorter than train.log_every steps is one window.
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    more = {"samples_per_second": statistics.median(rates or [math.nan])}
    step_seconds = [e["train_seconds"] / n for e, n in zip(epochs, steps, strict=True)]
    loss = epochs[-1]["train_loss"]
    if "log_every" in workload:  # lm: timed and its loss taken as the hand-written loop does
        step_seconds = [steady_seconds_per_step(records, workload)]
        more["window_losses"] = {str(r["step"]): r["loss"] for r in records}
        loss = records[-1]["loss"]
        # switches: rank 0's seconds compiling, and its windows after the first step that
        # compiled (left out of its throughput headline, as the start-up window is)
        found = re.search(r"torch\.compile: ([\d.]+) s spent compiling", log.read_text())
        more["compile_seconds"] = float(found[1]) if found else 0.0
        summary = json.loads((run_dir / "summary.json").read_text())
        more["compiled_after_step_1"] = summary["throughput"].get("windows_left_out", 1) - 1
    # A run by steps (lm: windows drawn for train.max_steps) has no epoch_seconds.
    seconds = [e.get("epoch_seconds", e["train_seconds"] + e["val_seconds"]) for e in epochs]
    return summarise(seconds, step_seconds, first_step, launched, rss, loss, status, **more)


def run_script(name: str, script: Path, workload_name: str, workload: dict, scratch: Path,
               tag: str, seed: int = 0, project: Path | None = None) -> dict:
    log = scratch / f"{name}-{tag}.log"
    if "script" in workload:  # a script of its own (lm): its arguments, {project} the bake
        args = [arg.format(project=project) for arg in workload["script_args"]]
    else:
        args = ["--workload", workload_name.split("-")[0], "--epochs", str(workload["epochs"]),
                *(["--matched"] if workload.get("matched") else []),
                *workload.get("script_args", ())]
    seeded = ["--seed", str(seed)] if workload.get("seeded") else []
    command = torchrun(str(script), *args, *seeded, nproc=workload["nproc"])
    launched, first, rss, status = run_measured(command, BENCH, log, workload["nproc"])
    records = json_lines(log)
    epochs = [r for r in records if "epoch" in r]
    complete(epochs, workload, status, log)
    more = {"window_losses": epochs[-1]["window_losses"]} if "window_losses" in epochs[-1] else {}
    # lm: its time per step after the first logging window, as the template's is taken
    step_seconds = [e.get("steady_seconds_per_step",
                          e.get("train_seconds", e["seconds"]) / e.get("steps", 1))
                    for e in epochs]
    return summarise([e["seconds"] for e in epochs], step_seconds, first, launched, rss,
                     epochs[-1]["loss"], status, **more)


def pairwise(runs: dict, key: str, base_name: str = "handwritten",
             compare=operator.truediv) -> dict:
    """Per round, each contender's value compared with the base's (the hand-written loop's) of
    the same round, by `compare` (a ratio; operator.sub: a difference): their median, and the
    spread (lowest, highest) across rounds. Contenders run back to back within a round, so a
    slow spell of the shared machine hits both sides alike."""
    base = [r[key] for r in runs[base_name]]
    ratios = {name: [compare(r[key], b) for r, b in zip(measured, base, strict=True)]
              for name, measured in runs.items()}
    return {name: {"median": statistics.median(values), "low": min(values), "high": max(values),
                   "rounds": values} for name, values in ratios.items()}


def compared(runs: dict, workload: dict) -> dict:
    """The workload's per-round comparisons with its base: its measure (a ratio), the peak RSS
    per training process (a ratio) and launch to first step (a difference, seconds)."""
    base = workload.get("base", "handwritten")
    return {"measure": pairwise(runs, measure_key(workload), base),
            "peak_rss": pairwise(runs, "peak_rss_mib", base),
            "first_step": pairwise(runs, "time_to_first_step", base, operator.sub)}


def have_lightning() -> bool:
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError:
        return False
    return True


def measure_key(workload: dict) -> str:
    return workload.get("key", "seconds_per_step" if workload.get("matched") else
                        "seconds_per_epoch")


UNITS = {"seconds_per_step": ("{:.4f} ms / step", 1000),
         "seconds_per_epoch": ("{:.4f} s / epoch", 1),
         "samples_per_second": ("{:.0f} samples / s", 1)}
NUMBERS = ("seconds_per_epoch", "seconds_per_step", "samples_per_second", "time_to_first_step",
           "peak_rss_mib", "final_loss", "compile_seconds")


def table(results: dict, ratios: dict) -> str:
    """One row per contender: each number is the median over rounds, each comparison with the
    base (hand-written; stream: map-style; switches: off) the median of the per-round ones,
    (lowest to highest)."""
    lines = [("| workload | contender | measure (median) | measure vs the base: per-round ratio, "
              "median (spread) | launch to first step (s) | vs the base: per-round difference "
              "(s), median (spread) | peak RSS per training process (MiB) | vs the base: "
              "per-round ratio, median (spread) | final train loss |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, by_contender in results.items():
        key = measure_key(WORKLOADS[workload])
        unit, scale = UNITS[key]
        for name, r in by_contender.items():
            measure, rss, first = (ratios[workload][part][name]
                                   for part in ("measure", "peak_rss", "first_step"))
            lines.append(
                f"| {workload} | {name} | {unit.format(r[key] * scale)} | "
                f"{measure['median']:.3f} ({measure['low']:.3f} to {measure['high']:.3f}) | "
                f"{r['time_to_first_step']:.2f} | {first['median']:+.2f} ({first['low']:+.2f} "
                f"to {first['high']:+.2f}) | {r['peak_rss_mib']:.0f} | {rss['median']:.3f} "
                f"({rss['low']:.3f} to {rss['high']:.3f}) | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def contenders_for(name: str, workload: dict, project: Path, scratch: Path) -> dict:
    if "contenders" in workload:  # the template against itself, each with its own overrides
        return {contender: functools.partial(run_template, project, workload, scratch,
                                             name=contender, overrides=tuple(overrides))
                for contender, overrides in workload["contenders"].items()}
    script = BENCH / workload.get("script", "handwritten.py")
    todo = {
        "template": functools.partial(run_template, project, workload, scratch),
        "handwritten": lambda tag, seed: run_script("handwritten", script, name, workload,
                                                    scratch, tag, seed, project),
    }
    if have_lightning() and not workload.get("matched") and workload.get("lightning", True):
        todo["lightning"] = lambda tag, seed: run_script(
            "lightning", BENCH / "lightning_loop.py", name, workload, scratch, tag, seed)
    return todo


TRIES = 3  # a run that stops before its last epoch is run again, up to this many times


def run_rounds(name: str, todo: dict, pairs: int) -> dict:
    """Round 0 warms caches up and is not measured; then the contenders alternate per round.
    A seeded workload (lm) runs round i with seed i."""
    runs = {contender: [] for contender in todo}
    for round_index in range(pairs + 1):
        for contender, run in todo.items():
            for attempt in range(1, TRIES + 1):
                print(f"{name:>10} round {round_index}/{pairs} {contender} ...", flush=True)
                try:
                    result = run(f"{name}-{round_index}-{attempt}", round_index)
                    break
                except RunFailed as failed:
                    if attempt == TRIES:
                        raise SystemExit(f"error: {contender} failed {TRIES} times: "
                                         f"{failed}") from None
                    print(f"  {failed}: running it again", flush=True)
            result["attempts"] = attempt
            if round_index:
                runs[contender].append(result)
    return runs


def irregular_runs(runs: dict) -> list[str]:
    """The measured runs that were retried, ended with an error after their last epoch, or
    compiled after their first step (in their time per step if after the first window)."""
    notes = []
    for workload, by_contender in runs.items():
        for contender, measured in by_contender.items():
            for index, run in enumerate(measured, start=1):
                if run["attempts"] > 1 or run["exit_status"]:
                    notes.append(f"{workload} round {index} {contender}: attempt "
                                 f"{run['attempts']}, exit status {run['exit_status']} (every "
                                 "epoch recorded)")
                if run.get("compiled_after_step_1"):
                    notes.append(f"{workload} round {index} {contender}: compiled in "
                                 f"{run['compiled_after_step_1']} window(s) after step 1")
    return notes


def compile_lines(results: dict) -> list[str]:
    return [f"{workload} {name}: {r['compile_seconds']:.1f} s spent compiling" for workload,
            by_contender in results.items() for name, r in by_contender.items()
            if r.get("compile_seconds")]


def loss_lines(runs: dict) -> list[str]:
    """lm: each side's final training loss per round (seed), its median and spread, whether that
    median lies within the other side's seeds' spread; the median loss at every matched step."""
    lines = []
    for workload, by_contender in runs.items():
        if "window_losses" not in by_contender.get("template", [{}])[0]:
            continue
        finals = {name: [r["final_loss"] for r in measured]
                  for name, measured in by_contender.items()}
        steps = list(by_contender["template"][0]["window_losses"])
        for name, other in (("template", "handwritten"), ("handwritten", "template")):
            mine, theirs = finals[name], finals[other]
            inside = min(theirs) <= statistics.median(mine) <= max(theirs)
            at_steps = (statistics.median(r["window_losses"][s] for r in by_contender[name])
                        for s in steps)
            lines.append(f"{workload} {name}: final train loss by seed "
                         f"{', '.join(f'{v:.4f}' for v in mine)}; median "
                         f"{statistics.median(mine):.4f}, spread {min(mine):.4f}.."
                         f"{max(mine):.4f}, {'within' if inside else 'outside'} the {other} "
                         "seeds' spread")
            lines.append(f"{workload} {name}: median train loss at steps {'/'.join(steps)}: "
                         + "/".join(f"{m:.3f}" for m in at_steps))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="measured rounds after a warm-up")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated: {','.join(WORKLOADS)}")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or args.pairs < 1:
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}; --pairs at least 1")

    results, runs, ratios = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        scratch = Path(tmp)
        project = bake(scratch / "baked")
        for name in names:
            workload = WORKLOADS[name]
            if "prepare" in workload:  # its data, by the bake's own command (lm: tokens)
                subprocess.run([sys.executable, *workload["prepare"]], cwd=project, check=True,
                               stdout=subprocess.DEVNULL)
            runs[name] = run_rounds(name, contenders_for(name, workload, project, scratch),
                                    args.pairs)
            results[name] = {
                contender: {key: statistics.median(r[key] for r in measured)
                            for key in NUMBERS if key in measured[0]}
                for contender, measured in runs[name].items()}
            ratios[name] = compared(runs[name], workload)

    import torch

    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}
    markdown = table(results, ratios)
    for heading, lines in (("Loss at matched steps (each round its own seed)", loss_lines(runs)),
                           ("Compiling (rank 0, median; in the first step: not in the time per "
                            "step)", compile_lines(results)),
                           ("Retried, failed at teardown or compiled after step 1",
                            irregular_runs(runs))):
        if lines:
            markdown += f"\n\n{heading}:\n" + "\n".join(f"- {line}" for line in lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"machine": machine, "pairs": args.pairs,
         "workloads": {n: WORKLOADS[n] for n in names},
         "results": results, "ratios": ratios, "runs": runs}, indent=1) + "\n")
    header = (f"torchrun with gloo on the CPU (tiny-1proc: one plain process), {args.pairs} "
              f"measured rounds after a warm-up; {machine['cores']} cores, Python "
              f"{machine['python']}, torch {machine['torch']}, {machine['date']}.\n\n")
    (args.out / "results.md").write_text(header + markdown + "\n")
    print("\n" + header + markdown)
    print(f"\nwrote {args.out / 'results.md'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
