"""Baking: answers flow into the files that need them, and nothing of Jinja is left over."""

import os
import stat
import sys
import tomllib

import pytest
from conftest import TEMPLATE, run, unrendered_files

EXPECTED_FILES = {
    "README.md", "pyproject.toml", "run.sh", ".gitignore", "config.py", "configs/default.yaml",
    "data.py", "dist_utils.py", "evaluate.py", "model.py", "train.py", "tests/conftest.py",
    "tests/test_config.py", "tests/test_data.py", "tests/test_dist_utils.py",
    "tests/test_distributed.py", "tests/probes.py", "metrics.py", "check_equivalence.py",
    "tests/test_faults.py", "tests/fail_at_step.py",
}


@pytest.mark.parametrize(
    "answers",
    [
        {},
        {"gpus_per_node": "1"},
        {"gpus_per_node": "8", "project_name": "Vision Transformer Sweep"},
        {"project_name": "Ünïcode 'quoted' \"name\"", "author": 'Ada "Countess" O\'Brien',
         "project_slug": "odd_names"},
    ],
    ids=["defaults", "one-gpu", "eight-gpus", "odd-quotes"],
)
def test_bake_renders_everything(cookies, answers):
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == 0, result.exception
    project = result.project_path
    files = {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}
    assert EXPECTED_FILES <= files
    assert unrendered_files(project) == []

    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["name"] == answers.get("project_slug", project.name)
    assert meta["authors"] == [{"name": answers.get("author", "Your Name")}]
    assert any(dep.startswith("torch>=") for dep in meta["dependencies"])

    run_sh = project / "run.sh"
    assert os.stat(run_sh).st_mode & stat.S_IXUSR
    gpus = answers.get("gpus_per_node", "2")
    assert f'nproc_per_node="${{NPROC_PER_NODE:-{gpus}}}"' in run_sh.read_text()
    assert "torchrun --standalone" in run_sh.read_text()
    assert answers.get("project_name", "My DDP Experiment") in (project / "README.md").read_text()


def test_cli_bake_with_eight_gpus_launches_eight_processes(tmp_path):
    result = run([sys.executable, "-m", "cookiecutter", TEMPLATE, "--no-input",
                  "--output-dir", tmp_path, "gpus_per_node=8"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout
    project = tmp_path / "my_ddp_experiment"
    assert unrendered_files(project) == []
    # Really launch: 8 gloo processes on this CPU, one short epoch on synthetic data.
    result = run(["./run.sh", "data.dataset=synthetic", "data.synthetic_samples=400",
                  "model.hidden_dim=16", "train.epochs=1", "train.global_batch_size=32",
                  "train.progress_bar=false", f"run.output_dir={tmp_path / 'runs'}"],
                 cwd=project, timeout=300)
    assert result.returncode == 0, result.stdout
    assert "8 process(es) on cpu, backend gloo" in result.stdout
