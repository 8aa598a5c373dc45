"""evaluate.py's faults, with real processes through run.sh (2 processes, torchrun's restarts on):
a tracker that is not installed, an output folder that cannot be written or fills up, SIGTERM.
Each ends with one line printed once and no restart, writes nothing half, and leaves no process
of its own and no file of the project's in the temp folder."""

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import finish, wait_for

from conftest import TINY, command_env, run

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[1]
PREEMPTED = 75


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run([sys.executable, "train.py", *TINY, "train.epochs=1", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A run of its own for each test: tests write into it."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def session_processes(session: int) -> list[int]:
    """The processes still alive in a session (Linux /proc)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


def run_sh(tmp_path: Path, args: list[str], script: str = "evaluate.py", limit_bytes: int = 0,
           until=None, **env: str) -> tuple[int, str]:
    """./run.sh <script> <args> with 2 processes, in a session of its own and with a temp folder
    of its own; `until`: a file whose appearance gets the session SIGTERM. Returns the exit
    status and the output, once no process of the session is left."""
    temp = tmp_path / "temp"
    temp.mkdir()

    def limit_file_size():  # a disk that fills up: a write past the limit fails (EFBIG)
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    launcher = subprocess.Popen(
        ["./run.sh", script, *args], cwd=PROJECT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=limit_file_size,
        env=command_env(NPROC_PER_NODE="2", TMPDIR=str(temp), **env))
    if until is not None:
        wait_for(until.exists, launcher, f"{until.name} to appear")
        os.killpg(launcher.pid, signal.SIGTERM)  # run.sh's process group, as a scheduler does
    output = finish(launcher)
    assert session_processes(launcher.pid) == [], output
    assert left_in(temp) == []
    return launcher.returncode, output


def left_in(temp: Path) -> list[str]:
    """What the project left in a temp folder. torchrun's own torchelastic_* folders are
    run.sh's to clean up; torchinductor_<user> is torch's compile cache, kept on purpose."""
    return [path.name for path in temp.iterdir()
            if not path.name.startswith(("torchelastic_", "torchinductor_"))]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error" in line.lower()]


def hidden(folder: Path) -> list[Path]:
    """Half-written files: the staging folders and temporary files writes go through."""
    return [path for path in folder.rglob(".*") if path.name.endswith(".tmp")]


def test_a_tracker_that_is_not_installed_is_one_line_before_any_evaluation(tmp_path, run_copy):
    (run_copy / "trackers.json").write_text('{"mlflow": {"run_id": "0"}}')
    without = tmp_path / "without-mlflow"
    without.mkdir()  # an interpreter on which mlflow cannot be imported
    (without / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    status, output = run_sh(tmp_path, [f"eval.checkpoint={run_copy}", "tracking.mlflow=true"],
                            PYTHONPATH=str(without))
    assert status == 2, output
    assert len(error_lines(output)) == 1 and "Traceback" not in output, output
    assert "tracking.mlflow=true needs the mlflow package" in output
    assert "evaluated" not in output and "restart" not in output.lower(), output
    assert not (run_copy / "eval-test").exists()


@pytest.mark.parametrize("fault", ["under a file", "read-only", "full"])
def test_an_output_folder_that_cannot_be_written_is_one_line_and_nothing_half_written(
        tmp_path, run_copy, fault):
    out_dir = run_copy / "eval-test"
    limit = 0
    if fault == "under a file":
        (tmp_path / "a-file").write_text("")
        out_dir = tmp_path / "a-file" / "eval"
    elif fault == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        run_copy.chmod(0o555)
    else:
        # bytes: less than curves.json; more than the error run.sh records and than the module
        # torch 2.9 writes when torch.distributed.nn is imported (2.4 kB)
        limit = 4096
    try:
        status, output = run_sh(tmp_path, [f"eval.checkpoint={run_copy}",
                                             f"eval.output_dir={out_dir}"], limit_bytes=limit)
    finally:
        run_copy.chmod(0o755)
    assert status == 2, output
    errors = error_lines(output)
    assert len(errors) == 1 and "Traceback" not in output, output
    assert f"cannot write the evaluation in {out_dir}" in errors[0], errors
    assert "restart" not in output.lower(), output
    assert not out_dir.exists() and hidden(run_copy) == []


def test_sigterm_stops_an_evaluation_with_the_preemption_code_and_writes_nothing(
        tmp_path, run_copy):
    marker = tmp_path / "evaluating"
    status, output = run_sh(tmp_path, [f"eval.checkpoint={run_copy}"],
                            script="tests/preempt_in_evaluation.py", until=marker,
                            PREEMPT_MARKER=str(marker))
    assert status == PREEMPTED, output
    assert output.count("preempted: evaluation stopped") == 1, output
    assert "Traceback" not in output and "restart" not in output.lower(), output
    assert not (run_copy / "eval-test").exists() and hidden(run_copy) == []
