"""Finish the bake: make the launch script executable and say what to do next."""

import re
import stat
from pathlib import Path

project = Path.cwd()
processes = int("{{ cookiecutter.gpus_per_node }}") * int("{{ cookiecutter.num_nodes }}")


def fit_default_batch(world: int) -> None:
    """The default global batch (64) must split evenly over every process of the bake, or the
    printed first command would stop at its own preflight: round it up to a multiple of the
    process count, in the schema and in the YAML that shows it (ddpkit/schema.py stays plain Python)."""
    batch = -(-64 // world) * world
    if batch == 64:
        return
    for name, pattern, replacement in (
            ("ddpkit/schema.py", r"global_batch_size: int = setting\(64\b",
             f"global_batch_size: int = setting({batch}"),
            ("configs/default.yaml", r"global_batch_size: 64\b", f"global_batch_size: {batch}")):
        path = project / name
        text, count = re.subn(pattern, replacement, path.read_text())
        assert count == 1, f"{name}: the default global batch size was not found"
        path.write_text(text)


fit_default_batch(processes)
# Every bake carries every launcher (slurm.sbatch, launch/): the answers only set their defaults,
# so that a project baked for one machine can move to a cluster without baking again.
for script in ("run.sh", "run_replicas.sh", "slurm.sbatch", "launch/node.sh"):
    path = project / script
    if path.exists():
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

# Every printed command works as printed on this machine. A project made for several nodes
# starts there with NNODES=1 (run.sh alone would stop: it needs the head node's address and a job
# id); the job across the nodes is sbatch's, or README's "Several machines".
if int("{{ cookiecutter.num_nodes }}") == 1:
    here, train = "./run.sh", "train: {{ cookiecutter.gpus_per_node }} process(es)"
else:
    here = "NNODES=1 ./run.sh"
    train = ("train on this machine alone: {{ cookiecutter.gpus_per_node }} process(es); all "
             "{{ cookiecutter.num_nodes }} nodes: README, Several machines")
launches = [f"  {here:<29} # {train}",
            "  sbatch slurm.sbatch           # train under SLURM: {{ cookiecutter.num_nodes }} "
            "node(s) x {{ cookiecutter.gpus_per_node }} GPU(s)"]
if "{{ cookiecutter.scheduler }}" == "slurm":  # the one answer the scheduler prompt sets
    launches.reverse()
launch_lines = "\n".join(launches)
print(f"""
Created {project}

Next steps:
  cd {project}
  python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'
{launch_lines}
  {here} evaluate.py eval.checkpoint=runs/<run folder>
  tensorboard --logdir runs
  python -m ddpkit.targets      # what SLURM, Kubernetes and SkyPilot (launch/) each run
See README.md for swapping in your own model and data.
""")
