"""Faults with real processes: a raising rank, bad resume input, a finished run rerun, a resume
at another process count. (Killed workers and killed checkpoint writes: test_checkpoints.py.)"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, RunsCode, command_env, fixture, run, torchrun
from ddpkit.checkpoint_files import STATE_FILE, list_checkpoints
from ddpkit.checkpoint_load import read_model

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

PROJECT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parent_of.items() if parent in frontier]
        found += children
        frontier = children
    return found


def rank_of(pid: int) -> int | None:
    """The RANK torchrun gave a worker (None for the launcher processes)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def wait_until(condition, what: str, timeout: float = 120, check=lambda: None):
    """Poll until condition() is truthy and return it; `check()` may fail the test first. The
    timeout only stops a test that would otherwise wait forever (a hang, not a slow machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        check()
        time.sleep(0.005)
    raise AssertionError(f"still waiting for {what} after {timeout} s: it hangs")


def wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 120):
    """Poll until condition() is truthy; fail if the job ends first."""

    def still_running():
        assert launcher.poll() is None, f"the job ended before {what}"

    return wait_until(condition, what, timeout, still_running)


def logged_steps(output_dir: Path) -> int:
    logs = list(output_dir.glob("*/train_log.jsonl"))
    return len(logs[0].read_text().splitlines()) if logs else 0


def launch(args: list[str], nproc: int = 2, **env: str) -> subprocess.Popen:
    # A session of its own: if the job hangs, finish() can stop it and all its workers.
    return subprocess.Popen(["./run.sh", *args], cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=command_env(NPROC_PER_NODE=str(nproc), **env))


def finish(launcher: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return launcher.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_tree(launcher)
        raise AssertionError(f"the job hung:\n{launcher.communicate()[0][-3000:]}") from None


def kill_tree(launcher: subprocess.Popen) -> None:
    """SIGKILL run.sh's process group and everything below it (run.sh starts torchrun and the
    workers in a process group of their own)."""
    below = descendants(launcher.pid)
    os.killpg(launcher.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def kill_worker(launcher: subprocess.Popen, rank: int) -> None:
    """SIGKILL the worker of `rank` (not a process it started, e.g. a tracker's service, which
    inherits its RANK)."""
    workers = {rank_of(pid): pid for pid in descendants(launcher.pid)
               if rank_of(parent_of(pid)) is None}
    os.kill(workers[rank], signal.SIGKILL)


def final_model(run_dir: Path) -> dict:
    """The weights of the run's latest checkpoint."""
    return read_model(list_checkpoints(run_dir / "checkpoints")[-1])


def epoch_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the timings (which differ from run to run)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_seconds")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_raising_rank_ends_the_job_promptly_with_one_report(tmp_path, request):
    # Promptly: not by the collective timeout, which is set to an hour here, so a job that
    # waited for it would outlive the test's limit (a hang, not a slow machine). With loader
    # workers: a failing rank used to leave them (and their forkserver) running for good.
    # A short temp folder: forkserver's socket lives there, and AF_UNIX paths are short.
    temp = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    marker = f"test-{os.getpid()}-{tmp_path.name}"
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    result = run(["./run.sh", "tests/fail_at_step.py", *TINY, "ddp.timeout_minutes=60",
                  "data.num_workers=2", f"run.output_dir={tmp_path}"],
                 timeout=240, NPROC_PER_NODE="2", MAX_RESTARTS="0", FAIL_STEP="7", FAIL_RANK="1",
                 TMPDIR=str(temp), LEAK_MARKER=marker)
    assert result.returncode != 0
    assert result.stdout.count("ValueError: planted bug at step 7") == 1, result.stdout
    assert result.stdout.count("rank 1 failed:") == 1, result.stdout
    assert processes_with(f"LEAK_MARKER={marker}") == []  # no orphaned workers
    assert not list(temp.glob("pymp-*"))


@pytest.mark.parametrize("what", ["a model that raises", "an import that fails"])
def test_an_error_of_every_rank_is_told_once_and_not_retried(tmp_path, what):
    if what == "a model that raises":
        args, error = [*TINY, f"model.name={fixture('broken_mlp')}",
                       f"run.output_dir={tmp_path}"], "mat1 and mat2 shapes cannot be multiplied"
    else:
        args, error = ["tests/broken_import.py"], "No module named 'uninstalled_package'"
    result = run(["./run.sh", *args], timeout=240, NPROC_PER_NODE="2", MAX_RESTARTS="3")
    assert result.returncode == 1, result.stdout
    assert result.stdout.count(error) == 1, result.stdout
    assert result.stdout.count("Traceback") == 1, result.stdout  # torchrun's own: none
    assert result.stdout.count("run folder:") <= 1, result.stdout  # no attempt started again


def processes_with(variable: str) -> list[str]:
    """The command lines of the processes whose environment holds `variable` (NAME=value)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and variable.encode() in (
                    (entry / "environ").read_bytes().split(b"\0")):
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def test_bad_resume_input_is_one_line(tmp_path):
    out = tmp_path / "small"
    assert run([sys.executable, "train.py", *TINY, "train.epochs=1",
                f"run.dir={out}"]).returncode == 0
    checkpoint = list_checkpoints(out / "checkpoints")[-1]
    other_shape = run([sys.executable, "train.py", *TINY, "model.hidden_dim=64",
                       f"train.resume={checkpoint}", f"run.output_dir={tmp_path / 'a'}"])
    assert other_shape.returncode == 2
    assert other_shape.stdout.strip().splitlines() == [
        line for line in other_shape.stdout.strip().splitlines() if line.startswith("error:")]
    assert "does not fit the model" in other_shape.stdout and "shape differs" in other_shape.stdout

    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    result = torchrun(2, "train.py", *TINY, f"train.resume={truncated}",
                      f"run.output_dir={tmp_path / 'b'}")
    assert result.returncode != 0
    assert result.stdout.count(f"cannot load checkpoint {truncated}") == 1, result.stdout
    # Launches that failed before training left no run folder behind.
    assert list((tmp_path / "a").iterdir()) == list((tmp_path / "b").iterdir()) == []


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil"  # a checkpoint folder whose state.pt holds code
    evil.mkdir()
    torch.save({"step": 1, "scheduler": RunsCode(marker)}, evil / STATE_FILE)
    result = run([sys.executable, "train.py", *TINY, f"train.resume={evil}",
                  f"run.output_dir={tmp_path / 'runs'}"])
    assert result.returncode == 2
    assert "refusing to load checkpoint" in result.stdout
    assert not marker.exists()


# The last checkpoint: written by the final save after the loop (every 20 steps), or by the
# periodic save at the last step, before that epoch's validation (every 19 steps: 2 epochs of 19).
@pytest.mark.parametrize("ckpt_every", [20, 19])
def test_rerunning_a_finished_run_changes_no_record(tmp_path, ckpt_every):
    args = [sys.executable, "train.py", *TINY, "train.epochs=2", f"train.ckpt_every={ckpt_every}",
            f"run.dir={tmp_path / 'run'}"]
    assert run(args).returncode == 0
    before = [(tmp_path / "run" / name).read_text() for name in ("metrics.jsonl",
                                                                  "train_log.jsonl")]
    again = run(args)
    assert again.returncode == 0, again.stdout
    assert "resumed from" in again.stdout
    assert [(tmp_path / "run" / name).read_text() for name in ("metrics.jsonl",
                                                               "train_log.jsonl")] == before


def test_resume_with_another_process_count(tmp_path):
    run_dir = tmp_path / "run"
    first = run(["./run.sh", *TINY, "train.max_steps=25", f"run.dir={run_dir}"],
                NPROC_PER_NODE="2")
    assert first.returncode == 0, first.stdout
    second = run([sys.executable, "train.py", *TINY, f"run.dir={run_dir}"])
    assert second.returncode == 0, second.stdout
    assert "world 2 -> 1 at step " in second.stdout
    assert "resumed from" in second.stdout
    assert "step 25, epoch 2, 6 step(s) into it" in second.stdout
    steps = [json.loads(line)["step"] for line in
             (run_dir / "train_log.jsonl").read_text().splitlines()]
    # Logged every 5 steps, at each epoch's end (19, 38, 57), at the first step (1) and where
    # the first job stopped (25); the resumed job's windows are those of an uninterrupted run
    # (no extra one at its first step, 26); nothing twice, nothing lost.
    assert steps == sorted({*range(5, 58, 5), 19, 38, 57, 1, 25})


def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_one_before_kept(tmp_path):
    # Step 14's loss is finite, its gradient NaN: the weights after it are NaN. The checkpoint
    # of step 14 is refused, the job ends with one line (no restart), step 7's stays the newest.
    result = run(["./run.sh", *TINY, f"task.name={fixture('NanGradientTask')}",
                  "train.ckpt_every=7", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="2", NAN_STEP="14")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in result.stdout, result.stdout
    assert "the weights hold NaN or inf at step 14" in errors[0], errors
    assert "the newest, step-00000007, stays the one to resume from" in errors[0], errors
    (run_dir,) = tmp_path.iterdir()
    saved = list_checkpoints(run_dir / "checkpoints")
    assert [path.name for path in saved] == ["step-00000007"]
    assert all(torch.isfinite(value).all() for value in read_model(saved[0]).values())
