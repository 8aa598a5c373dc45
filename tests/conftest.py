"""Helpers for the template's tests: bake projects and run their commands for real."""

import os
import re
import subprocess
import sys
from pathlib import Path

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
