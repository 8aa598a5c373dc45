"""The project's layout: the commands and your recipe files on top, the engine in ddpkit/, and the
imports between them going one way only (your files import the engine, never the reverse)."""

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import PROJECT, TINY, command_env
from ddpkit.recipes import RECIPES, SETTINGS

YOURS = {SETTINGS, *RECIPES}


def module_names(root: Path) -> dict[str, Path]:
    """The project's modules by import name: the top-level files and the engine package's, its
    sub-packages' included (ddpkit/extras/sweep/main.py is ddpkit.extras.sweep.main)."""
    names = {path.stem: path for path in root.glob("*.py")}
    for path in (root / "ddpkit").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if path.stem == "__init__" else parts)] = path
    return names


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    names = module_names(root)
    return {name: imported_names(path) & names.keys() - {name} for name, path in names.items()}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph as a path of names, or [] when it has none."""
    done, stack = set(), []

    def visit(name: str) -> list[str]:
        if name in stack:
            return stack[stack.index(name):] + [name]
        if name in done:
            return []
        stack.append(name)
        for target in sorted(graph[name]):
            if found := visit(target):
                return found
        stack.pop()
        done.add(name)
        return []

    for name in sorted(graph):
        if found := visit(name):
            return found
    return []


def test_the_engine_never_imports_your_files_and_nothing_imports_in_a_cycle():
    graph = import_graph(PROJECT)
    engine = {name for name in graph if name.startswith("ddpkit")}
    assert len(engine) > 15 and graph.keys() >= YOURS  # every module was read
    assert {name: sorted(graph[name] - engine) for name in engine if graph[name] - engine} == {}
    assert cycle(graph) == []
    assert len([name for name in graph if name not in engine]) <= 12  # the top level stays short


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def project_copy(tmp_path: Path) -> Path:
    """The project's code and configs in a folder of its own, for a test that breaks a file."""
    copy = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "runs", "data", ".*")
    shutil.copytree(PROJECT, copy, ignore=ignore)
    return copy


def launch(project: Path, nproc: int) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="tr", dir=os.environ.get("TMPDIR")) as tmp:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", "train.py", *TINY, "train.epochs=1"],
            cwd=project, env=command_env(TMPDIR=tmp), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=240, check=False)


RENAMES = {("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")}


def renames_in(path: Path) -> list[str]:
    """Where a file renames a file or folder itself: os.replace / os.rename / shutil.move, or a
    path's .rename(x) / .replace(x) (one argument: a str's replace takes two, and
    dataclasses.replace is no rename)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        by_module = (owner, node.func.attr) in RENAMES
        by_path = node.func.attr in ("rename", "replace") and len(node.args) == 1 and (
            owner not in ("os", "shutil", "dataclasses"))
        if by_module or by_path:
            found.append(f"{path.relative_to(PROJECT)}:{node.lineno}")
    return found


def test_files_are_renamed_into_place_only_by_the_atomic_write_helper():
    """Writing whole or not at all is one helper's (ddpkit/writes.py): every writer hands it a
    function that writes a temporary path, and nothing else renames files into place."""
    writer = PROJECT / "ddpkit" / "writes.py"
    sources = [*PROJECT.glob("*.py"), *(PROJECT / "ddpkit").rglob("*.py")]
    found = [place for path in sources if path != writer for place in renames_in(path)]
    assert found == []
    assert renames_in(writer)  # (the check sees the helper's own)


@pytest.mark.slow
def test_a_syntax_error_in_your_model_file_is_one_line_from_rank_0(tmp_path):
    project = project_copy(tmp_path)
    model = project / "model.py"
    lines = model.read_text().splitlines()
    model.write_text("\n".join([*lines, "", "def broken(:", "    pass", ""]))
    result = launch(project, 2)  # a bare torchrun: run.sh's preflight would stop it earlier
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == [f"error: model.py line {len(lines) + 2}: invalid syntax: fix that line "
                      "of your file"], result.stdout
    # No rank prints a Python traceback of it (bare torchrun still reports its workers' exit).
    assert "SyntaxError" not in result.stdout and 'model.py", line' not in result.stdout


def test_an_import_the_template_moved_is_one_line_naming_the_new_one(tmp_path):
    project = project_copy(tmp_path)
    tasks = project / "tasks.py"
    tasks.write_text(tasks.read_text() + "from builtin_tasks import TASKS  # noqa: E402\n")
    result = subprocess.run([sys.executable, "train.py", *TINY], cwd=project, env=command_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        "error: tasks.py imports builtin_tasks, which the template moved to ddpkit.tasks: write "
        "`from ddpkit.tasks import ...` at the top of your file (README: Taking template "
        "updates)"], result.stdout


OPTIONAL = ("torchft", "optuna", "mlflow", "wandb", "transformers", "datasets", "torchao")


def test_a_default_run_imports_no_optional_feature():
    # Optional features sit behind one seam each (ddpkit/extras/), imported only when enabled:
    # a default run loads none of their packages, nor the extras themselves.
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py",
                             "train.fast_dev_run=true", *TINY], cwd=PROJECT, env=command_env(),
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "ddpkit.run_setup" in imported  # what is read is -X importtime's table
    loaded = sorted(name for name in imported
                    if name.split(".")[0] in OPTIONAL or name.startswith("ddpkit.extras"))
    assert loaded == []
