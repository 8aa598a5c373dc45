# shellcheck shell=bash
# Your cluster set-up. slurm.sbatch sources this file on every node of the job, in the project
# folder, before run.sh starts there. It is yours: the template wrote it once, and `cruft update`
# never changes it (pyproject.toml's [tool.cruft] skip).
#
# Put here what the workers need on a node: module loads, the activation of your environment,
# variables (NCCL_*, data paths). It runs under `set -e`: a command that fails stops the job
# with one line naming this file. For example:
#
#   module load cuda/12.4
#   source ~/miniforge3/bin/activate my-env
#   export NCCL_SOCKET_IFNAME=ib0

# The project's virtual environment if there is one (python3 -m venv .venv, or uv sync); else
# the environment sbatch was called from, which SLURM passes on to the job.
if [[ -f .venv/bin/activate ]]; then
  # shellcheck source=/dev/null
  source .venv/bin/activate
fi
