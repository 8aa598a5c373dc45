"""Every bake's launchers (run.sh, slurm.sbatch, launch/trainjob.yaml, launch/sky.yaml,
launch/Containerfile): they agree on what they run for several answers, and each passes its
system's own checks, offline: the TrainJob through the Kubeflow Trainer API's models and back
(a key the models do not know would be dropped without a word by the cluster's client), the
SkyPilot task through SkyPilot's task schema (tests/schemas/), the Containerfile through hadolint
and every script through shellcheck. The tools are in requirements-dev.txt.

tests/schemas/skypilot-0.14.1-task.json is skypilot 0.14.1's task schema with its resources
schema in place (`sky.Task.from_yaml` checks the two in turn); made in a venv with skypilot:
    from sky.utils import schemas
    task = schemas.get_task_schema(); task["properties"]["resources"] = schemas.get_resources_schema()
    json.dumps(task, indent=1, sort_keys=True)
"""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, run

SKY_SCHEMA = TEMPLATE / "tests" / "schemas" / "skypilot-0.14.1-task.json"
TOOLS = Path(sys.executable).parent
# (nodes, GPUs per node): one and several of each, the default 1 x 2 among them.
SHAPES = [("1", "2"), ("1", "1"), ("1", "8"), ("4", "1"), ("4", "8")]
ROW = re.compile(r"(?P<name>\S+): +(?P<file>\S+) +(?P<nodes>\d+) x (?P<processes>\d+)  each node: "
                 r"(?P<command>.+)  config (?P<config>\S+)  checkpoints (?P<checkpoints>\S+)")


@pytest.fixture(scope="module")
def bakes(cookies_session) -> dict:
    baked = {}
    for nodes, gpus in SHAPES:
        result = cookies_session.bake(extra_context={"num_nodes": nodes, "gpus_per_node": gpus})
        assert result.exit_code == 0, result.exception
        baked[nodes, gpus] = result.project_path
    return baked


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{g}" for n, g in SHAPES])
def test_the_launchers_agree_on_what_they_run(bakes, shape):
    printed = run([sys.executable, "-m", "ddpkit.targets"], cwd=bakes[shape], timeout=60)
    assert printed.returncode == 0, printed.stdout
    lines = printed.stdout.splitlines()
    rows = [ROW.fullmatch(line) for line in lines[:-1]]
    assert all(rows), lines
    assert [(row["name"], row["file"]) for row in rows] == [
        ("torchrun", "run.sh"), ("SLURM", "slurm.sbatch"), ("Kubernetes", "launch/trainjob.yaml"),
        ("SkyPilot", "launch/sky.yaml")]
    assert {(row["nodes"], row["processes"]) for row in rows} == {shape}
    assert {row["config"] for row in rows} == {"configs/default.yaml"}
    assert [row["command"] for row in rows] == [
        "./run.sh", "./run.sh", "bash launch/node.sh kubeflow run.output_dir=/runs",
        "bash launch/node.sh skypilot run.output_dir=/runs"]
    assert [row["checkpoints"] for row in rows] == [
        "runs/<run>/checkpoints", "runs/<run>/checkpoints", "/runs/<run>/checkpoints",
        "/runs/<run>/checkpoints"]
    assert lines[-1].startswith("exit status 75: preempted with a checkpoint saved")


def test_the_checkpoints_printed_are_in_run_dir(bakes):
    """With run.dir, the run writes its checkpoints in <run.dir>/checkpoints (run_folder.py),
    whatever run.output_dir says: every launcher's row says so, the path normalised."""
    printed = run([sys.executable, "-m", "ddpkit.targets", "run.dir=/runs/./exp1/"],
                  cwd=bakes["1", "2"], timeout=60)
    assert printed.returncode == 0, printed.stdout
    rows = [ROW.fullmatch(line) for line in printed.stdout.splitlines()[:-1]]
    assert [row["checkpoints"] for row in rows] == ["/runs/exp1/checkpoints"] * 4


def trainjob_keys_lost(manifest: dict) -> list[str]:
    """The keys of `manifest` that the Kubeflow Trainer API's models do not keep (a pydantic
    error, such as a string for a number, raises)."""
    from kubeflow_trainer_api import models  # requirements-dev.txt

    again = models.TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()

    def lost(mine, theirs, path: str) -> list[str]:
        if isinstance(mine, dict) and isinstance(theirs, dict):
            return [key for name, value in mine.items() for key in (
                [f"{path}{name}"] if name not in theirs else
                lost(value, theirs[name], f"{path}{name}."))]
        if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
            return [key for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
                    for key in lost(a, b, f"{path[:-1]}[{i}].")]
        return [] if mine == theirs else [path[:-1]]

    return lost(manifest, again, "")


def skypilot_errors(task: dict) -> list[str]:
    """SkyPilot's own check of a task (sky/utils/validator.py: JSON Schema draft 7 with its two
    enum keywords; None values left out, as sky does)."""
    import jsonschema  # requirements-dev.txt

    def enum(fold):
        def check(validator, enums, instance, schema):
            if fold(instance) not in [fold(value) for value in enums]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")
        return check

    validator = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={
        "case_insensitive_enum": enum(str.lower), "case_sensitive_enum": enum(str)})
    task = {key: value for key, value in task.items() if value is not None}
    return [f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
            for error in validator(json.loads(SKY_SCHEMA.read_text())).iter_errors(task)]


@pytest.mark.parametrize("shape", [("1", "2"), ("4", "8")], ids=["1x2", "4x8"])
def test_the_launchers_pass_their_systems_checks(bakes, shape):
    project = bakes[shape]
    assert trainjob_keys_lost(yaml.safe_load((project / "launch/trainjob.yaml").read_text())) == []
    assert skypilot_errors(yaml.safe_load((project / "launch/sky.yaml").read_text())) == []
    linted = run([TOOLS / "hadolint", "launch/Containerfile"], cwd=project, timeout=60)
    assert linted.returncode == 0, linted.stdout
    scripts = ["run.sh", "run_replicas.sh", "slurm.sbatch", "cluster.sh", "launch/node.sh"]
    assert sorted(scripts) == sorted(
        str(path.relative_to(project)) for path in [*project.rglob("*.sh"),
                                                     *project.glob("*.sbatch")])
    checked = run([TOOLS / "shellcheck", *scripts], cwd=project, timeout=60)
    assert checked.returncode == 0, checked.stdout


def test_a_wrong_key_fails_the_checks_by_name(bakes):
    project = bakes["1", "2"]
    manifest = yaml.safe_load((project / "launch/trainjob.yaml").read_text())
    manifest["spec"]["trainer"]["numNode"] = manifest["spec"]["trainer"].pop("numNodes")
    manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volume"] = []
    assert trainjob_keys_lost(manifest) == [
        "spec.trainer.numNode",
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec."
        "template.spec.volume"]
    task = yaml.safe_load((project / "launch/sky.yaml").read_text())
    task["num_node"] = task.pop("num_nodes")
    assert skypilot_errors(task) == [
        "(top): Additional properties are not allowed ('num_node' was unexpected)"]


@pytest.mark.parametrize(
    ("args", "edit", "message"),
    [([], ("launch/trainjob.yaml", 'nvidia.com/gpu: "8"', 'nvidia.com/gpu: "3"'),
      "error: launch/trainjob.yaml (4 node(s) x 3 process(es)): train.global_batch_size=64 does "
      "not divide by the 12 processes: use a multiple of 12, e.g. train.global_batch_size=60"),
     (["train.global_batch_size=48"], None,
      "error: run.sh (4 node(s) x 8 process(es)): train.global_batch_size=48 does not divide by "
      "the 32 processes: use a multiple of 32, e.g. train.global_batch_size=32"),
     (["run.output_dir=/scratch/runs"], None,
      "error: launch/trainjob.yaml: run.output_dir=/scratch/runs is not on the volume or bucket "
      "it mounts (/runs): checkpoints there would go with the node; use run.output_dir=/runs"),
     ([], ("launch/sky.yaml", "H100:8", "H100:0"),
      "error: launch/sky.yaml (4 node(s) x 0 process(es)): give at least 1 node and 1 GPU per "
      "node (processes per node follow the GPUs): a job of 0 processes cannot start"),
     ([], ("launch/sky.yaml", "recover_on_exit_codes: [75]", "recover_on_exit_codes: [1]"),
      "error: launch/sky.yaml does not start the job again when it exits 75 (preempted, "
      "checkpoint saved): restore that from the template"),
     (["run.output_dir=/runs/../scratch"], None,
      "error: launch/trainjob.yaml: run.output_dir=/runs/../scratch (that is /scratch) is not on "
      "the volume or bucket it mounts (/runs): checkpoints there would go with the node; use "
      "run.output_dir=/runs"),
     (["run.dir=/scratch/exp1"], None,
      "error: launch/trainjob.yaml: run.dir=/scratch/exp1 is not on the volume or bucket it "
      "mounts (/runs): checkpoints there would go with the node; use a run.dir under /runs"),
     ([], ("launch/trainjob.yaml", 'nvidia.com/gpu: "8"', 'nvidia.com/gpu: "two"'),
      "error: launch/trainjob.yaml: spec.trainer.resourcesPerNode.limits.nvidia.com/gpu must be "
      'a whole number, e.g. "8", not "two"'),
     ([], ("launch/trainjob.yaml", "- name: RDZV_ID\n        value: my-ddp-experiment",
           "- RDZV_ID=my-ddp-experiment"),
      "error: launch/trainjob.yaml: spec.trainer.env[0] must be a mapping of name: and value:, "
      'e.g. {name: RDZV_ID, value: my-job}, not "RDZV_ID=my-ddp-experiment"'),
     ([], ("launch/sky.yaml", "num_nodes: 4", "num_nodes: two"),
      'error: launch/sky.yaml: num_nodes must be a whole number, e.g. 2, not "two"'),
     ([], ("launch/sky.yaml", "recover_on_exit_codes: [75]", "recover_on_exit_codes: 75"),
      "error: launch/sky.yaml: resources.job_recovery.recover_on_exit_codes must be a list of "
      "whole numbers, e.g. [75], not 75")],
    ids=["gpus-split-no-batch", "batch-split", "runs-off-the-volume", "no-gpus",
         "no-restart-on-75", "runs-leave-the-volume", "run-dir-off-the-volume", "gpus-not-a-number",
         "env-item-not-a-mapping", "nodes-not-a-number", "exit-codes-not-a-list"],
)
def test_a_launch_setting_that_cannot_work_is_one_line(cookies, args, edit, message):
    project = cookies.bake(extra_context={"num_nodes": "4", "gpus_per_node": "8"}).project_path
    if edit:
        name, old, new = edit
        assert old in (project / name).read_text()
        (project / name).write_text((project / name).read_text().replace(old, new))
    printed = run([sys.executable, "-m", "ddpkit.targets", *args], cwd=project, timeout=60)
    assert printed.returncode == 2
    assert printed.stdout.splitlines() == [message]


@pytest.mark.parametrize(
    ("answers", "message"),
    [({"runs_storage": "My_Runs"},
      "runs_storage 'My_Runs' is not valid: use 3 to 63 lowercase letters, digits and -, "
      "starting and ending with a letter or digit, e.g. my-exp-runs"),
     ({"accelerator": "H100:8"},
      "accelerator 'H100:8' is not valid: give a GPU type without its count, e.g. H100, "
      "A100-80GB or L4 (the count is gpus_per_node)")],
    ids=["storage", "accelerator"],
)
def test_a_launcher_answer_that_cannot_work_stops_the_bake(cookies, answers, message, capfd):
    result = cookies.bake(extra_context=answers)
    assert result.exit_code != 0
    assert f"error: {message}" in capfd.readouterr().err.splitlines()
