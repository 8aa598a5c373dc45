"""What `pip install -e '.[dev]'` pulls into an environment that already has torch: the project's
own dependencies and the test tools (pytest, pytest-xdist, ruff), with what each of them needs,
and none of the optional features' packages (trackers, Hugging Face, torchft).

pip resolves the bake twice without installing anything (--dry-run --report): with its [dev]
extra, and with the three tools named instead. --ignore-installed makes it resolve as in a clean
environment; torch is held to this environment's release, as a user who installed torch first
has it. Needs a package index (CI has PyPI); skipped without one, saying so."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # two resolutions against the index: about 30 s

TEST_TOOLS = ("pytest", "pytest-xdist", "ruff")
# The optional features' packages (their extras), and others a first day does not need.
NOT_FOR_DEV = ("mlflow", "mlflow-skinny", "wandb", "transformers", "torchft", "datasets",
               "lightning", "pytorch-lightning")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(project: Path, pin: Path, *requirements: str) -> set[str]:
    """The distributions pip would install for `requirements` in a clean environment."""
    report = project.parent / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--constraint", str(pin), *requirements],
        cwd=project, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
        check=False)
    if done.returncode and re.search(r"(?i)network|connection|resolve host|timed out|No matching "
                                     r"distribution found for (setuptools|pytest)", done.stdout):
        pytest.skip(f"pip cannot reach a package index here: {done.stdout.splitlines()[-1]}")
    assert done.returncode == 0, done.stdout
    return {canonical(item["metadata"]["name"]) for item in json.loads(report.read_text())[
        "install"]}


def test_dev_extra_is_the_dependencies_and_the_test_tools_only(cookies, tmp_path):
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)
    pin = tmp_path / "torch.txt"
    pin.write_text(f"torch=={torch.__version__.split('+')[0]}\n")

    with_dev = resolved(project, pin, "-e", ".[dev]")
    named = resolved(project, pin, "-e", ".", *TEST_TOOLS)
    print("pip install -e '.[dev]' pulls:", " ".join(sorted(with_dev)))
    assert sorted(with_dev & set(NOT_FOR_DEV)) == []
    assert with_dev == named, (sorted(with_dev - named), sorted(named - with_dev))
    assert set(TEST_TOOLS) <= with_dev
