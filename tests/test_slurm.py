"""A default bake's slurm.sbatch on a real one-node SLURM cluster (Debian's slurmctld, slurmd
and munge, started here by scripts/slurm_cluster.sh and stopped after): the job is preempted
with `scancel --signal=TERM`, checkpoints the step it reached, requeues itself and finishes
with the same weights and epoch metrics as an uninterrupted run."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TEMPLATE, command_env, run

pytestmark = pytest.mark.slow

# The baked project's small test model and data, 10 epochs of 9 steps, checkpoints only at the
# end (whatever the preemption saves, it saved on its own) and a validation long enough to land
# in now and then.
ARGS = ["data.dataset=tests/fixtures.py:vectors", "model.name=tests/fixtures.py:mlp",
        "model.hidden_dim=32", "train.global_batch_size=12", "train.epochs=10",
        "train.log_every=1", "train.ckpt_every=0", "data.val_fraction=0.5", "eval.batch_size=1",
        "optim.warmup_steps=5", "optim.lr=0.01", "train.progress_bar=false"]


ACTIVATED = "cluster.sh activated .venv on node "


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("starting SLURM's daemons (and installing them) needs root")
    folder = tmp_path_factory.mktemp("slurm")
    env = {"SLURM_CLUSTER_DIR": str(folder / "cluster"),
           "SLURM_CONF": str(folder / "cluster" / "slurm.conf")}
    script = TEMPLATE / "scripts" / "slurm_cluster.sh"
    started = subprocess.run(["bash", str(script), "start"], env={**os.environ, **env},
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=900, check=False)
    try:
        assert started.returncode == 0, started.stdout
        yield env
    finally:
        subprocess.run(["bash", str(script), "stop"], env={**os.environ, **env}, timeout=120,
                       check=False)


def job_state(job: str, env: dict) -> dict:
    """`scontrol show job` as a dict (finished jobs stay listed for a few minutes)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def logged_steps(output_dir: Path) -> int:
    logs = list(output_dir.glob("*/train_log.jsonl"))
    return len(logs[0].read_text().splitlines()) if logs else 0


def wait(condition, what: str, timeout: float, job: str, env: dict, project: Path):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            out = project / f"slurm-{job}.out"
            raise AssertionError(f"timed out waiting for {what}; job: {job_state(job, env)}\n"
                                 f"{out.read_text() if out.exists() else '(no output file)'}")
        time.sleep(0.05)


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)["model"]


def epoch_records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_seconds")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sbatch_preempted_requeues_itself_and_finishes_as_if_uninterrupted(
        cluster, cookies, tmp_path):
    baked = cookies.bake()  # the default answers (scheduler=none): every bake has slurm.sbatch
    assert baked.exit_code == 0, baked.exception
    project = baked.project_path
    # cluster.sh as baked activates the project's .venv on the node: a stand-in that says so.
    (project / ".venv" / "bin").mkdir(parents=True)
    (project / ".venv" / "bin" / "activate").write_text(f'echo "{ACTIVATED}$SLURM_NODEID"\n')
    reference = run(["./run.sh", *ARGS, f"run.dir={tmp_path / 'reference'}"], cwd=project,
                    NPROC_PER_NODE="2")
    assert reference.returncode == 0, reference.stdout

    # sbatch passes this environment on to the job: the test's Python and torchrun on PATH.
    env = command_env(**cluster, MASTER_PORT=str(free_port()))
    submitted = subprocess.run(["sbatch", "--parsable", "slurm.sbatch", *ARGS,
                                f"run.output_dir={tmp_path / 'runs'}"], cwd=project, env=env,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=60, check=False)
    assert submitted.returncode == 0, submitted.stdout
    job = submitted.stdout.strip().split(";")[0]
    wait(lambda: logged_steps(tmp_path / "runs") >= 30, "30 logged steps", 300, job, env,
         project)
    subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True, timeout=60)

    wait(lambda: job_state(job, env).get("JobState") == "COMPLETED", "the requeued job to "
         "finish", 600, job, env, project)
    state = job_state(job, env)
    assert state["Restarts"] == "1", state  # requeued once, by slurm.sbatch itself
    output = (project / f"slurm-{job}.out").read_text()  # both runs of the job (--open-mode)
    saved = re.search(r"preempted: saved step (\d+)", output)
    assert saved and output.count("preempted: saved step") == 1, output
    assert f"requeueing job {job}" in output, output
    run_dir = next((tmp_path / "runs").iterdir())
    assert f"resumed from {run_dir}/checkpoints/step-{int(saved[1]):08d}:" in output, output
    assert "Traceback" not in output, output
    assert output.count(f"{ACTIVATED}0") == 2, output  # in the srun step of both runs

    resumed, expected = final_weights(run_dir), final_weights(tmp_path / "reference")
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert epoch_records(run_dir) == epoch_records(tmp_path / "reference")


def test_a_sweep_runs_as_a_job_array_and_its_summary_ranks_the_trials(cluster, cookies,
                                                                      tmp_path):
    baked = cookies.bake()
    assert baked.exit_code == 0, baked.exception
    project = baked.project_path
    short = [*ARGS, "train.epochs=2", "eval.batch_size=64"]
    # One process and one of the node's two GPUs per trial: SLURM runs both elements at once.
    submitted = run([sys.executable, "sweep.py", "--slurm", "--name", "lr", "--out", tmp_path,
                     "--nproc", "1", "--cpus-per-task", "2", "optim.lr=0.01,0.03", *short],
                    cwd=project, timeout=120, **cluster)
    assert submitted.returncode == 0, submitted.stdout
    job = re.search(r"submitted job array (\d+)", submitted.stdout)
    assert job, submitted.stdout
    env = command_env(**cluster)
    folder = tmp_path / "lr"

    def finished(index: int) -> bool:
        summary = folder / f"trial-00{index}" / "summary.json"
        return summary.is_file() and json.loads(summary.read_text())["status"] == "done"

    def ended(index: int) -> bool:
        return job_state(f"{job[1]}_{index}", env).get("JobState") == "COMPLETED"

    wait(lambda: ended(0) and ended(1), "both array elements to complete", 300, job[1], env,
         project)
    assert finished(0) and finished(1)
    summary = run([sys.executable, "sweep.py", "--summary", folder], cwd=project, timeout=120)
    assert summary.returncode == 0, summary.stdout
    rows = (folder / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",finished," in row for row in rows[1:])
    again = run([sys.executable, "sweep.py", "--slurm", "--name", "lr", "--out", tmp_path,
                 "--nproc", "1", "--cpus-per-task", "2", "optim.lr=0.01,0.03", *short],
                cwd=project, timeout=120, **cluster)
    assert again.returncode == 0 and "every trial finished" in again.stdout, again.stdout


def output_of_a_setup_mistake(project: Path, env: dict, *args: str) -> str:
    """Submit slurm.sbatch; the job must fail with status 2 (a mistake in the setup: not
    requeued). Returns its output."""
    submitted = subprocess.run(["sbatch", "--parsable", "slurm.sbatch", *args], cwd=project,
                               env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=60, check=False)
    assert submitted.returncode == 0, submitted.stdout
    job = submitted.stdout.strip().split(";")[0]
    wait(lambda: job_state(job, env).get("JobState") == "FAILED", "the job to fail", 120, job,
         env, project)
    assert job_state(job, env)["ExitCode"] == "2:0"
    return (project / f"slurm-{job}.out").read_text()


def test_a_failing_cluster_sh_stops_the_job_in_one_line(cluster, cookies):
    baked = cookies.bake()
    assert baked.exit_code == 0, baked.exception
    project = baked.project_path
    with open(project / "cluster.sh", "a") as handle:
        handle.write("source /no/such/env/bin/activate\necho 'not reached'\n")
    output = output_of_a_setup_mistake(project, command_env(**cluster))
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: cluster.sh failed on \S+ \(status 1\): fix it and submit again",
        errors[0]), output
    assert "not reached" not in output and "requeueing" not in output, output


def test_without_cluster_sh_the_job_runs_in_sbatchs_environment(cluster, cookies):
    # A project that took slurm.sbatch from `cruft update` has no cluster.sh (updates skip it):
    # run.sh runs, here to its own one line about the command.
    project = cookies.bake().project_path
    (project / "cluster.sh").unlink()
    output = output_of_a_setup_mistake(project, command_env(**cluster), "train.epochs=none")
    assert [line for line in output.splitlines() if line.startswith("error:")] == [
        "error: train.epochs=none is not valid (command line): train.epochs must be a whole "
        "number"], output


def test_an_elastic_minimum_above_the_nodes_asked_for_is_one_line(cluster, cookies):
    # MIN_NODES=2 where the job asks for 1 node
    baked = cookies.bake()
    assert baked.exit_code == 0, baked.exception
    project = baked.project_path
    output = output_of_a_setup_mistake(project, command_env(MIN_NODES="2", **cluster))
    assert output.strip().splitlines() == [
        "error: MIN_NODES=2 is not valid: give a whole number of nodes from 1 to the job's 1"]


def test_torchft_replica_groups_run_as_a_job(cluster, cookies, tmp_path):
    # TORCHFT=1: the lighthouse on the first node, a replica group per node (here, one).
    baked = cookies.bake()
    assert baked.exit_code == 0, baked.exception
    project = baked.project_path
    env = command_env(TORCHFT="1", NPROC_PER_NODE="2", LIGHTHOUSE_PORT=str(free_port()),
                      **cluster)
    submitted = subprocess.run(["sbatch", "--parsable", "slurm.sbatch", *ARGS, "train.epochs=2",
                                "eval.batch_size=64", f"run.output_dir={tmp_path / 'runs'}"],
                               cwd=project, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=60, check=False)
    assert submitted.returncode == 0, submitted.stdout
    job = submitted.stdout.strip().split(";")[0]
    wait(lambda: job_state(job, env).get("JobState") == "COMPLETED", "the job to finish", 300,
         job, env, project)
    output = (project / f"slurm-{job}.out").read_text()
    assert "replica group 0 of 1: joined at step 0 with 1 group(s) live" in output, output
    run_dir = tmp_path / "runs" / f"digits-mlp-{job}"  # named by the job id the groups share
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
    steps = [json.loads(line) for line in
             (run_dir / "replica_groups" / "group-0.jsonl").read_text().splitlines()]
    assert [record["groups"] for record in steps[:-1]] == [1] * 18  # 2 epochs of 9 steps
    assert "weights_sha256" in steps[-1]
