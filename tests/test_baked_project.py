"""A baked project passes its own test suite and lints clean, as a user would run them."""

import sys

from conftest import run


def test_baked_project_suite_and_lint(cookies):
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    suite = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project)
    assert suite.returncode == 0, suite.stdout
    assert " passed" in suite.stdout and "failed" not in suite.stdout
