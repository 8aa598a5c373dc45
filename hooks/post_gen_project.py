"""Finish the bake: make the launch script executable and say what to do next."""

import stat
from pathlib import Path

project = Path.cwd()
if "{{ cookiecutter.scheduler }}" != "slurm":
    (project / "slurm.sbatch").unlink()  # files that do not apply are not generated
for script in ("run.sh", "slurm.sbatch"):
    path = project / script
    if path.exists():
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

print(f"""
Created {project}

Next steps:
  cd {project}
  python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'
  ./run.sh                      # train: {{ cookiecutter.gpus_per_node }} process(es) per node, {{ cookiecutter.num_nodes }} node(s){% if cookiecutter.scheduler == "slurm" %}
  sbatch slurm.sbatch           # the same under SLURM{% endif %}
  ./run.sh evaluate.py eval.checkpoint=runs/<run folder>
  tensorboard --logdir runs
See README.md for swapping in your own model and data.
""")
