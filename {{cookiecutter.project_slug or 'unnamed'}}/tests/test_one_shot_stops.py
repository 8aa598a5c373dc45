"""Commands that write their result at their end (the token preparation, sample.py, export.py,
evaluate.py of one process): stopped at once by SIGTERM (exit 75) and Ctrl-C (exit 130) with
nothing half written; the preparation's lock and a killed preparation's leftovers; and
writes.write_whole, the one way files and folders are written whole."""

import os
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_faults import finish, wait_for

from conftest import PROJECT, command_env
from ddpkit import checkpoint, recipes, supervisor
from ddpkit.config import UserError, load_config
from ddpkit.parallel import build_model
from ddpkit.project import PREEMPTED_EXIT
from ddpkit.tokens import prepare
from ddpkit.writes import write_whole

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))
STOPPED = "stopped by SIGTERM: nothing is left half written; run the same command again"


def held(folder: Path, hold_in: str, *command: str, release: Path | None = None
         ) -> tuple[subprocess.Popen, Path]:
    """A command started through tests/hold_at.py, held at `hold_in` (module:function), and the
    file it creates once it is there."""
    marker = folder / f"held-{uuid.uuid4().hex}"
    extra = {"HOLD_RELEASE": str(release)} if release else {}
    process = subprocess.Popen(
        [sys.executable, "tests/hold_at.py", *command], cwd=PROJECT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=command_env(HOLD_IN=hold_in, HOLD_MARKER=str(marker), **extra))
    return process, marker


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """An untrained model.pt of the built-in GPT, and the token folder it reads."""
    root = tmp_path_factory.mktemp("one-shot")
    (root / "text.txt").write_text(TEXT)
    prepare([root / "text.txt"], root / "tokens")
    cfg = load_config(["data.dataset=tokens", f"data.root={root / 'tokens'}",
                       "data.block_size=16", "model.name=gpt", "model.hidden_dim=16",
                       "model.num_layers=1"])
    recipes.load()
    path = root / "model.pt"
    checkpoint.export_model(build_model(cfg.model, (16,), len(set(TEXT))).state_dict(), path,
                            0, cfg, "trained")
    return path


def test_sigterm_and_ctrl_c_stop_one_shot_commands_at_once_with_nothing_half_written(
        tmp_path, model_file):
    """Each command held where it writes its result (or, sample.py, draws its text): SIGTERM
    and SIGINT end it at once, exit 75 and 130, and what it was writing is not there."""
    (tmp_path / "text.txt").write_text(TEXT)
    commands = {  # name: (where it is held, command, what it writes)
        "prepare": ("ddpkit.writes:settle", ["-m", "ddpkit.tokens", str(tmp_path / "text.txt"),
                                             "--out", "{out}"]),
        "sample": ("ddpkit.lm:generate", ["sample.py", str(model_file), "--tokens", "5"]),
        "export": ("ddpkit.writes:settle", ["export.py", str(model_file), "{out}"]),
        "evaluate": ("ddpkit.evaluation:OutputFolder.commit",
                     ["evaluate.py", f"eval.checkpoint={model_file}", "eval.output_dir={out}"]),
    }
    started = {}
    for name, (hold_in, command) in commands.items():
        for stop in ((signal.SIGTERM, signal.SIGINT) if name != "evaluate"
                     else (signal.SIGTERM,)):
            folder = tmp_path / f"{name}-{stop.name}"
            folder.mkdir()
            out = folder / ("out.pt" if name == "export" else "out")
            started[name, stop] = (folder, *held(
                tmp_path, hold_in, *(word.replace("{out}", str(out)) for word in command)))
    for (name, stop), (_, process, marker) in started.items():
        wait_for(marker.exists, process, f"{name} held")
        process.send_signal(stop)
    for (name, stop), (folder, process, _) in started.items():
        output = finish(process)
        if stop == signal.SIGTERM:
            assert (process.returncode, output.splitlines()[-1]) == (PREEMPTED_EXIT, STOPPED), \
                (name, output)
        else:
            assert process.returncode == 130, (name, output)
        assert "Traceback" not in output, (name, output)
        assert list(folder.iterdir()) == [], (name, stop)  # nothing, hidden or not


@pytest.mark.parametrize("number", [signal.SIGUSR1, signal.SIGHUP])
def test_sigusr1_and_sighup_stop_a_one_shot_command_as_sigterm_does(number):
    """In this process: the handlers stop_at_once installs turn them into Stopped (what
    run_main ends with exit 75, as the test above sees for SIGTERM); put back afterwards."""
    kept = {n: signal.getsignal(n) for n in (*supervisor.STOP_SIGNALS, signal.SIGINT)}
    try:
        supervisor.stop_at_once()
        with pytest.raises(supervisor.Stopped, match=f"^stopped by {number.name}$"):
            os.kill(os.getpid(), number)  # (its handler runs at the next instruction)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # its clean-up not cut short
    finally:
        for n, handler in kept.items():
            signal.signal(n, handler)


def test_two_preparations_of_one_folder_do_not_both_write_it(tmp_path):
    """The second is refused while the first holds the lock, and once it has written the
    folder, because the folder exists."""
    (tmp_path / "a.txt").write_text(TEXT)
    out, release = tmp_path / "tokens", tmp_path / "release"
    first, marker = held(tmp_path, "ddpkit.writes:settle", "-m", "ddpkit.tokens",
                         str(tmp_path / "a.txt"), "--out", str(out), release=release)
    wait_for(marker.exists, first, "the first preparation writing")
    with pytest.raises(UserError, match=rf"^{out} is being written by pid {first.pid} on "
                                        r"\S+: wait for it to end, or write another$"):
        prepare([tmp_path / "a.txt"], out)
    release.touch()
    output = finish(first)
    assert first.returncode == 0 and output.startswith(f"wrote {out}: "), output
    with pytest.raises(UserError, match=f"^--out {out} exists: choose a new folder, or delete "
                                        "that one$"):
        prepare([tmp_path / "a.txt"], out)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "a.txt", marker.name, "release", "tokens"]


def test_a_killed_preparation_leaves_a_temporary_folder_the_next_one_removes(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "tokens"
    killed, marker = held(tmp_path, "ddpkit.writes:settle", "-m", "ddpkit.tokens",
                          str(tmp_path / "a.txt"), "--out", str(out))
    wait_for(marker.exists, killed, "the preparation writing")
    killed.kill()
    finish(killed)
    (leftover,) = tmp_path.glob(f".tokens.tmp-{killed.pid}-*")
    assert sorted(leftover.iterdir()) == [leftover / name for name in (
        "meta.json", "test.bin", "train.bin", "val.bin")]
    marker.unlink()
    prepare([tmp_path / "a.txt"], out)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "tokens"]


# --- write_whole ---------------------------------------------------------------------------------

def test_write_whole_replaces_keeps_or_refuses_and_leaves_nothing_on_a_failure(tmp_path):
    target = tmp_path / "folder"

    def fill(text: str):
        def write(folder: Path) -> None:
            (folder / "file").write_text(text)
            (folder / "file").chmod(0o600)  # (as safetensors writes)
        return write

    assert write_whole(target, fill("one"), folder=True)
    assert write_whole(target, fill("two"), folder=True)  # a full folder replaced
    assert not write_whole(target, fill("three"), folder=True, exists="keep")
    with pytest.raises(UserError, match=f"^{target} exists: choose a new folder, or delete "
                                        "that one$"):
        write_whole(target, fill("four"), folder=True, exists="refuse")
    assert (target / "file").read_text() == "two"
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((target / "file").stat().st_mode) == 0o666 & ~umask

    def fail_half_way(path: Path) -> None:
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError, match=f"^cannot write {tmp_path / 'file'}: No space left on "
                                        r"device \(.* MB free in "):
        write_whole(tmp_path / "file", fail_half_way)

    def stopped_half_way(path: Path) -> None:
        path.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_whole(tmp_path / "file", stopped_half_way)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["folder"]
