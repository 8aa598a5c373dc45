"""A baked project set up with uv instead of pip: `uv sync` with torch pinned, then
`uv run ./run.sh` trains in the environment uv made (its own .venv, not this one).

uv does not read pip's settings. This machine's CPU build of torch lies in pip's find-links
folder (PIP_FIND_LINKS); the test hands that folder to uv (UV_FIND_LINKS), as a user would hand
it an index of the build they want. Without a local wheel of the pinned torch, uv would download
a CUDA build of several GB from PyPI: the test is skipped then, saying so."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

UV = Path(sys.executable).parent / "uv"
TORCH = torch.__version__.split("+")[0]  # this environment's torch: the pin of the test


def local_torch_wheels() -> str | None:
    folders = [f for f in os.environ.get("PIP_FIND_LINKS", "").split() if Path(f).is_dir()]
    if any(Path(f).glob(f"torch-{TORCH}*.whl") for f in folders):
        return " ".join(folders)
    return None


def uv_env(**extra: str) -> dict:
    # Not this test environment's venv or interpreter: the project's own, made by uv.
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYTHON", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NPROC_PER_NODE="2", **extra)
    return env


def test_uv_sync_with_a_pinned_torch_then_uv_run_trains(cookies, tmp_path):
    if not UV.is_file():
        pytest.skip(f"uv is not installed in {UV.parent} (requirements-dev.txt pins it)")
    wheels = local_torch_wheels()
    if wheels is None:
        pytest.skip(f"no local wheel of torch {TORCH} in PIP_FIND_LINKS: uv would download a "
                    "CUDA build of several GB from PyPI")
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)
    pyproject = project / "pyproject.toml"
    text, pinned = re.subn(r'"torch[^"]*"', f'"torch=={TORCH}"', pyproject.read_text(), count=1)
    assert pinned == 1
    pyproject.write_text(text)
    env = uv_env(UV_FIND_LINKS=wheels, UV_PYTHON=sys.base_prefix + "/bin/python3")

    def uv(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([str(UV), *args], cwd=project, env=env, text=True, check=False,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)

    synced = uv("sync")
    if synced.returncode and re.search(r"(?i)failed to fetch|network|dns|connect", synced.stdout):
        pytest.skip(f"uv cannot install here (no package index): {synced.stdout.splitlines()[-1]}")
    assert synced.returncode == 0, synced.stdout
    assert (project / "uv.lock").is_file()
    where = uv("run", "python", "-c", "import torch; print(torch.__version__, torch.__file__)")
    assert where.returncode == 0, where.stdout
    assert where.stdout.startswith(TORCH) and str(project / ".venv") in where.stdout, where.stdout

    output = tmp_path / "runs"
    trained = uv("run", "./run.sh", "train.epochs=2", f"run.output_dir={output}")
    assert trained.returncode == 0, trained.stdout
    assert "2 process(es)" in trained.stdout and "done:" in trained.stdout, trained.stdout
    (run_dir,) = output.iterdir()
    assert (run_dir / "model.pt").is_file()
    shutil.rmtree(project / ".venv")  # a GB of packages: not kept in the test's tmp folder
