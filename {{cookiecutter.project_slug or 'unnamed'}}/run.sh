#!/usr/bin/env bash
# Launch training (or another entry point) with torchrun, one process per GPU.
#
#   ./run.sh                                  # train.py with configs/default.yaml
#   ./run.sh train.epochs=50 optim.lr=0.001   # key=value overrides, checked before launch
#   ./run.sh evaluate.py eval.checkpoint=runs/<run>
#
# Environment (defaults from the project's generation):
#   NPROC_PER_NODE  processes on this machine (default {{ cookiecutter.gpus_per_node }})
#   NNODES          machines in the job (default {{ cookiecutter.num_nodes }}); 1 uses torchrun --standalone
#   MASTER_ADDR     several nodes: the head node's address, the same on every node
#   MASTER_PORT     several nodes: the rendezvous port on the head node (default 29500)
#   RDZV_ID         several nodes: a job id, the same on every node and new for every job
#                   (default $SLURM_JOB_ID); a restarted job finds its run folder by it
#   NODE_RANK       optional: 0 on the head node makes the preflight check the port is free
#   MAX_RESTARTS    restarts of failed workers (default 3); train.py resumes from the latest
#                   checkpoint. 0 while debugging.
#
# OMP_NUM_THREADS defaults to this machine's cores divided by the processes (at least 1), so
# the processes do not oversubscribe the CPU and torchrun does not warn about it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

nproc_per_node="${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}"
max_restarts="${MAX_RESTARTS:-3}"
nnodes="${NNODES:-{{ cookiecutter.num_nodes }}}"
python="${PYTHON:-python3}"

if ! [[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC_PER_NODE=$nproc_per_node is not valid: it must be a whole number of processes, at least 1" >&2
  exit 2
fi
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NNODES=$nnodes is not valid: it must be a whole number of machines, at least 1" >&2
  exit 2
fi
if ! [[ "$max_restarts" =~ ^[0-9]+$ ]]; then
  echo "error: MAX_RESTARTS=$max_restarts is not valid: it must be a whole number, 0 or more" >&2
  exit 2
fi

script=train.py
if [[ $# -gt 0 && "$1" == *.py ]]; then
  script="$1"
  shift
fi
if [[ ! -f "$script" ]]; then
  echo "error: $script not found in $(pwd): run train.py, evaluate.py or another script of this project" >&2
  exit 2
fi

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  threads=$((cores / nproc_per_node))
  export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
fi

# Restarted workers must not share torchrun's rendezvous store: with it shared, a restarted
# worker can read a peer address left by the previous attempt and fail to connect
# (pytorch/pytorch#135712). Each attempt then gets a fresh store, hosted by its rank 0.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

if [[ "$nnodes" -eq 1 ]]; then
  rendezvous=(--standalone --nnodes=1)
  endpoint=""
else
  rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-}}"
  if [[ -z "${MASTER_ADDR:-}" || -z "$rdzv_id" ]]; then
    echo "error: NNODES=$nnodes needs MASTER_ADDR (the head node's address) and RDZV_ID (a job id), the same on every node" >&2
    exit 2
  fi
  endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
  rendezvous=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id")
fi

# Check the command line and this machine before any worker starts: one line, in a second.
"$python" preflight.py --nproc-per-node "$nproc_per_node" --nnodes "$nnodes" --script "$script" \
  --endpoint "$endpoint" --node-rank "${NODE_RANK:-}" "$@"

# A mistake in the input (a bad checkpoint, say) is reported once by rank 0, which also writes it
# here; the workers then exit 0, so torchrun neither restarts them (the mistake would only come
# back) nor prints its failure report, and this script exits 2.
error_file="$(mktemp "${TMPDIR:-/tmp}/run-sh-error.XXXXXX")"
trap 'rm -f "$error_file"' EXIT
export RUN_SH_ERROR_FILE="$error_file"

status=0
torchrun "${rendezvous[@]}" --nproc_per_node="$nproc_per_node" \
  --max-restarts="$max_restarts" "$script" "$@" || status=$?
if [[ -s "$error_file" ]]; then
  exit 2
fi
exit "$status"
