"""Releases and the checkpoints that survive them. CHANGELOG.md lists the releases (version,
commit, checkpoint format); the engine knows its own (ddpkit.__version__, FORMAT_VERSION). A run of
the previous release, stopped mid-way, takes `cruft update` and continues where it stopped, as if
it had never stopped; a checkpoint the engine cannot resume is refused in one line."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import TEMPLATE, run
from test_cruft import (
    CRUFT,
    SLUG_DIR,
    call,
    commit,
    conflicts,
    copy_checkout,
    template_at,
    tools,  # noqa: F401 (a fixture, for this file's tests too)
)

ENGINE = TEMPLATE / SLUG_DIR / "ddpkit"
# A release's entry: `## X.Y.Z ...`, then its lines up to the next entry.
RELEASE = re.compile(r"^## (\d+\.\d+\.\d+)\b(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
COMMIT = re.compile(r"^- \*\*Commit\*\*: ([0-9a-f]{40})\b", re.MULTILINE)
FORMAT = re.compile(r"^- \*\*Checkpoint format\*\*: (\d+)\b", re.MULTILINE)
# The tests' tiny run (every release's tests/conftest.py TINY): 19 steps an epoch, 57 in all, a
# checkpoint every 20 steps (and at the best validation, step 19).
TINY = ["data.dataset=tests/fixtures.py:vectors", "model.name=tests/fixtures.py:mlp",
        "model.hidden_dim=32", "train.global_batch_size=12", "train.epochs=3", "train.log_every=5",
        "train.ckpt_every=20", "optim.warmup_steps=5", "optim.lr=0.01",
        "train.progress_bar=false", "train.plot_curves=false"]
# What a training-log line says of the training itself (not its time or throughput).
TRAINED = ("step", "lr", "loss", "accuracy")


def releases() -> list[tuple[str, str | None, int]]:
    """CHANGELOG.md's releases, newest first: (version, commit or None while it is not tagged,
    checkpoint format)."""
    found = []
    for version, entry in RELEASE.findall((TEMPLATE / "CHANGELOG.md").read_text()):
        tagged, written = COMMIT.search(entry), FORMAT.search(entry)
        assert written, f"CHANGELOG.md: {version} has no '- **Checkpoint format**: N' line"
        found.append((version, tagged[1] if tagged else None, int(written[1])))
    return found


def engine_constant(file: str, name: str) -> str:
    """A constant of the engine, as its source assigns it."""
    source = (ENGINE / file).read_text()
    return re.search(rf"^{name} = \"?([\w.]+)\"?$", source, re.MULTILINE)[1]


def test_the_changelog_lists_this_engines_release_first_and_every_earlier_ones_commit():
    (version, _, checkpoint_format), *earlier = releases()
    assert version == engine_constant("__init__.py", "__version__")
    assert checkpoint_format == int(engine_constant("checkpoint_files.py", "FORMAT_VERSION"))
    assert earlier, "CHANGELOG.md lists no earlier release"
    assert [v for v, tagged, _ in earlier if not tagged] == []  # filled in by the next release
    numbers = [tuple(map(int, v.split("."))) for v, _, _ in releases()]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)


def trained_log(run_dir: Path) -> list[dict]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [{key: entry.get(key) for key in TRAINED} for entry in map(json.loads, lines)]


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


def stop_after_step_20(project: Path, run_dir: Path, tmp: Path):
    """That release's own test of a planted bug: the run fails at step 21, after its checkpoint
    at step 20 (torchrun, one process: the bug needs RANK)."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=1", "tests/fail_at_step.py", *TINY, f"run.dir={run_dir}"],
               cwd=project, timeout=300, FAIL_STEP="21", FAIL_RANK="0", TMPDIR=str(tmp))


@pytest.mark.slow
def test_a_run_of_the_previous_release_resumes_exactly_after_cruft_update(
        tmp_path, tools):  # noqa: F811 (the fixture imported)
    previous, release_commit, _ = next(entry for entry in releases() if entry[1])
    template, baked_commit = template_at(release_commit, tmp_path, tools)
    copy_checkout(template)
    newest = commit(template, "This checkout", tools)
    call([CRUFT, "create", template, "--checkout", baked_commit, "--no-input", "--output-dir",
          tmp_path / "out"], tmp_path, tools)
    project = tmp_path / "out" / "my_ddp_experiment"
    call(["git", "init", "-q"], project, tools)
    commit(project, f"Baked from release {previous}", tools)

    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    stopped = stop_after_step_20(project, run_dir, tmp)
    assert stopped.returncode != 0 and "planted bug at step 21" in stopped.stdout, stopped.stdout
    assert max(p.name for p in (run_dir / "checkpoints").iterdir()) == "step-00000020"

    updated = call([CRUFT, "update", "-y"], project, tools)
    assert conflicts(project) == [], updated.stdout
    assert json.loads((project / ".cruft.json").read_text())["commit"] == newest

    # A release that stops reading the previous one's format (a major one) expects its one-line
    # refusal here instead (CHANGELOG.md: Deprecated).
    resumed = run([sys.executable, "train.py", *TINY, f"run.dir={run_dir}"], cwd=project)
    assert resumed.returncode == 0, resumed.stdout
    assert (f"resumed from {run_dir / 'checkpoints' / 'step-00000020'}: step 20, epoch 2, "
            "1 step(s) into it") in resumed.stdout, resumed.stdout
    this_release = engine_constant("__init__.py", "__version__")
    assert f"| template release {this_release}" in resumed.stdout

    whole = run([sys.executable, "train.py", *TINY, f"run.dir={tmp_path / 'whole'}"],
                cwd=project)
    assert whole.returncode == 0, whole.stdout
    # The same steps, learning rates, losses and accuracies, before the stop and after it, and
    # the same final weights, bit for bit: the optimizer state, the schedule, the data position
    # and the random streams all carried over.
    # Release 1.0.0 logged the next step's rate as `lr`, later ones the rate the step trained
    # with: the lines 1.0.0 wrote (up to its checkpoint at step 20) are compared without it.
    ours, whole = trained_log(run_dir), trained_log(tmp_path / "whole")
    if previous == "1.0.0":
        ours, whole = ([{**entry, "lr": None} if entry["step"] <= 20 else entry for entry in log]
                       for log in (ours, whole))
    assert ours == whole
    ours, theirs = final_weights(run_dir), final_weights(tmp_path / "whole")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    state = torch.load(run_dir / "checkpoints" / "step-00000057" / "state.pt", weights_only=True)
    assert (state["format_version"], state["template_version"]) == (
        int(engine_constant("checkpoint_files.py", "FORMAT_VERSION")), this_release)


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A bake of this checkout, and two copies of a checkpoint of its tiny run (one epoch: step
    19), each as another release would have written it, its manifest included: the project, one
    of a newer format, and one from before release 1.0.0's optimizer and schedule rewrite
    (template commit b37dc3c: no format_version, no plateau entry)."""
    from cookiecutter.main import cookiecutter

    root = tmp_path_factory.mktemp("release")
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(root)))
    result = run([sys.executable, "train.py", *TINY, "train.epochs=1", f"run.dir={root / 'run'}"],
                 cwd=project)
    assert result.returncode == 0, result.stdout
    newer = int(engine_constant("checkpoint_files.py", "FORMAT_VERSION")) + 1
    changes = {root / "newer" / "step-00000019":
               f"state.update(format_version={newer}, template_version='99.0.0')",
               root / "pre-release" / "step-00000019":
               "del state['format_version'], state['plateau']\n"
               "state.pop('template_version', None)"}
    script = "import torch\nfrom ddpkit.checkpoint_files import write_manifest\n"
    for folder, change in changes.items():
        shutil.copytree(root / "run" / "checkpoints" / "step-00000019", folder)
        (folder / "manifest.json").unlink()
        script += (f"state = torch.load('{folder}/state.pt', weights_only=True)\n{change}\n"
                   f"torch.save(state, '{folder}/state.pt')\nwrite_manifest('{folder}')\n")
    result = run([sys.executable, "-c", script], cwd=project)
    assert result.returncode == 0, result.stdout
    return project, *changes


def refusal(result) -> str:
    """The one line a refused command printed (exit status 2, no traceback)."""
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stdout
    return lines[0]


def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line(old_and_new, tmp_path):
    project, newer, _ = old_and_new
    this = engine_constant("__init__.py", "__version__")
    known = int(engine_constant("checkpoint_files.py", "FORMAT_VERSION"))
    runs = tmp_path / "runs"
    resumed = run([sys.executable, "train.py", *TINY, f"train.resume={newer}",
                   f"run.output_dir={runs}"], cwd=project)
    assert refusal(resumed) == (
        f"error: cannot load checkpoint {newer}: it was written by template release 99.0.0, "
        f"checkpoint format {known + 1}, which this engine (release {this}, format {known}) "
        "does not know: update the project to that release or a later one (cruft update, "
        "docs/updates.md), or load it with the project that wrote it")
    assert not runs.exists() or list(runs.iterdir()) == []  # no run folder left behind


@pytest.mark.slow
def test_a_checkpoint_from_before_the_schedule_rewrite_is_refused_for_resume(old_and_new,
                                                                           tmp_path):
    project, _, old = old_and_new
    runs = tmp_path / "runs"
    resumed = run([sys.executable, "train.py", *TINY, f"train.resume={old}",
                   f"run.output_dir={runs}"], cwd=project)
    assert refusal(resumed) == (
        f"error: cannot resume from {old}: it was written before template release 1.0.0, before "
        "the optimizer and LR-schedule rewrite (optimizers by name, biases and norm weights in a "
        "group without weight decay), so its optimizer state does not fit this engine's: finish "
        "that run with your project as it was before `cruft update` (its previous commit), or "
        "start a new run; evaluate.py and export.py still read its weights")
    assert not runs.exists() or list(runs.iterdir()) == []
    exported = run([sys.executable, "export.py", str(old), str(tmp_path / "model.pt")],
                   cwd=project)
    assert exported.returncode == 0, exported.stdout
    assert torch.load(tmp_path / "model.pt", weights_only=True)["step"] == 19
