"""Where the job can run, and what each launcher runs there, read from the launcher's own file:

    python -m ddpkit.targets [--config FILE] [key=value ...]

prints, for torchrun (run.sh), SLURM (slurm.sbatch), Kubernetes (launch/trainjob.yaml) and
SkyPilot (launch/sky.yaml): nodes x processes, the command each node runs, the config file and
the folder the run and its checkpoints go to (run.dir, else a new folder under run.output_dir);
then checks that each can work (exit 2 and one line if not): each key it reads from a launch file
has its type (ddpkit/launch_file.py), the global batch splits over its processes, its GPU count
is at least 1, its run folder lies on the volume or bucket it declares once `..` is resolved (a
pod's or a VM's own disk goes with it), and it starts a preempted job again (exit status
PREEMPTED). The arguments are those the job would be given (run.sh's), after the launcher's own.

The contract every launcher keeps with run.sh is here, once: PREEMPTED, CLUSTER_RUNS (where a
Kubernetes volume or a SkyPilot bucket is mounted) and how a node's command reaches run.sh.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from ddpkit.launch_file import COUNT, MAPPING, TEXT, WHOLE, WHOLES, WORDS, Kind, LaunchFile
from ddpkit.project import PREEMPTED_EXIT as PREEMPTED
from ddpkit.project import UserError

CLUSTER_RUNS = "/runs"  # the volume (Kubernetes) or bucket (SkyPilot) that keeps the run folders
DEFAULT_CONFIG = "configs/default.yaml"
GPU = "nvidia.com/gpu"  # the resource a Kubernetes node's GPUs are asked for by
ENV_ITEM = Kind("a mapping of name: and value:, e.g. {name: RDZV_ID, value: my-job}",
                MAPPING.read)
ACCELERATORS = Kind("one GPU type with its count, e.g. H100:8",
                    lambda value: value if isinstance(value, str | dict) else None)


@dataclasses.dataclass(frozen=True)
class Target:
    """What one launcher runs: on `nodes` machines, `processes` each, `command` on every node."""

    name: str
    file: str
    nodes: int
    processes: int
    command: list[str]
    storage: list[str]  # the folders that outlive a node (a volume's or a bucket's mount point)
    restarts_on: bool  # it starts the job again when run.sh exits PREEMPTED

    def arguments(self) -> list[str]:
        """run.sh's arguments in the command: what follows run.sh (or launch/node.sh SYSTEM)."""
        words = self.command
        for marker, skip in (("launch/node.sh", 2), ("./run.sh", 1)):
            if marker in words:
                return [word for word in words[words.index(marker) + skip:] if word != '"$@"']
        return []


def number(pattern: str, text: str, file: str, what: str) -> int:
    found = re.search(pattern, text, re.M)
    if not found:
        raise UserError(f"{file}: {what} not found: restore it from the template")
    return int(found[1])


def run_sh(project: Path) -> Target:
    text = (project / "run.sh").read_text()
    nodes = number(r'NNODES:-([0-9]+)\}"', text, "run.sh", "the NNODES default")
    processes = number(r'NPROC_PER_NODE:-([0-9]+)\}"', text, "run.sh",
                       "the NPROC_PER_NODE default")
    return Target("torchrun", "run.sh", nodes, processes, ["./run.sh"], [], False)


def slurm(project: Path) -> Target:
    text = (project / "slurm.sbatch").read_text()
    file = "slurm.sbatch"
    gpus = number(r"^#SBATCH --gpus-per-node=([0-9]+)", text, file, "#SBATCH --gpus-per-node")
    processes = number(r'NPROC_PER_NODE:-([0-9]+)\}"', text, file, "the NPROC_PER_NODE default")
    if gpus != processes:
        raise UserError(f"{file} asks for {gpus} GPU(s) per node but starts {processes} "
                        "process(es) on each: make --gpus-per-node and NPROC_PER_NODE the same")
    # srun starts run.sh on every node with sbatch's arguments; the run folders are where the
    # cluster's shared file system has them (not checked: any path may be on it).
    return Target("SLURM", file, number(r"^#SBATCH --nodes=([0-9]+)", text, file,
                                        "#SBATCH --nodes"), processes, ["./run.sh"], [],
                  f'"$status" -eq {PREEMPTED} ]]' in text and "scontrol requeue" in text)


def kubernetes(project: Path) -> Target:
    job = LaunchFile(project, "launch/trainjob.yaml")
    trainer = ("spec", "trainer")
    env = {job.read((*item, "name"), TEXT): job.read((*item, "value"), TEXT, None)
           for item in job.items((*trainer, "env"), ENV_ITEM)}
    name = job.read(("metadata", "name"), TEXT)
    if env.get("RDZV_ID") != name:
        raise UserError(f"{job.name}: the RDZV_ID variable ({env.get('RDZV_ID')}) is not the "
                        "TrainJob's name: make it the same, so that the job applied again finds "
                        "its run folder")
    pod = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec",
           "replicatedJobs", 0, "template", "spec", "template", "spec")
    mounts = [job.read((*mount, "mountPath"), TEXT)
              for container in job.items((*pod, "containers"), MAPPING)
              for mount in job.items((*container, "volumeMounts"), MAPPING)]
    # The Kubeflow controller restarts failed pods (the runtime's failure policy); a job that
    # exited PREEMPTED is applied again under its name and resumes.
    return Target("Kubernetes", job.name, job.read((*trainer, "numNodes"), WHOLE),
                  job.read((*trainer, "resourcesPerNode", "limits", GPU), COUNT),
                  job.read((*trainer, "command"), WORDS), mounts, True)


def skypilot(project: Path) -> Target:
    task = LaunchFile(project, "launch/sky.yaml")
    file = task.name
    accelerators = task.read(("resources", "accelerators"), ACCELERATORS)
    if isinstance(accelerators, dict) and len(accelerators) == 1:
        count = next(iter(accelerators.values()))
    else:
        count = str(accelerators).rpartition(":")[2]
    if not re.fullmatch("[0-9]+", str(count)):
        raise UserError(f"{file}: resources.accelerators={accelerators} is not one GPU type "
                        "with its count, e.g. H100:8")
    lines = [line for line in task.read(("run",), TEXT).splitlines()
             if "launch/node.sh" in line]
    if len(lines) != 1:
        raise UserError(f"{file}: the run block must run launch/node.sh skypilot once, as the "
                        "template wrote it")
    codes = task.read(("resources", "job_recovery", "recover_on_exit_codes"), WHOLES, [])
    return Target("SkyPilot", file, task.read(("num_nodes",), WHOLE, 1), int(count),
                  shlex.split(lines[0]), [str(path) for path in
                                          task.read(("file_mounts",), MAPPING, {})],
                  PREEMPTED in codes)


READERS = (run_sh, slurm, kubernetes, skypilot)


def config_file(args: list[str]) -> str:
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--config":
            return value
    return DEFAULT_CONFIG


def run_folder(cfg) -> tuple[str, str]:
    """The key that places the run folder (run.dir, else run.output_dir) and the folder as the
    run makes it: run.dir itself, else a new folder under run.output_dir; `..` and `.` resolved
    as the file system does on the node."""
    if cfg.run.dir:
        return "run.dir", posixpath.normpath(cfg.run.dir)
    return "run.output_dir", posixpath.join(posixpath.normpath(cfg.run.output_dir), "<run>")


def check_storage(target: Target, cfg, key: str, folder: str) -> None:
    """A run folder off the volume or bucket `target` mounts is refused: it goes with the node."""
    if not target.storage or any(
            folder == mount or folder.startswith(mount.rstrip("/") + "/")
            for mount in map(posixpath.normpath, target.storage)):
        return
    given = OmegaConf.select(cfg, key)
    where = posixpath.normpath(given)
    meaning = f" (that is {where})" if where != given.rstrip("/") else ""
    use = f"{key}={target.storage[0]}" if key == "run.output_dir" else (
        f"a {key} under {target.storage[0]}")
    raise UserError(f"{target.file}: {key}={given}{meaning} is not on the volume or bucket it "
                    f"mounts ({', '.join(target.storage)}): checkpoints there would go with the "
                    f"node; use {use}")


def check(target: Target, args: list[str]) -> str:
    """The run folder of `target` given run.sh's `args`; UserError for one that cannot work."""
    from ddpkit.config import load_config
    where = f"{target.file} ({target.nodes} node(s) x {target.processes} process(es))"
    if target.processes < 1 or target.nodes < 1:
        raise UserError(f"{where}: give at least 1 node and 1 GPU per node (processes per node "
                        "follow the GPUs): a job of 0 processes cannot start")
    if target.file != "run.sh" and not target.restarts_on:
        raise UserError(f"{target.file} does not start the job again when it exits "
                        f"{PREEMPTED} (preempted, checkpoint saved): restore that from the "
                        "template")
    try:
        cfg = load_config([*target.arguments(), *args],
                          world_size=target.nodes * target.processes)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    key, folder = run_folder(cfg)
    check_storage(target, cfg, key, folder)
    return folder


def table(project: Path, args: list[str]) -> list[str]:
    """One line per launcher; UserError at the first that cannot work."""
    lines = []
    for reader in READERS:
        target = reader(project)
        folder = check(target, args)
        every = [*target.arguments(), *args]
        lines.append(f"{target.name + ':':<13} {target.file:<21} {target.nodes} x "
                     f"{target.processes}  each node: {shlex.join([*target.command, *args])}  "
                     f"config {config_file(every)}  checkpoints {folder}/checkpoints")
    return lines


def main(argv: list[str]) -> int:
    try:
        lines = table(Path.cwd(), argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"exit status {PREEMPTED}: preempted with a checkpoint saved; each cluster launcher "
          "starts the job again and it resumes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
