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
#                   (NNODES=1 ./run.sh runs a project made for several nodes on this machine).
#                   A range MIN:MAX (say 1:4) makes the job elastic: it starts with the nodes
#                   that have joined (at least MIN), shrinks when one is lost and grows when one
#                   joins, each time resuming from the last checkpoint at the new world size
#                   (README: "When a machine is lost")
#   MASTER_ADDR     several nodes: the head node's address, the same on every node
#   MASTER_PORT     several nodes: the rendezvous port on the head node (default 29500)
#   RDZV_ID         several nodes: a job id, the same on every node and new for every job
#                   (default $SLURM_JOB_ID); a restarted job finds its run folder by it
#   NODE_RANK       optional: 0 on the head node makes the preflight check the port is free
#   RDZV_JOIN_TIMEOUT several nodes: seconds to wait for the other nodes (default 600)
#   RDZV_CONF       several nodes: more of torchrun's --rdzv-conf, e.g.
#                   last_call_timeout=5,keep_alive_interval=2 (an elastic job waits
#                   last_call_timeout s, default 30, for more nodes once MIN have joined, and takes
#                   a node for lost after keep_alive_interval x keep_alive_max_attempt s, 5 x 3)
#   REPLICA_GROUP   this launch is replica group REPLICA_GROUP (0 to REPLICA_GROUPS-1) of a job
#                   with torchft's per-step fault tolerance, whose lighthouse is at
#                   TORCHFT_LIGHTHOUSE (http://host:port); run_replicas.sh starts the lighthouse
#                   and the groups on one machine, slurm.sbatch one group per node
#                   (README: "When a machine is lost")
#   MAX_RESTARTS    restarts of failed workers (default 3); train.py resumes from the latest
#                   checkpoint. 0 while debugging.
#   SHUTDOWN_TIMEOUT seconds the workers get to leave after SIGINT (this script) or SIGQUIT
#                   (torchrun, torch 2.12+; older torchrun waits 30 s) before they are killed
#                   (default 120); see "Signals" below for SIGTERM / SIGUSR1 / SIGHUP
#   PYTHON          the Python that has the project's packages (default python3); torchrun is
#                   the one on PATH
#   DDP_CACHE_DIR   where run.sh keeps torchrun's --help between launches
#                   (default ~/.cache/ddp-template)
#
# Exit status: 0 done, 2 a mistake in the input or the setup (one line says which), 75 preempted
# (SIGTERM, SIGUSR1 or SIGHUP: a checkpoint was saved, or the workers had not started: run the
# same command again, with the same RDZV_ID or SLURM job, and it continues), 130 interrupted
# (SIGINT, Ctrl-C), 1 the job stalled or failed (the report says which rank and where).
#
# OMP_NUM_THREADS defaults to this machine's cores divided by the processes (at least 1), so
# the processes do not oversubscribe the CPU and torchrun does not warn about it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# Until torchrun starts, a signal ends the launch at once (the EXIT trap below cleans up); the
# Python steps run in the background, as `wait` returns on a signal and a foreground command
# would hold the trap back until it ends.
# shellcheck disable=SC2329  # called by the traps
stop_before_launch() {
  if [[ "$1" == INT ]]; then
    echo "interrupted before the workers started" >&2
    exit 130
  fi
  echo "stopped by SIG$1 before the workers started, nothing to save: run the same command again" >&2
  exit 75
}
for signal in TERM HUP USR1 INT; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "stop_before_launch $signal" "$signal"
done
in_background() {  # run a command in the background and wait for it: its status
  "$@" &
  wait "$!"
}

nproc_per_node="${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}"
max_restarts="${MAX_RESTARTS:-3}"
nnodes="${NNODES:-{{ cookiecutter.num_nodes }}}"
python="${PYTHON:-python3}"
shutdown_timeout="${SHUTDOWN_TIMEOUT:-120}"
join_timeout="${RDZV_JOIN_TIMEOUT:-600}"

if ! [[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC_PER_NODE=$nproc_per_node is not valid: it must be a whole number of processes, at least 1" >&2
  exit 2
fi
if ! [[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]]; then
  echo "error: NNODES=$nnodes is not valid: it must be a whole number of machines, at least 1, or a range MIN:MAX such as 1:4" >&2
  exit 2
fi
min_nodes="${nnodes%%:*}"
max_nodes="${nnodes##*:}"
if [[ "$min_nodes" -gt "$max_nodes" ]]; then
  echo "error: NNODES=$nnodes is not valid: the range's minimum $min_nodes is above its maximum $max_nodes" >&2
  exit 2
fi
if [[ "$min_nodes" -eq "$max_nodes" ]]; then
  nnodes="$min_nodes"  # 2:2 is 2
fi
if ! [[ "$max_restarts" =~ ^[0-9]+$ ]]; then
  echo "error: MAX_RESTARTS=$max_restarts is not valid: it must be a whole number, 0 or more" >&2
  exit 2
fi
if ! [[ "$shutdown_timeout" =~ ^[0-9]+$ ]]; then
  echo "error: SHUTDOWN_TIMEOUT=$shutdown_timeout is not valid: it must be a whole number of seconds" >&2
  exit 2
fi
if ! [[ "$join_timeout" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: RDZV_JOIN_TIMEOUT=$join_timeout is not valid: it must be a whole number of seconds, at least 1" >&2
  exit 2
fi

batch_nodes="$nnodes"  # what the global batch is split over, besides the processes
if [[ -n "${REPLICA_GROUP:-}" ]]; then
  if ! [[ "${REPLICA_GROUPS:-}" =~ ^[1-9][0-9]*$ && "$REPLICA_GROUP" =~ ^[0-9]+$ ]] ||
     [[ "$REPLICA_GROUP" -ge "$REPLICA_GROUPS" ]]; then
    echo "error: REPLICA_GROUP=$REPLICA_GROUP and REPLICA_GROUPS=${REPLICA_GROUPS:-} are not valid: REPLICA_GROUPS is the number of replica groups, REPLICA_GROUP this group's, 0 to REPLICA_GROUPS-1" >&2
    exit 2
  fi
  if [[ "$nnodes" != 1 ]]; then
    echo "error: NNODES=$nnodes with REPLICA_GROUP: a replica group runs on one machine, so set NNODES=1 (start one group per machine)" >&2
    exit 2
  fi
  if [[ -z "${TORCHFT_LIGHTHOUSE:-}" ]]; then
    echo "error: REPLICA_GROUP is set but TORCHFT_LIGHTHOUSE is not: give the lighthouse's address, http://<host>:<port> (run_replicas.sh starts one)" >&2
    exit 2
  fi
  batch_nodes="$REPLICA_GROUPS"
  export RUST_LOG="${RUST_LOG:-warn}"  # torchft's Manager logs every quorum at info
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

if [[ "$nnodes" == 1 ]]; then
  rendezvous=(--standalone --nnodes=1)
  endpoint=""
else
  rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-}}"
  if [[ -z "${MASTER_ADDR:-}" || -z "$rdzv_id" ]]; then
    echo "error: NNODES=$nnodes needs MASTER_ADDR (the head node's address) and RDZV_ID (a job id), the same on every node; to run on this machine alone, start it as NNODES=1 ./run.sh" >&2
    exit 2
  fi
  endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
  rendezvous=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id"
              --rdzv-conf="join_timeout=$join_timeout${RDZV_CONF:+,$RDZV_CONF}")
fi

# The packages training needs (pyproject.toml's dependencies but optuna, which only sweep.py
# imports: the name to import, then pip's), looked up without importing them, so that a Python
# without them gets one line instead of a traceback.
packages=(torch:torch numpy:numpy omegaconf:omegaconf sklearn:scikit-learn tensorboard:tensorboard
          matplotlib:matplotlib tqdm:tqdm)
if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found: set PYTHON to the Python that has the project's packages (README: Quick start)" >&2
  exit 2
fi
if ! missing="$("$python" -c 'import importlib.util as u, sys
print(", ".join(p.split(":")[1] for p in sys.argv[1:] if u.find_spec(p.split(":")[0]) is None))' \
  "${packages[@]}" 2>/dev/null)"; then
  echo "error: $python could not look up the project's packages: set PYTHON to a Python 3.10+ that has them (README: Quick start)" >&2
  exit 2
fi
if [[ -n "$missing" ]]; then
  echo "error: $(command -v "$python") lacks the project's packages ($missing): activate the project's environment, or run pip install -e . there (README: Quick start)" >&2
  exit 2
fi
if ! command -v torchrun >/dev/null 2>&1; then
  echo "error: torchrun not found on PATH: activate the project's environment (pip install -e . puts torchrun there)" >&2
  exit 2
fi

# Temporary files of this launch, torchrun's, the workers' and their loaders' (TMPDIR) in one
# folder, removed however the launch ends. Its path stays short: torch keeps Unix sockets there.
# A launch killed outright (SIGKILL) cannot remove its folder; the next one does, once neither
# the launch nor a process started in that folder is alive on this machine.
tmp_base="${TMPDIR:-/tmp}"
host="$(uname -n)"
for stale in "$tmp_base"/run-sh.*; do
  [[ -O "$stale" && -f "$stale/owner" ]] || continue
  read -r owner_host owner_pid <"$stale/owner" || continue
  if [[ "$owner_host" != "$host" ]] || ps -p "$owner_pid" >/dev/null 2>&1 ||
     grep -qsxz "TMPDIR=$stale" /proc/[0-9]*/environ; then
    continue
  fi
  rm -rf "$stale"
done
if ! launch_tmp="$(mktemp -d "$tmp_base/run-sh.XXXXXX" 2>/dev/null)"; then
  echo "error: cannot create a folder in $tmp_base: set TMPDIR to a writable folder" >&2
  exit 2
fi
echo "$host $$" >"$launch_tmp/owner"
# shellcheck disable=SC2329  # called by the trap below
cleanup() {
  local running
  running="$(jobs -p)"  # background steps still running when the launch ends early
  # shellcheck disable=SC2086  # one pid per word
  if [[ -n "$running" ]]; then kill $running 2>/dev/null || true; wait $running 2>/dev/null || true; fi
  rm -rf "$launch_tmp"
}
trap cleanup EXIT
# torch.compile's cache is worth keeping between launches: where torch puts it without run.sh.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$tmp_base/torchinductor_$(id -un)}"
export TMPDIR="$launch_tmp"
status_file="$launch_tmp/status"
help_file="$launch_tmp/torchrun-help"

# The flags torchrun has differ between torch versions, and torchrun stops at one it does not
# know: its --help lists those it has. Reading it costs an import of torch (seconds of CPU), so
# it runs while the preflight checks the command line, and is kept per torchrun installation
# (its path and modification time) for the next launches.
torchrun_path="$(command -v torchrun || true)"
torchrun_stamp="$(stat -c %Y "$torchrun_path" 2>/dev/null || true)"
help_cache="${DDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ddp-template}/torchrun-help-$(printf '%s %s' "$torchrun_path" "$torchrun_stamp" | cksum | cut -d ' ' -f 1)"
if [[ -n "$torchrun_stamp" && -s "$help_cache" ]]; then
  help_file="$help_cache"  # read where it is kept: nothing to write
  true &
else
  torchrun --help >"$help_file" 2>&1 &
fi
help_pid=$!

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  threads=$((cores / nproc_per_node))
  export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
fi

# Restarted workers must not share torchrun's rendezvous store: with it shared, a restarted
# worker can read a peer address left by the previous attempt and fail to connect
# (pytorch/pytorch#135712). Each attempt then gets a fresh store, hosted by its rank 0.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# Check the command line and this machine before any worker starts: one line, in a second.
in_background "$python" -m ddpkit.preflight --nproc-per-node "$nproc_per_node" --nnodes "$batch_nodes" \
  --script "$script" --endpoint "$endpoint" --node-rank "${NODE_RANK:-}" \
  --rdzv-conf "${endpoint:+${RDZV_CONF:-}}" "$@" || exit 2

# How the job ended, when the workers ended it on purpose: rank 0 writes `error: ...` (a mistake
# in the input, reported once), `preempted` (a checkpoint was saved on SIGTERM / SIGUSR1) or
# `stalled` (a rank never reached a collective; the report names it). The workers then exit 0,
# so torchrun does not restart them (the mistake or the stall would only come back, and a
# preempted job is about to be killed), and this script exits 2, 75 or 1.
export RUN_SH_STATUS_FILE="$status_file"

# Signals, once torchrun runs. Preemption: SLURM (or another scheduler) sends SIGTERM or SIGUSR1
# before it kills a job; a closed terminal sends SIGHUP. Every worker handles SIGTERM and SIGUSR1
# itself (train.py saves a checkpoint at the step all ranks agree on); this script passes them
# (SIGHUP as SIGTERM) on to the workers, torchrun's children, and torchrun ignores all three.
# Given --signals-to-handle without them (a flag torch 2.11 has, pytorch#160690), torchrun keeps
# ignoring them: it neither kills the saving workers nor prints a traceback; it waits for them to
# leave. An older torchrun sets its own handlers, so when the scheduler signals it too (SLURM
# signals every process of the job) it passes SIGTERM on to the workers and kills them 30 s later.
# --shutdown-timeout (torch 2.12+, pytorch#172596) is how long torchrun waits after the signals it
# handles (SIGQUIT). SIGINT (Ctrl-C) is this script's alone: torchrun would restart workers that
# leave on it, or print a page of traceback when it handles it itself.
if ! wait "$help_pid"; then
  echo "error: torchrun --help failed, so torchrun would too: $(tail -n 1 "$help_file")" >&2
  exit 2
fi
if [[ -n "$torchrun_stamp" && "$help_file" != "$help_cache" ]] \
    && mkdir -p "${help_cache%/*}" 2>/dev/null && cp "$help_file" "$help_cache.$$" 2>/dev/null; then
  mv -f "$help_cache.$$" "$help_cache"  # whole or not at all, whichever launch writes it
else
  rm -f "$help_cache.$$"
fi
torchrun_has() {  # whether torchrun's --help lists this flag
  grep -qE -- "(^|[[ ])$1([] =,]|$)" "$help_file"
}
launch_flags=()
if torchrun_has --signals-to-handle; then
  launch_flags+=("--signals-to-handle=SIGQUIT")
fi
if torchrun_has --shutdown-timeout; then
  launch_flags+=("--shutdown-timeout=$shutdown_timeout")
elif [[ -n "${SHUTDOWN_TIMEOUT:-}" ]]; then
  echo "note: this torchrun has no --shutdown-timeout (torch 2.12+), so SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT does not apply: it waits 30 s" >&2
fi

# A restarted or requeued job (same RDZV_ID or SLURM job id) finds its run folder by this id.
export DDP_JOB_ID="${RDZV_ID:-${SLURM_JOB_ID:-}}"

# shellcheck disable=SC2329  # this and the next two: called by the traps below
alive() {  # whether any of these processes is still running (not gone, not a zombie)
  [[ $# -gt 0 ]] && ps -o stat= -p "$(IFS=,; echo "$*")" 2>/dev/null | grep -v '^Z' >/dev/null
}
# Stopped, torchrun starts no worker and restarts none; once it shows as stopped, no start is
# half done, so the workers it has are all listed.
# shellcheck disable=SC2329
freeze_launcher() {
  kill -s STOP "$launcher" 2>/dev/null || return 0
  while [[ "$(ps -o stat= -p "$launcher" 2>/dev/null)" == [!TtZ]* ]]; do :; done
}
# shellcheck disable=SC2329
workers() { pgrep -P "$launcher" 2>/dev/null || true; }

# shellcheck disable=SC2329  # called by the traps below
preempt() {
  local pids
  freeze_launcher
  mapfile -t pids < <(workers)
  if [[ -z "${pids[*]}" ]]; then  # still starting, or waiting for the other nodes
    stopped_early="$1"
    kill -s KILL "$launcher" 2>/dev/null || true
    return 0
  fi
  # Workers that are still starting ignore the signal; they find this file once they listen.
  : >"$status_file.preempted"
  kill -s "$2" "${pids[@]}" 2>/dev/null || true
  kill -s CONT "$launcher" 2>/dev/null || true
}
# shellcheck disable=SC2329  # called by the trap below
interrupt() {  # the workers leave at once; torchrun, stopped, restarts none of them
  local pids deadline=$((SECONDS + shutdown_timeout))
  interrupted=1
  freeze_launcher
  mapfile -t pids < <(workers)
  : >"$status_file.interrupted"  # the workers leave on this SIGINT, not on the terminal's
  if [[ -n "${pids[*]}" ]]; then kill -s INT "${pids[@]}" 2>/dev/null || true; fi
  while alive "${pids[@]}" && [[ $SECONDS -lt $deadline ]]; do sleep 0.1; done
  if [[ -n "${pids[*]}" ]]; then kill -s KILL "${pids[@]}" 2>/dev/null || true; fi
  kill -s KILL "$launcher" 2>/dev/null || true
}
launcher=""
stopped_early=""  # the signal that stopped torchrun before it had workers
interrupted=""
pending=""  # a signal that came before torchrun's pid was known
# shellcheck disable=SC2329  # called by the traps below
on_signal() {
  if [[ -z "$launcher" ]]; then pending="$1"; return 0; fi
  case "$1" in
    INT) interrupt ;;
    HUP) preempt HUP TERM ;;
    *) preempt "$1" "$1" ;;
  esac
}
for signal in TERM HUP USR1 INT; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "on_signal $signal" "$signal"
done
if [[ "$nnodes" == *:* ]]; then
  echo "elastic job of $min_nodes to $max_nodes nodes: waiting up to $join_timeout s for $min_nodes at $endpoint (RDZV_JOIN_TIMEOUT)" >&2
elif [[ "$nnodes" -gt 1 ]]; then
  echo "waiting up to $join_timeout s for the other nodes at $endpoint (RDZV_JOIN_TIMEOUT)" >&2
fi
(
  trap '' TERM USR1 HUP INT  # torchrun and the workers start ignoring them; the workers then handle them
  exec torchrun "${rendezvous[@]}" --nproc_per_node="$nproc_per_node" \
    --max-restarts="$max_restarts" "${launch_flags[@]}" "$script" "$@"
) &
launcher=$!
if [[ -n "$pending" ]]; then on_signal "$pending"; fi

# `wait` returns early when a trapped signal arrives: wait until torchrun has really ended.
while kill -0 "$launcher" 2>/dev/null; do
  wait "$launcher" 2>/dev/null || true
done
status=0
wait "$launcher" 2>/dev/null || status=$?  # (bash would report a torchrun killed here)
if [[ -n "$interrupted" ]]; then
  echo "interrupted (SIGINT): the job stopped" >&2
  exit 130
fi
if [[ -n "$stopped_early" ]]; then
  echo "stopped by SIG$stopped_early before the workers started, nothing to save: run the same command again" >&2
  exit 75
fi
case "$(head -c 40 "$status_file" 2>/dev/null)" in
  error:*) exit 2 ;;
  preempted*) exit 75 ;;
  stalled*) exit 1 ;;
  failed*) exit 1 ;;
esac
exit "$status"
