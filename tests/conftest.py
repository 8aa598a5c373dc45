"""Helpers for the template's tests: bake projects and run their commands for real."""

import os
import re
import subprocess
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
UNRENDERED = re.compile(r"\{\{|\{%|\{#")


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
