"""Helpers for the template's tests: bake projects and run their commands for real."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1]
UNRENDERED = re.compile(r"\{\{|\{%|\{#")
# A block of one of the baked project's recipes: `<!-- [name ]recipe: action -->`, then the fenced
# code. The README's recipe ("Bring your own") has no name; the others are in docs/recipes/.
RECIPE_BLOCK = re.compile(
    r"<!-- (?:(?P<recipe>\w+) )?recipe: (?P<action>.+?) -->\n```\w*\n(?P<body>.*?)```", re.S)


def command_env(**extra: str) -> dict:
    """This interpreter's tools first on PATH (torchrun, ruff), one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(args: list, cwd: Path, timeout: float = 600, **extra_env: str):
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=command_env(**extra_env), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False,
    )


def unrendered_files(project: Path) -> list[str]:
    found = []
    for path in sorted(project.rglob("*")):
        if path.is_file() and UNRENDERED.search(path.read_text(errors="replace")):
            found.append(str(path.relative_to(project)))
    return found


def recipe_blocks(project: Path, recipe: str = "") -> list[tuple[str, str]]:
    """One recipe's blocks, in order: (action, body) pairs. They are found in the project's README
    and its docs/recipes/*.md pages, and must all be in one of them."""
    pages = [project / "README.md", *sorted((project / "docs" / "recipes").glob("*.md"))]
    found = {page.relative_to(project): [
        (m["action"], m["body"]) for m in RECIPE_BLOCK.finditer(page.read_text())
        if (m["recipe"] or "") == recipe] for page in pages}
    holding = [page for page, blocks in found.items() if blocks]
    assert len(holding) == 1, f"recipe {recipe!r} has blocks in {holding or 'no page'}"
    return found[holding[0]]


def apply_edit(project: Path, action: str, body: str) -> None:
    """Apply one file edit of the recipe, literally: `create FILE`, `append FILE` or
    `insert FILE after "LINE"` (LINE: a whole line of the file, its indentation included)."""
    verb, _, rest = action.partition(" ")
    name, _, anchor = rest.partition(" after ")
    path = project / name
    if verb == "create":
        path.write_text(body)
    elif verb == "append":
        path.write_text(path.read_text().rstrip("\n") + "\n\n\n" + body)
    elif verb == "insert":
        lines = path.read_text().splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.rstrip() == anchor.strip('"'))
        path.write_text("".join(lines[:at + 1]) + body + "".join(lines[at + 1:]))
    else:
        raise AssertionError(f"unknown recipe action {action!r}")


BAKED_SUITE = "tests/test_baked_project.py::test_baked_project_suite_and_lint"
# Seconds from its start: a hang fails the test instead of the CI run. A guard against hangs,
# not the suite's time goal (CONTRIBUTING.md): on a CI machine the suite shares both cores with
# the template's other tests: 2480 s for its first part alone in a fresh-clone run (12-08).
SUITE_LIMIT = 3600
# A skipped test's reason, in the baked suite, when it needs an optional part a user installs
# (tests/conftest.py's needs_extra there: "needs the mlflow extra: pip install ...").
NEEDS = re.compile(r"\bneeds (the \w+ extra|kubeflow-trainer-api)\b")


def readme_install_venv(folder: Path, project: Path) -> Path:
    """A virtual environment that holds what the baked README installs, and nothing else: torch
    (the version of this environment, the CPU build that pip finds here: the README has the user
    install torch first) and the project with its [dev] extra. uv installs them: pip's
    resolution, unpacked once into its cache and linked from there on later calls."""
    import torch

    uv = Path(sys.executable).parent / "uv"
    wheels = folder.with_name(f"{folder.name}-wheels")  # pip's own search finds the torch wheel
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels,
                    f"torch=={torch.__version__.split('+')[0]}"], check=True, timeout=600,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, folder], check=True,
                   timeout=120)
    subprocess.run([uv, "pip", "install", "-q", "--python", folder / "bin" / "python",
                    *sorted(wheels.glob("torch-*.whl")), "-e", f"{project}[dev]"], check=True,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    shutil.rmtree(wheels)
    return folder / "bin" / "python"


def skipped_for_extras(junit: Path, project: Path) -> list[str]:
    """The tests of a run (its JUnit XML) skipped because an optional part is missing: node ids,
    or a file's path where its whole module was skipped."""
    import xml.etree.ElementTree as ElementTree

    found = []
    for case in ElementTree.parse(junit).iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or not NEEDS.search(f"{skipped.get('message')} {skipped.text}"):
            continue
        if not case.get("classname"):  # a module skipped at collection: its name is its path
            found.append(case.get("name").replace(".", "/") + ".py")
            continue
        parts = case.get("classname").split(".")
        at = next(i for i in range(len(parts), 0, -1)  # the module's path, then its classes
                  if (project / Path(*parts[:i])).with_suffix(".py").is_file())
        found.append("::".join(["/".join(parts[:at]) + ".py", *parts[at:], case.get("name")]))
    return found


class BakedSuite:
    """The baked project's own test suite, started as soon as the session has collected its test
    and run in the background (a thread of its own). Its two xdist workers leave a core idle much
    of the time (a multi-process test waits on its processes starting up); the template's other
    tests, run meanwhile, use it. Its test, ordered last, waits for it.

    It runs as a user runs it: in a virtual environment holding the README's install alone
    (torch and `-e '.[dev]'`), where the tests of optional features skip, naming their extra;
    then those tests run again here, where every extra is installed."""

    def __init__(self, markers: str):
        self.root = Path(tempfile.mkdtemp(prefix="baked-suite-"))
        self.markers = markers
        bake = run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", self.root / "bake",
                    TEMPLATE], cwd=self.root, timeout=120)
        self.bake_error = None if bake.returncode == 0 else bake.stdout  # its test says it
        self.project = self.root / "bake" / "my_ddp_experiment"
        self.log = self.root / "suite.log"
        self.started = time.monotonic()
        self.process: subprocess.Popen | None = None  # the step running now
        self.status: int | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        if not self.bake_error:
            self.thread.start()

    def _pytest(self, python, *args: str, title: str) -> int:
        with open(self.log, "a") as log:
            log.write(f"== {title}\n")
            log.flush()
            self.process = subprocess.Popen(
                [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                 "loadfile", "-rs", "--durations=20",
                 *(["-m", self.markers] if self.markers else []), *args],
                cwd=self.project, env=command_env(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        return -1 if self.stopping else self.process.wait()

    def _run(self) -> None:
        try:
            python = readme_install_venv(self.root / "venv", self.project)
            junit = self.root / "readme-install.xml"
            status = self._pytest(python, f"--junitxml={junit}",
                                  title="the README's install: torch and -e '.[dev]'")
            extras = skipped_for_extras(junit, self.project) if junit.is_file() else []
            if status == 0 and extras and not self.stopping:
                status = self._pytest(sys.executable, *extras,
                                      title="the tests it skipped, with every extra installed")
            self.status = status
        except Exception as error:  # noqa: BLE001 (the suite's test reports it)
            with open(self.log, "a") as log:
                log.write(f"the baked suite could not run: {error!r}\n")
            self.status = -1

    def result(self) -> tuple[int, str]:
        """Its exit status and output, once it has ended (a failure past SUITE_LIMIT)."""
        limit = max(1.0, self.started + SUITE_LIMIT - time.monotonic())
        self.thread.join(timeout=limit)
        if self.thread.is_alive():  # what it printed so far says where it was
            tail = self.log.read_text()[-6000:] if self.log.is_file() else ""
            raise AssertionError(f"the baked suite ran past {SUITE_LIMIT} s; its output so "
                                 f"far ends:\n{tail}")
        return self.status, self.log.read_text()

    def stop(self) -> None:
        self.stopping = True
        if self.process and self.process.poll() is None:  # ended early: its processes go too
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.thread.join(timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


SUITE = pytest.StashKey[BakedSuite]()


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid == BAKED_SUITE)  # last: it waits for the suite


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(
            item.nodeid == BAKED_SUITE for item in session.items):
        session.config.stash[SUITE] = BakedSuite(session.config.getoption("markexpr"))


def pytest_unconfigure(config):
    if SUITE in config.stash:
        config.stash[SUITE].stop()


@pytest.fixture
def baked_suite(request) -> BakedSuite:
    return request.config.stash[SUITE]
