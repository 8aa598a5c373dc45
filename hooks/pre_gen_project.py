"""Check every answer before any file is written; cookiecutter removes the folder on failure.

Each problem is reported as one line naming the prompt and what it accepts, then exit 1.
"""

import keyword
import re
import sys

# tojson renders each answer as a JSON string, which is also a valid Python string literal,
# whatever quotes or backslashes the answer holds.
ANSWERS = {
    "project_name": {{ cookiecutter.project_name | string | tojson }},
    "project_slug": {{ cookiecutter.project_slug | string | tojson }},
    "gpus_per_node": {{ cookiecutter.gpus_per_node | string | tojson }},
    "num_nodes": {{ cookiecutter.num_nodes | string | tojson }},
    "scheduler": {{ cookiecutter.scheduler | string | tojson }},
    "slurm_partition": {{ cookiecutter.slurm_partition | string | tojson }},
    "slurm_account": {{ cookiecutter.slurm_account | string | tojson }},
    "slurm_time": {{ cookiecutter.slurm_time | string | tojson }},
    "accelerator": {{ cookiecutter.accelerator | string | tojson }},
    "runs_storage": {{ cookiecutter.runs_storage | string | tojson }},
}
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 4096
SCHEDULERS = ("none", "slurm")
SLURM_NAME = r"[A-Za-z0-9_.-]+"
# A SkyPilot accelerator name (H100, A100-80GB, tpu-v5e-8), without its count.
ACCELERATOR = r"[A-Za-z][A-Za-z0-9_.-]*"
# A name both a Kubernetes PersistentVolumeClaim (DNS-1123 label) and a bucket accept.
STORAGE = r"[a-z0-9]([a-z0-9-]{1,61}[a-z0-9])"
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.
SLURM_TIME = r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}"


def problems(answers: dict) -> list[str]:
    found = []
    if not answers["project_name"].strip():
        found.append("project_name is empty: give the project a name, e.g. 'My DDP Experiment'")
    slug = answers["project_slug"]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", slug):
        found.append(
            f"project_slug {slug!r} is not a valid Python identifier: use letters, digits and "
            "underscores, not starting with a digit, e.g. my_ddp_experiment"
        )
    elif keyword.iskeyword(slug) or keyword.issoftkeyword(slug):
        found.append(f"project_slug {slug!r} is a Python keyword: pick another name, e.g. {slug}_exp")
    gpus = answers["gpus_per_node"].strip()
    if not re.fullmatch(r"[0-9]+", gpus) or not 1 <= int(gpus) <= MAX_GPUS_PER_NODE:
        found.append(
            f"gpus_per_node {gpus!r} is not valid: give a whole number from 1 to "
            f"{MAX_GPUS_PER_NODE} (the processes torchrun starts on each machine)"
        )
    nodes = answers["num_nodes"].strip()
    if not re.fullmatch(r"[0-9]+", nodes) or not 1 <= int(nodes) <= MAX_NODES:
        found.append(
            f"num_nodes {nodes!r} is not valid: give a whole number from 1 to {MAX_NODES} "
            "(the machines one job runs on)"
        )
    if answers["scheduler"] not in SCHEDULERS:
        found.append(
            f"scheduler {answers['scheduler']!r} is not valid: choose one of {', '.join(SCHEDULERS)}"
        )
    # runs_storage's default follows project_slug: a wrong slug is told once, not twice.
    slug_ok = not any(line.startswith("project_slug") for line in found)
    return found + slurm_problems(answers) + cloud_problems(answers, storage=slug_ok)


def cloud_problems(answers: dict, storage: bool) -> list[str]:
    """launch/'s answers: an accelerator name and a storage name Kubernetes and buckets accept."""
    found = []
    if not re.fullmatch(ACCELERATOR, answers["accelerator"]):
        found.append(
            f"accelerator {answers['accelerator']!r} is not valid: give a GPU type without its "
            "count, e.g. H100, A100-80GB or L4 (the count is gpus_per_node)"
        )
    if storage and not re.fullmatch(STORAGE, answers["runs_storage"]):
        found.append(
            f"runs_storage {answers['runs_storage']!r} is not valid: use 3 to 63 lowercase "
            "letters, digits and -, starting and ending with a letter or digit, e.g. my-exp-runs"
        )
    return found


def slurm_problems(answers: dict) -> list[str]:
    """The #SBATCH lines' answers: names SLURM accepts (empty: the cluster's default) and a time."""
    found = []
    partition, account = answers["slurm_partition"], answers["slurm_account"]
    if partition and not re.fullmatch(rf"{SLURM_NAME}(,{SLURM_NAME})*", partition):
        found.append(
            f"slurm_partition {partition!r} is not valid: use letters, digits, _ . - (several "
            "partitions separated by commas), e.g. gpu or gpu,gpu-long; empty for the default"
        )
    if account and not re.fullmatch(SLURM_NAME, account):
        found.append(
            f"slurm_account {account!r} is not valid: use letters, digits, _ . -, e.g. "
            "proj-1234; empty for your default account"
        )
    if not re.fullmatch(SLURM_TIME, answers["slurm_time"]):
        found.append(
            f"slurm_time {answers['slurm_time']!r} is not valid: give minutes, HH:MM:SS or "
            "D-HH:MM:SS (also MM:SS, D-HH, D-HH:MM), e.g. 24:00:00 or 2-00:00:00"
        )
    return found


if __name__ == "__main__":
    errors = problems(ANSWERS)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    sys.exit(1 if errors else 0)
