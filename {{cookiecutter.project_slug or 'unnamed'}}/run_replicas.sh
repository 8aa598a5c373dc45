#!/usr/bin/env bash
# Launch training as replica groups with torchft's per-step fault tolerance, on this machine:
# torchft's lighthouse, then REPLICA_GROUPS groups, each a ./run.sh of NPROC_PER_NODE processes.
# When a group's process fails, the other groups go on at the next step without it; its
# torchrun restarts it (MAX_RESTARTS), and it copies the live groups' state before it rejoins
# (README: "When a machine is lost"). Needs the torchft extra: pip install -e '.[torchft]'.
#
#   ./run_replicas.sh train.epochs=50                 # 2 groups
#   REPLICA_GROUPS=3 NPROC_PER_NODE=2 ./run_replicas.sh
#
# Environment (and run.sh's, which each group reads):
#   REPLICA_GROUPS        groups to start (default 2); train.global_batch_size is split over
#                         every process of every group
#   LIGHTHOUSE_PORT       the lighthouse's port on this machine (default 29510)
#   HEARTBEAT_TIMEOUT_MS  a group silent this long is left out of the next step's quorum: the
#                         live groups' pause when one dies (default 1000; torchft's own is 5000)
#   QUORUM_TICK_MS        how often the lighthouse looks for a quorum (default 50)
#   JOIN_TIMEOUT_MS       how long a quorum waits for a group that is alive but has not asked
#                         for it yet (default 1000)
#   RDZV_ID               the job id, which names the shared run folder, runs/<run.name>-<id>
#                         (default: replicas-<date>-<time>); the same id continues that run
#
# Several machines: start `torchft_lighthouse --min_replicas 1 --bind [::]:PORT` on one, then on
# each machine `REPLICA_GROUP=<n> REPLICA_GROUPS=<groups> RDZV_ID=<job id>
# TORCHFT_LIGHTHOUSE=http://<that host>:PORT NNODES=1 ./run.sh ...` (slurm.sbatch does this with
# TORCHFT=1: one group per node).
#
# Exit status: the highest of the groups' run.sh statuses (0 when all finished).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

groups="${REPLICA_GROUPS:-2}"
port="${LIGHTHOUSE_PORT:-29510}"
for setting in "REPLICA_GROUPS=$groups" "LIGHTHOUSE_PORT=$port" \
    "HEARTBEAT_TIMEOUT_MS=${HEARTBEAT_TIMEOUT_MS:-1000}" "QUORUM_TICK_MS=${QUORUM_TICK_MS:-50}" \
    "JOIN_TIMEOUT_MS=${JOIN_TIMEOUT_MS:-1000}"; do
  if ! [[ "${setting#*=}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $setting is not valid: it must be a whole number, at least 1" >&2
    exit 2
  fi
done
if [[ "$port" -gt 65535 ]]; then
  echo "error: LIGHTHOUSE_PORT=$port is not valid: it must be a port number, 1 to 65535" >&2
  exit 2
fi
if ! command -v torchft_lighthouse >/dev/null 2>&1; then
  echo "error: torchft_lighthouse not found on PATH: install the torchft extra (pip install -e '.[torchft]') in the project's environment and activate it" >&2
  exit 2
fi
# The Python the groups' run.sh use: said here once, not once by each group.
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found: set PYTHON to the Python that has the project's packages (README: Quick start)" >&2
  exit 2
fi
if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchft") is None)' 2>/dev/null; then
  echo "error: $(command -v "$python") lacks torchft, which replica groups need: install the torchft extra (pip install -e '.[torchft]') there, or set PYTHON to the Python that has it" >&2
  exit 2
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "error: port $port on this machine is taken (another job's lighthouse?): set LIGHTHOUSE_PORT to a free port" >&2
  exit 2
fi

# The lighthouse's errors (RUST_LOG: not its log of every quorum), for the line below when it
# cannot start; the file goes with the launch.
if ! lighthouse_log="$(mktemp "${TMPDIR:-/tmp}/lighthouse.XXXXXX" 2>/dev/null)"; then
  echo "error: cannot create a file in ${TMPDIR:-/tmp}: set TMPDIR to a writable folder" >&2
  exit 2
fi
lighthouse=""
# shellcheck disable=SC2329  # called by the trap
stop_lighthouse() {  # gone before this script is
  if [[ -n "$lighthouse" ]]; then kill "$lighthouse" 2>/dev/null || true; wait "$lighthouse" 2>/dev/null || true; fi
  rm -f "$lighthouse_log"
}
trap stop_lighthouse EXIT
# Until the groups start, a signal ends the launch (and the EXIT trap the lighthouse).
trap 'echo "interrupted before the groups started" >&2; exit 130' INT
for signal in TERM HUP USR1; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "echo 'stopped by SIG$signal before the groups started, nothing to save: run the same command again' >&2; exit 75" "$signal"
done
RUST_LOG=error torchft_lighthouse --min_replicas 1 --bind "[::]:$port" \
  --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-1000}" \
  --quorum_tick_ms "${QUORUM_TICK_MS:-50}" --join_timeout_ms "${JOIN_TIMEOUT_MS:-1000}" \
  >/dev/null 2>"$lighthouse_log" &
lighthouse=$!
# Each group's run.sh asks for the lighthouse before it starts a worker: it must listen first,
# which takes it a second or more (it imports torch). One that cannot start says why, once.
deadline=$((SECONDS + 120))
until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
  if ! kill -0 "$lighthouse" 2>/dev/null; then
    echo "error: torchft_lighthouse could not start on port $port ($(tail -n 1 "$lighthouse_log")): set LIGHTHOUSE_PORT to a free port" >&2
    exit 2
  fi
  if [[ $SECONDS -ge $deadline ]]; then
    echo "error: torchft_lighthouse did not listen on port $port in 120 s: start it by hand (torchft_lighthouse --min_replicas 1 --bind [::]:$port) to see why" >&2
    exit 2
  fi
  sleep 0.1
done
pids=()
# shellcheck disable=SC2329  # called by the traps
pass_on() {  # each group's run.sh saves and stops (or stops at once on SIGINT) itself
  if [[ -n "${pids[*]}" ]]; then kill -s "$1" "${pids[@]}" 2>/dev/null || true; fi
}
for signal in TERM HUP USR1 INT; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "pass_on $signal" "$signal"
done

export TORCHFT_LIGHTHOUSE="http://localhost:$port" REPLICA_GROUPS="$groups"
export RDZV_ID="${RDZV_ID:-replicas-$(date +%Y%m%d-%H%M%S)}"
echo "replica groups: $groups x ${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}} process(es), lighthouse on port $port, job $RDZV_ID" >&2
for ((group = 0; group < groups; group++)); do
  REPLICA_GROUP="$group" NNODES=1 ./run.sh "$@" &
  pids+=($!)
done

worst=0
for pid in "${pids[@]}"; do
  status=0
  # `wait` returns early when a trapped signal arrives: wait until the group has really ended.
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" 2>/dev/null || true; done
  wait "$pid" 2>/dev/null || status=$?
  if [[ "$status" -gt "$worst" ]]; then worst="$status"; fi
done
exit "$worst"
