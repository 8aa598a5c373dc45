"""Baking: answers flow into the files that need them, and nothing of Jinja is left over."""

import ast
import os
import shlex
import stat
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import TEMPLATE, run, unrendered_files

EXPECTED_FILES = {
    # the commands and the user's recipe files, on top
    "README.md", "pyproject.toml", "run.sh", ".gitignore", "configs/default.yaml", "train.py",
    "evaluate.py", "export.py", "sweep.py", "report.py", "check_equivalence.py", "config.py",
    "model.py", "data_sources.py", "tasks.py", "settings.py",
    # every launcher, whatever the answers: SLURM, Kubernetes, SkyPilot and the image
    "slurm.sbatch", "cluster.sh", ".dockerignore", "launch/node.sh", "launch/trainjob.yaml",
    "launch/sky.yaml", "launch/Containerfile",
    # the engine, in one package
    *(f"ddpkit/{name}.py" for name in (
        "__init__", "project", "recipes", "config", "dist_utils", "data", "splits", "datasets",
        "models", "tasks", "parallel", "speed", "checkpoint", "training_log", "evaluation",
        "metrics", "flops", "profiling", "preflight", "report",
        "run_setup", "run_state", "run_end", "resume_settings", "optimizers", "schedules", "smoke",
        "utilization", "equivalence", "validation", "schema", "run_folder", "writes", "position",
        "checkpoint_files", "checkpoint_load", "exits", "supervisor", "lifecycle", "worker",
        "launcher", "targets")),
    # optional features, imported only when used
    *(f"ddpkit/extras/{name}.py" for name in (
        "__init__", "sweep/__init__", "sweep/space", "sweep/folder", "sweep/checks", "sweep/local",
        "sweep/slurm", "sweep/optuna_search", "sweep/summary", "sweep/main", "trackers",
        "replicas/__init__", "replicas/launch", "replicas/groups", "elastic",
        "kubeflow_progress")),
    "tests/conftest.py", "tests/fixtures.py",
    "tests/test_config.py", "tests/test_data.py", "tests/test_dist_utils.py",
    "tests/test_distributed.py", "tests/test_examples.py", "tests/test_metrics.py",
    "tests/probes.py", "tests/test_faults.py", "tests/fail_at_step.py", "tests/test_launch.py",
    "tests/test_speed.py", "tests/test_experiments.py", "tests/test_training_log.py",
    "tests/test_cluster.py", "tests/stall_at_step.py", "tests/preempt_in_validation.py",
    "tests/test_fsdp.py", "tests/reshard_probe.py", "tests/test_sweep.py",
    "tests/test_tracking.py", "tests/test_optimization.py", "tests/test_equivalence.py",
    "tests/equivalence_models.py", "tests/test_batches.py", "tests/test_validation.py",
    "tests/test_launchers.py",
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
    # Hugging Face models are an extra (and part of `all`), not a dependency.
    assert not any(dep.startswith("transformers") for dep in meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert extras["transformers"] == ["transformers>=4.46"]
    # dev is the test tools alone; `all` brings every optional feature (issue 43).
    assert not any("transformers" in dep for dep in extras["dev"])
    assert any("transformers" in dep for dep in extras["all"])

    run_sh = project / "run.sh"
    assert os.stat(run_sh).st_mode & stat.S_IXUSR
    gpus = answers.get("gpus_per_node", "2")
    assert f'nproc_per_node="${{NPROC_PER_NODE:-{gpus}}}"' in run_sh.read_text()
    assert "torchrun --standalone" in run_sh.read_text()
    assert answers.get("project_name", "My DDP Experiment") in (project / "README.md").read_text()


# The #SBATCH lines the slurm_* answers write.
SLURM_CHOICES = ("#SBATCH --partition", "#SBATCH --account", "#SBATCH --time")


def shellcheck(*paths):
    return run([Path(sys.executable).parent / "shellcheck", *paths], cwd=TEMPLATE, timeout=60)


def test_slurm_bake_asks_for_the_nodes_and_gpus_and_passes_shellcheck(cookies):
    result = cookies.bake(extra_context={"num_nodes": "4", "gpus_per_node": "8",
                                         "scheduler": "slurm"})
    assert result.exit_code == 0, result.exception
    project = result.project_path
    sbatch = (project / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=4\n" in sbatch and "#SBATCH --gpus-per-node=8\n" in sbatch
    assert "#SBATCH --ntasks-per-node=1\n" in sbatch
    assert "#SBATCH --time=24:00:00\n" in sbatch  # no partition or account: the defaults
    assert "--partition" not in sbatch and "--account" not in sbatch
    assert 'nnodes="${NNODES:-4}"' in (project / "run.sh").read_text()
    assert os.stat(project / "slurm.sbatch").st_mode & stat.S_IXUSR
    assert unrendered_files(project) == []
    checked = shellcheck(project / "run.sh", project / "run_replicas.sh", project / "slurm.sbatch",
                         project / "cluster.sh")
    assert checked.returncode == 0, checked.stdout
    # A sweep's SLURM job array, as sweep.py writes it (--dry-run: written, not submitted).
    written = run([sys.executable, "sweep.py", "--slurm", "--dry-run", "--name", "lr", "--nproc",
                   "8", "optim.lr=1e-3,3e-3,1e-2", "train.epochs=5"], cwd=project, timeout=60)
    assert written.returncode == 0, written.stdout
    array = project / "runs" / "sweeps" / "lr" / "array.sbatch"
    lines = array.read_text().splitlines()
    assert "#SBATCH --array=0,1,2" in lines and "#SBATCH --nodes=1" in lines  # a node per trial
    assert [line for line in lines if line.startswith("#SBATCH --gpus-per-node")] == [
        "#SBATCH --gpus-per-node=8"]
    # The rest of the job is slurm.sbatch's: its settings, its environment and requeue.
    assert "#SBATCH --time=24:00:00" in lines and "#SBATCH --requeue" in lines
    assert lines[-1] == 'exec bash ./slurm.sbatch "${trial[@]}"' and "srun" not in array.read_text()
    checked = shellcheck(array)
    assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize(
    ("answers", "lines"),
    [({"slurm_partition": "gpu", "slurm_account": "proj-1234", "slurm_time": "2-00:00:00"},
      ["#SBATCH --partition=gpu", "#SBATCH --account=proj-1234", "#SBATCH --time=2-00:00:00"]),
     ({"slurm_partition": "gpu,gpu-long", "slurm_time": "90"},
      ["#SBATCH --partition=gpu,gpu-long", "#SBATCH --time=90"])],
    ids=["all-three", "partitions-and-minutes"],
)
def test_slurm_answers_become_sbatch_lines(cookies, capfd, answers, lines):
    result = cookies.bake(extra_context={"scheduler": "slurm", **answers})
    assert result.exit_code == 0, result.exception
    printed = [line.split()[0] for line in capfd.readouterr().out.splitlines()
               if line.startswith(("  sbatch ", "  ./run.sh "))]
    assert printed[:2] == ["sbatch", "./run.sh"]  # scheduler=slurm: the next steps lead with it
    sbatch = (result.project_path / "slurm.sbatch").read_text().splitlines()
    assert [line for line in sbatch if line.startswith(SLURM_CHOICES)] == lines
    # A sweep's job array asks for the same partition, account and time.
    written = run([sys.executable, "sweep.py", "--slurm", "--dry-run", "--name", "lr",
                   "optim.lr=1e-3,3e-3"], cwd=result.project_path, timeout=60)
    assert written.returncode == 0, written.stdout
    array = result.project_path / "runs" / "sweeps" / "lr" / "array.sbatch"
    assert [line for line in array.read_text().splitlines()
            if line.startswith(SLURM_CHOICES)] == lines


def test_default_bake_can_reach_slurm(cookies, capfd):
    """scheduler=none (the default) still carries slurm.sbatch and cluster.sh: the answer only
    says what the README leads with."""
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    printed = capfd.readouterr().out.splitlines()  # the next steps the bake prints
    sbatch_line = "  sbatch slurm.sbatch           # train under SLURM: 1 node(s) x 2 GPU(s)"
    assert sbatch_line in printed
    assert printed.index(sbatch_line) == printed.index(next(
        line for line in printed if line.startswith("  ./run.sh "))) + 1  # run.sh first
    sbatch = (project / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in sbatch and "#SBATCH --gpus-per-node=2\n" in sbatch
    for name in ("slurm.sbatch", "launch/node.sh"):
        assert os.stat(project / name).st_mode & stat.S_IXUSR
    # A sweep's job array runs slurm.sbatch, there in every project.
    written = run([sys.executable, "sweep.py", "--slurm", "--dry-run", "--name", "lr",
                   "optim.lr=1e-3,3e-3"], cwd=project, timeout=60)
    assert written.returncode == 0, written.stdout
    assert (project / "runs" / "sweeps" / "lr" / "array.sbatch").is_file()


def test_the_baked_code_reads_in_screens(cookies):
    """No function of the baked project is over 60 lines; train.py is at most 150 lines, has no
    nested function, and its loop over epochs and steps fits on one screen (40 lines)."""
    project = cookies.bake().project_path
    lengths = {}
    for path in project.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                where = f"{path.relative_to(project)}:{node.lineno} {node.name}"
                lengths[where] = node.end_lineno - node.lineno + 1
    assert len(lengths) > 300  # every module was read
    assert {where: n for where, n in lengths.items() if n > 60} == {}
    source = (project / "train.py").read_text()
    assert len(source.splitlines()) <= 150
    trainer = ast.parse(source)
    nested = [f"{outer.name} > {getattr(inner, 'name', 'lambda')}"
              for outer in ast.walk(trainer) if isinstance(outer, ast.FunctionDef)
              for inner in ast.walk(outer)
              if inner is not outer and isinstance(inner, ast.FunctionDef | ast.Lambda)]
    assert nested == []
    # The loop over epochs: the one while loop of train.py, with the loop over steps inside it.
    (epochs_loop,) = [node for node in ast.walk(trainer) if isinstance(node, ast.While)]
    assert any(isinstance(node, ast.For) for node in ast.walk(epochs_loop))
    assert epochs_loop.end_lineno - epochs_loop.lineno + 1 <= 40


@pytest.mark.slow
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


def test_two_nodes_of_three_gpus_get_a_global_batch_for_six_processes(tmp_path):
    result = run([sys.executable, "-m", "cookiecutter", TEMPLATE, "--no-input", "--output-dir",
                  tmp_path, "gpus_per_node=3", "num_nodes=2"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout
    project = tmp_path / "my_ddp_experiment"
    assert "global_batch_size: 66\n" in (project / "configs" / "default.yaml").read_text()
    assert "global_batch_size: int = setting(66," in (project / "ddpkit" / "schema.py").read_text()


def printed_commands(stdout: str) -> list[list[str]]:
    """The run.sh commands among a bake's printed next steps, comments left off."""
    return [shlex.split(line.split("#")[0]) for line in stdout.splitlines()
            if "./run.sh" in line.split("#")[0]]


def test_a_one_node_bake_of_three_gpus_prints_run_sh_first(tmp_path):
    result = run([sys.executable, "-m", "cookiecutter", TEMPLATE, "--no-input", "--output-dir",
                  tmp_path, "gpus_per_node=3"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout
    assert printed_commands(result.stdout)[0] == ["./run.sh"]
    project = tmp_path / "my_ddp_experiment"
    assert 'nproc_per_node="${NPROC_PER_NODE:-3}"' in (project / "run.sh").read_text()
    assert "global_batch_size: 66\n" in (project / "configs" / "default.yaml").read_text()


def test_a_bake_for_two_nodes_says_how_to_start_on_one_machine(tmp_path):
    result = run([sys.executable, "-m", "cookiecutter", TEMPLATE, "--no-input", "--output-dir",
                  tmp_path, "gpus_per_node=3", "num_nodes=2"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout
    assert printed_commands(result.stdout)[0] == ["NNODES=1", "./run.sh"]
    project = tmp_path / "my_ddp_experiment"
    assert "NNODES=1 ./run.sh " in (project / "README.md").read_text()  # its quick start too
    # run.sh as it is, without NNODES: stopped before anything starts, with the way to go on.
    plain = run(["./run.sh"], cwd=project, timeout=60)
    assert plain.returncode == 2
    assert plain.stdout.strip().splitlines() == [
        "error: NNODES=2 needs MASTER_ADDR (the head node's address) and RDZV_ID (a job id), the "
        "same on every node; to run on this machine alone, start it as NNODES=1 ./run.sh"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("answers", "env", "processes", "batch"),
    # The printed first command of a 2-node bake runs this machine's 3 processes of the job: the
    # same run.sh and config as a 1-node bake of 3 GPUs (test_a_one_node_bake_of_three_gpus_...).
    [({"gpus_per_node": "3", "num_nodes": "2"}, {}, 3, 66),
     # Two nodes of three run as six processes on this one machine.
     ({"gpus_per_node": "3", "num_nodes": "2"}, {"NPROC_PER_NODE": "6"}, 6, 66)],
    ids=["3-gpus-2-nodes", "3-gpus-2-nodes-as-6-processes"],
)
def test_bake_trains_with_its_defaults_as_printed(tmp_path, answers, env, processes, batch):
    result = run([sys.executable, "-m", "cookiecutter", TEMPLATE, "--no-input", "--output-dir",
                  tmp_path, *(f"{k}={v}" for k, v in answers.items())], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout
    first = printed_commands(result.stdout)[0]  # the first command the bake tells the user to run
    assert first[-1] == "./run.sh"
    assignments = dict(word.split("=", 1) for word in first[:-1])  # NNODES=1 for several nodes
    project = tmp_path / "my_ddp_experiment"
    # One epoch of the defaults (30 are many minutes of CPU): launch, batch split, training,
    # validation, checkpoint and export are all in it.
    trained = run([*first[-1:], "train.epochs=1"], cwd=project, timeout=600, **assignments,
                  **env)
    assert trained.returncode == 0, trained.stdout
    assert (f"effective global batch {batch} = {batch // processes} per micro-batch x "
            f"{processes} process(es)") in trained.stdout
