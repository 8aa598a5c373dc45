"""A baked project passes its own test suite and lints clean, as a user would run them.

The template's marker expression carries over: `-m "not slow"` (the quick tier) runs the baked
suite's quick tests only. The baked suite runs its test files in two pytest-xdist workers (one
per core of a CI machine), started in the background as soon as the session has collected this
test (conftest.BakedSuite): much of a multi-process test's time is one process starting up while
the other core idles, and the template's other tests run on it meanwhile. This test comes last
and waits for the suite."""

import sys

from conftest import run


def test_baked_project_suite_and_lint(baked_suite):
    assert baked_suite.bake_error is None, baked_suite.bake_error
    lint = run([sys.executable, "-m", "ruff", "check", "--no-cache", "."],
               cwd=baked_suite.project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    status, output = baked_suite.result()
    print(output[-6000:])  # its slowest tests, any skip and why (`pytest -rP` shows it)
    assert status == 0, output
    assert " passed" in output and "failed" not in output
    # The README's install skips the tests of optional features, naming their extras; they ran
    # again where every extra is installed, and passed.
    readme_install, _, every_extra = output.partition("== the tests it skipped")
    assert "needs the transformers extra" in readme_install, readme_install[-3000:]
    summary = every_extra.split("short test summary")[-1]
    assert " passed" in every_extra and "skipped" not in summary, every_extra[-3000:]
