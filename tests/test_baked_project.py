"""A baked project passes its own test suite and lints clean, as a user would run them.

The template's marker expression carries over: `-m "not slow"` (the quick tier) runs the baked
suite's quick tests only. The baked suite runs its test files in two pytest-xdist workers (one
per core of a CI machine): much of a multi-process test's time is one process starting up while
the other core idles."""

import sys

from conftest import run


def test_baked_project_suite_and_lint(cookies, request):
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    markers = request.config.getoption("markexpr")
    suite = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                 "--dist", "loadfile", "-rs", "--durations=20",
                 *(["-m", markers] if markers else [])], cwd=project, timeout=1800)
    print(suite.stdout[-6000:])  # its slowest tests, any skip and why (`pytest -rP` shows it)
    assert suite.returncode == 0, suite.stdout
    assert " passed" in suite.stdout and "failed" not in suite.stdout
