"""Finish the bake: make the launch script executable and say what to do next."""

import stat
from pathlib import Path

project = Path.cwd()
for script in ("run.sh",):
    path = project / script
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

print(f"""
Created {project}

Next steps:
  cd {project}
  python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'
  ./run.sh                      # train with {{ cookiecutter.gpus_per_node }} process(es) per node
  ./run.sh evaluate.py eval.checkpoint=runs/<run folder>
  tensorboard --logdir runs
See README.md for swapping in your own model and data.
""")
