"""Room sizes a maintainer can hold in their head: every engine module at most 500 lines and
run.sh at most 200 (the template's own tests hold every function to 60). A change that passes one
splits by concern."""

from conftest import PROJECT

MODULE_LINES, RUN_SH_LINES = 500, 200


def test_no_engine_module_passes_500_lines():
    long = {str(path.relative_to(PROJECT)): n for path in sorted((PROJECT / "ddpkit").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert long == {}


def test_run_sh_stays_a_launcher():
    assert len((PROJECT / "run.sh").read_text().splitlines()) <= RUN_SH_LINES
