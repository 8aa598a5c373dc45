"""Template updates with cruft: a project made with `cruft create` and then edited as the "Bring
your own" recipe says takes a later template commit with `cruft update`: the template's change
arrives, the user's files stay exactly as the user left them (pyproject.toml's [tool.cruft] skip),
nothing conflicts, and `cruft check` fails before the update and passes after it.

The template is copied into a git repository of its own (a local path: no network)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEMPLATE, apply_edit, recipe_blocks, run

CRUFT = Path(sys.executable).parent / "cruft"
SLUG_DIR = "{{cookiecutter.project_slug or 'unnamed'}}"
# The user's files of the project (pyproject.toml's [tool.cruft] skip), and one of the template's.
YOURS = ["data_sources.py", "model.py", "tasks.py", "settings.py"]
TEMPLATE_FILE = "ddpkit/models.py"
TEMPLATE_FIX = "# A later fix of the template's, which `cruft update` brings in.\n"
# A later change to the template's starting version of a user file, at its end: where the recipe
# appended, so it would collide with the user's code if updates did not skip the file.
STUB_CHANGE = "# A later line of the template's starting version of this file.\n"


@pytest.fixture
def tools(tmp_path):
    """Environment for git and cruft that ignores the machine's own git and cookiecutter
    settings: a fixed identity and default branch, no signing, cookiecutter's defaults."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "gitconfig").write_text("[user]\n\tname = Template Test\n\temail = test@example.com\n"
                                    "[init]\n\tdefaultBranch = main\n")
    (home / "cookiecutterrc").write_text(f"cookiecutters_dir: {home / 'cookiecutters'}\n"
                                         f"replay_dir: {home / 'replay'}\n")
    identity = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
                for what, value in (("NAME", "Template Test"), ("EMAIL", "test@example.com"))}
    return {"GIT_CONFIG_GLOBAL": str(home / "gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
            "COOKIECUTTER_CONFIG": str(home / "cookiecutterrc"), **identity}


def call(args: list, cwd: Path, env: dict, ok: bool = True):
    result = run(args, cwd=cwd, timeout=120, **env)
    if ok:
        assert result.returncode == 0, f"{args}\n{result.stdout}"
    return result


def commit(repo: Path, message: str, env: dict) -> str:
    call(["git", "add", "-A"], repo, env)
    call(["git", "commit", "-q", "-m", message], repo, env)
    return call(["git", "rev-parse", "HEAD"], repo, env).stdout.strip()


def copy_checkout(repo: Path) -> None:
    """The template as it is in this checkout (what cookiecutter needs of it) into `repo`, in
    place of what was there."""
    shutil.copy(TEMPLATE / "cookiecutter.json", repo)
    caches = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")
    for folder in ("hooks", SLUG_DIR):
        shutil.rmtree(repo / folder, ignore_errors=True)
        shutil.copytree(TEMPLATE / folder, repo / folder, ignore=caches)


def template_repo(root: Path, env: dict) -> Path:
    """The template as it is in this checkout, one commit."""
    repo = root / "ddp-template"
    repo.mkdir()
    copy_checkout(repo)
    call(["git", "init", "-q"], repo, env)
    commit(repo, "The template", env)
    return repo


def conflicts(project: Path) -> list[str]:
    """Files cruft left a conflict in: *.rej files, or git's conflict markers."""
    found = [str(path.relative_to(project)) for path in project.rglob("*.rej")]
    for path in project.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            lines = path.read_text(errors="replace").splitlines()
            if any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in lines):
                found.append(str(path.relative_to(project)))
    return found


def test_cruft_update_brings_template_changes_and_keeps_the_users_files(tmp_path, tools):
    template = template_repo(tmp_path, tools)
    baked = call([CRUFT, "create", template, "--no-input", "--output-dir", tmp_path / "out"],
                 tmp_path, tools)
    project = tmp_path / "out" / "my_ddp_experiment"
    state = json.loads((project / ".cruft.json").read_text())
    first = call(["git", "rev-parse", "HEAD"], template, tools).stdout.strip()
    assert (state["template"], state["commit"]) == (str(template), first), baked.stdout
    call(["git", "init", "-q"], project, tools)
    commit(project, "Baked from the template", tools)

    # The user's experiment: every file edit of the recipe (data, model, setting, config, task).
    edits = [(action, body) for action, body in recipe_blocks(project) if action != "run"]
    assert {action.split()[1] for action, _ in edits} == {*YOURS, "configs/my_scans.yaml"}
    for action, body in edits:
        apply_edit(project, action, body)
    yours = {name: (project / name).read_text() for name in [*YOURS, "configs/my_scans.yaml"]}
    assert "class MyScans(Dataset):" in yours["data_sources.py"]
    assert "class ScanNet(nn.Module):" in yours["model.py"]
    commit(project, "My experiment", tools)

    # The template moves on: a fix in a file of its own, and a line at the end of the starting
    # version of two of the user's files.
    with open(template / SLUG_DIR / TEMPLATE_FILE, "a") as handle:
        handle.write(TEMPLATE_FIX)
    for name in ("data_sources.py", "model.py"):
        with open(template / SLUG_DIR / name, "a") as handle:
            handle.write(STUB_CHANGE)
    second = commit(template, "A fix", tools)

    assert call([CRUFT, "check"], project, tools, ok=False).returncode == 1
    updated = call([CRUFT, "update", "-y"], project, tools)
    assert "Good work" in updated.stdout, updated.stdout
    assert conflicts(project) == [], updated.stdout
    assert (project / TEMPLATE_FILE).read_text().endswith(TEMPLATE_FIX)
    for name, text in yours.items():
        assert (project / name).read_text() == text, f"cruft update changed {name}"
    status = call(["git", "status", "--porcelain"], project, tools).stdout.splitlines()
    assert sorted(line[3:] for line in status) == [".cruft.json", TEMPLATE_FILE], status
    assert json.loads((project / ".cruft.json").read_text())["commit"] == second
    call([CRUFT, "check"], project, tools)


# The template's last commit before the engine moved into ddpkit/ (the flat layout).
FLAT_LAYOUT = "400bb3c"
# A row of docs/updates.md's table: | `file` | `old import` | `new import` |
IMPORT_ROW = re.compile(r"^\| `([\w.]+)` \| `([^`]+)` \| `([^`]+)` \|$", re.MULTILINE)


def template_at(ref: str, root: Path, env: dict) -> tuple[Path, str]:
    """The template as it was at commit `ref` of this checkout's history, one commit of a
    repository of its own: the repository and that commit."""
    known = run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=TEMPLATE)
    if known.returncode != 0:
        pytest.skip(f"needs the template's git history (commit {ref})")
    repo = root / "ddp-template"
    repo.mkdir()
    archive = subprocess.run(["git", "archive", ref, "cookiecutter.json", "hooks", SLUG_DIR],
                             cwd=TEMPLATE, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    call(["git", "init", "-q"], repo, env)
    return repo, commit(repo, f"The template at {ref}", env)


@pytest.mark.slow
def test_a_project_baked_before_the_engine_moved_takes_the_move_with_cruft_update(tmp_path,
                                                                                   tools):
    template, _ = template_at(FLAT_LAYOUT, tmp_path, tools)
    call([CRUFT, "create", template, "--no-input", "--output-dir", tmp_path / "out"], tmp_path,
         tools)
    project = tmp_path / "out" / "my_ddp_experiment"
    call(["git", "init", "-q"], project, tools)
    commit(project, "Baked from the template", tools)
    for action, body in recipe_blocks(project):  # the user's experiment, as that README said
        if action != "run":
            apply_edit(project, action, body)
    yours = {name: (project / name).read_text() for name in YOURS}
    commit(project, "My experiment", tools)

    # The template of this checkout replaces the flat one: the engine moves into ddpkit/.
    copy_checkout(template)
    commit(template, "The engine in ddpkit/", tools)
    updated = call([CRUFT, "update", "-y"], project, tools)
    assert conflicts(project) == [], updated.stdout
    assert {name: (project / name).read_text() for name in YOURS} == yours  # skipped
    assert (project / "ddpkit" / "models.py").is_file() and not (project / "splits.py").exists()

    # Training stops at the first old import, in one line that says what to write instead.
    smoke = [sys.executable, "train.py", "--config", "configs/my_scans.yaml",
             "train.fast_dev_run=true", "data.dataset=digits", "model.name=mlp",
             "task.name=multiclass"]
    stopped = run(smoke, cwd=project)
    assert stopped.returncode == 2
    assert stopped.stdout.strip().splitlines() == [
        "error: model.py imports builtin_models, which the template moved to ddpkit.models: "
        "write `from ddpkit.models import ...` at the top of your file (README: Taking template "
        "updates)"], stopped.stdout

    # The edits docs/updates.md lists, made literally; then the project runs as before.
    rows = IMPORT_ROW.findall((project / "docs" / "updates.md").read_text())
    assert {name for name, _, _ in rows} == {"model.py", "data_sources.py", "tasks.py"}
    for name, old, new in rows:
        text = (project / name).read_text()
        assert old in text, f"{name} has no line {old!r}"
        (project / name).write_text(text.replace(old, new))
    shown = run([sys.executable, "config.py", "--config", "configs/my_scans.yaml",
                 "model.aux_head=true"], cwd=project)
    assert shown.returncode == 0 and "aux_head: true" in shown.stdout, shown.stdout
    smoked = run(smoke, cwd=project)
    assert smoked.returncode == 0 and "fast_dev_run ok" in smoked.stdout, smoked.stdout


def test_a_slurm_answer_changes_with_cruft_update_and_cluster_sh_stays_the_users(tmp_path, tools):
    """docs/launch-and-clusters.md: a partition chosen after the bake, by updating the answer;
    cluster.sh is skipped by updates (pyproject.toml), whatever the template's version says."""
    template = template_repo(tmp_path, tools)
    call([CRUFT, "create", template, "--no-input", "--output-dir", tmp_path / "out",
          "--extra-context", '{"scheduler": "slurm"}'], tmp_path, tools)
    project = tmp_path / "out" / "my_ddp_experiment"
    assert "--partition" not in (project / "slurm.sbatch").read_text()
    call(["git", "init", "-q"], project, tools)
    commit(project, "Baked from the template", tools)
    with open(project / "cluster.sh", "a") as handle:
        handle.write("module load cuda/12.4\n")
    mine = (project / "cluster.sh").read_text()
    commit(project, "My cluster", tools)
    with open(template / SLUG_DIR / "cluster.sh", "a") as handle:  # where the user appended
        handle.write(STUB_CHANGE)
    commit(template, "A later cluster.sh", tools)

    updated = call([CRUFT, "update", "-y", "--variables-to-update",
                    '{"slurm_partition": "gpu", "slurm_time": "2-00:00:00"}'], project, tools)
    assert conflicts(project) == [], updated.stdout
    sbatch = (project / "slurm.sbatch").read_text()
    assert "#SBATCH --partition=gpu\n" in sbatch and "#SBATCH --time=2-00:00:00\n" in sbatch
    assert (project / "cluster.sh").read_text() == mine
    answers = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert (answers["slurm_partition"], answers["slurm_time"]) == ("gpu", "2-00:00:00")
    status = call(["git", "status", "--porcelain"], project, tools).stdout.splitlines()
    assert sorted(line[3:] for line in status) == [".cruft.json", "slurm.sbatch"], status
