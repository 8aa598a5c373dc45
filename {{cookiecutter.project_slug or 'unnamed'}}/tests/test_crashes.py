"""A worker that crashes in native code (ddpkit/crashes.py): under run.sh it is told once, with
its Python stack, and not retried, and its unused run folder goes; a crash in a library's own
thread is not the code's, and is left to torchrun's restarts."""

import subprocess
import sys

import pytest

from conftest import PROJECT, TINY, command_env, run
from ddpkit import crashes

CRASH = """
import ctypes, faulthandler, sys, time
from ddpkit import crashes
crashes.record(sys.argv[1])
if sys.argv[2] == "main thread":
    faulthandler._sigsegv()
libc = ctypes.CDLL(None)  # a thread of native code's own, as NCCL's watchdog: it aborts
libc.pthread_create(ctypes.byref(ctypes.c_ulong()), None, ctypes.cast(libc.abort,
                    ctypes.c_void_p), None)
time.sleep(60)
"""


def test_a_crash_in_a_python_thread_is_the_codes_and_one_in_a_native_thread_is_not(tmp_path):
    status = tmp_path / "status"
    for rank, where in (("0", "native thread"), ("1", "main thread")):
        crashed = subprocess.run([sys.executable, "-c", CRASH, str(status), where], cwd=PROJECT,
                                 env=command_env(RANK=rank, TORCHELASTIC_RESTART_COUNT="0"),
                                 capture_output=True, text=True, timeout=60, check=False)
        assert crashed.returncode < 0 and crashed.stderr == ""  # its stack went to its file
    assert "Fatal Python error: Aborted" in (tmp_path / "status.crash.0.0").read_text()
    [crash] = crashes.crashes(str(status))  # the main thread's only
    assert (crash.rank, crash.attempt, crash.words) == ("1", 0, "Segmentation fault")
    assert crash.where() == ' in <module> (<string> line 6)'


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "signal", "words", "restarts"), [
    ("2", "SIGSEGV", "Segmentation fault", "3"), ("1", "SIGABRT", "Aborted", "0")])
def test_a_crash_in_native_code_is_told_once_and_not_retried(tmp_path, nproc, signal, words,
                                                              restarts):
    rank = int(nproc) - 1
    result = run(["./run.sh", "tests/crash_in_setup.py", *TINY, f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE=nproc, MAX_RESTARTS=restarts, CRASH_RANK=str(rank),
                 CRASH_SIGNAL=signal)
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    assert lines.count(f"rank {rank} crashes now") == 1  # never started again
    assert result.stdout.count(f"Fatal Python error: {words}") == 1  # its stack, once
    assert lines[-1] == (
        f"rank {rank} crashed in native code ({words}, {signal}) in crashing_wrap_model "
        "(tests/crash_in_setup.py line 25): a crash of the code would only come back, so the job "
        "is not retried; the Python stack above shows the call that crashed")
    assert list(tmp_path.iterdir()) == []  # the run folder it made, holding only its markers
