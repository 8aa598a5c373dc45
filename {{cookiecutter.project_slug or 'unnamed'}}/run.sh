#!/usr/bin/env bash
# Launch training (or another entry point) on this machine with torchrun, one process per GPU.
#
#   ./run.sh                                  # train.py with configs/default.yaml
#   ./run.sh train.epochs=50 optim.lr=0.001   # key=value overrides, checked before launch
#   ./run.sh evaluate.py eval.checkpoint=runs/<run>
#   NPROC_PER_NODE=4 ./run.sh                 # another process count (default: {{ cookiecutter.gpus_per_node }})
#   MAX_RESTARTS=0 ./run.sh                   # do not restart failed workers (default: 3)
#
# When a worker dies (killed, out of memory, an exception), torchrun stops the others and starts
# them all again, up to MAX_RESTARTS times; train.py then resumes from the run's latest checkpoint.
#
# OMP_NUM_THREADS defaults to this machine's cores divided by the processes (at least 1), so
# the processes do not oversubscribe the CPU and torchrun does not warn about it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

nproc_per_node="${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}"
max_restarts="${MAX_RESTARTS:-3}"
python="${PYTHON:-python3}"

if ! [[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC_PER_NODE=$nproc_per_node is not valid: it must be a whole number of processes, at least 1" >&2
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

# Check the command line before any worker starts: a typo fails in a second, with one message.
preflight=("$python" config.py)
if [[ "$script" == train.py ]]; then
  preflight+=(--world-size "$nproc_per_node")
fi
"${preflight[@]}" "$@" >/dev/null

# A mistake in the input (a bad checkpoint, say) is reported once by rank 0, which also writes it
# here; the workers then exit 0, so torchrun neither restarts them (the mistake would only come
# back) nor prints its failure report, and this script exits 2.
error_file="$(mktemp "${TMPDIR:-/tmp}/run-sh-error.XXXXXX")"
trap 'rm -f "$error_file"' EXIT
export RUN_SH_ERROR_FILE="$error_file"

status=0
torchrun --standalone --nnodes=1 --nproc_per_node="$nproc_per_node" \
  --max-restarts="$max_restarts" "$script" "$@" || status=$?
if [[ -s "$error_file" ]]; then
  exit 2
fi
exit "$status"
