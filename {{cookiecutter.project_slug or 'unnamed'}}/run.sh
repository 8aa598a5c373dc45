#!/usr/bin/env bash
# Launch training (or another entry point) with torchrun, one process per GPU.
#
#   ./run.sh                                  # train.py with configs/default.yaml
#   ./run.sh train.epochs=50 optim.lr=0.001   # key=value overrides, checked before launch
#   ./run.sh evaluate.py eval.checkpoint=runs/<run>
#
# Environment (docs/launch-and-clusters.md says what each does):
#   NPROC_PER_NODE  processes on this machine (default {{ cookiecutter.gpus_per_node }})
#   NNODES          machines in the job (default {{ cookiecutter.num_nodes }}); 1 uses torchrun --standalone, a range
#                   MIN:MAX makes the job elastic
#   MASTER_ADDR, MASTER_PORT, RDZV_ID, NODE_RANK, RDZV_JOIN_TIMEOUT, RDZV_CONF: several nodes
#   REPLICA_GROUP, REPLICA_GROUPS, TORCHFT_LIGHTHOUSE: torchft replica groups (run_replicas.sh)
#   MAX_RESTARTS    torchrun's restarts of failed workers (default 3, torchrun's own is 0)
#   SHUTDOWN_TIMEOUT seconds the workers get to leave after SIGINT (default 120)
#   PYTHON          the Python that has the project's packages (default python3)
#   DDP_CACHE_DIR   where torchrun's --help is kept between launches (~/.cache/ddp-template)
#
# Exit status: 0 done, 2 a mistake in the input or the setup (one line says which), 75 preempted
# (SIGTERM, SIGUSR1 or SIGHUP: a checkpoint was saved, or the workers had not started), 130
# interrupted (SIGINT, Ctrl-C: no checkpoint saved), 1 the job stalled or failed (the report says
# which rank and where). After 75, 130 or 1 (its cause fixed) the same command again continues the
# run from its newest checkpoint; the last line of 75 and 130 prints that command
# (docs/checkpoints.md: "Which run the same command continues").
# torchrun itself exits 0 or 1 (docs/launch-and-clusters.md: "Exit statuses and restarts" says
# why they differ).
#
# The checks, and torchrun's command line, are ddpkit/preflight.py's and launcher.py's; this
# script starts torchrun, passes signals on to the workers, and turns how the job ended into its
# exit status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# This launch's command, shell-quoted, for the lines that tell how to continue it (the workers'
# too): NPROC_PER_NODE and NNODES where they are set, this script as it was called, its arguments.
same_command=""
for name in NPROC_PER_NODE NNODES; do
  if [[ -n "${!name:-}" ]]; then same_command+="$name=$(printf '%q' "${!name}") "; fi
done
script="$0"
if [[ "$script" != */* ]]; then script="./$script"; fi  # (bash run.sh)
same_command+="$(printf '%q' "$script")"
if [[ $# -gt 0 ]]; then same_command+="$(printf ' %q' "$@")"; fi
export RUN_SH_COMMAND="$same_command"

# Until torchrun starts, a signal ends the launch at once (the EXIT trap below cleans up); the
# preflight runs in the background, as `wait` returns on a signal and a foreground command would
# hold the trap back until it ends.
# shellcheck disable=SC2329  # called by the traps
stop_before_launch() {
  if [[ "$1" == INT ]]; then
    echo "interrupted before the workers started: run the same command again to start them: $same_command" >&2
    exit 130
  fi
  echo "stopped by SIG$1 before the workers started, nothing to save: run the same command again: $same_command" >&2
  exit 75
}
for signal in TERM HUP USR1 INT; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "stop_before_launch $signal" "$signal"
done

nproc_per_node="${NPROC_PER_NODE:-{{ cookiecutter.gpus_per_node }}}"
nnodes="${NNODES:-{{ cookiecutter.num_nodes }}}"
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found: set PYTHON to the Python that has the project's packages (README: Quick start)" >&2
  exit 2
fi

# Temporary files of this launch, torchrun's, the workers' and their loaders' (TMPDIR) in one
# folder, removed however the launch ends. Its path stays short: torch keeps Unix sockets there.
# Its `owner` file lists this host and the processes this script starts, so that the next launch
# removes the folder of one killed outright (SIGKILL) once they are all gone (the preflight does).
tmp_base="${TMPDIR:-/tmp}"
if ! launch_tmp="$(mktemp -d "$tmp_base/run-sh.XXXXXX" 2>/dev/null)"; then
  echo "error: cannot create a folder in $tmp_base: set TMPDIR to a writable folder" >&2
  exit 2
fi
echo "$(uname -n) $$" >"$launch_tmp/owner"
# shellcheck disable=SC2329  # called by the trap below
cleanup() {
  local running
  running="$(jobs -p)"  # background steps still running when the launch ends early
  # shellcheck disable=SC2086  # one pid per word
  if [[ -n "$running" ]]; then kill $running 2>/dev/null || true; wait $running 2>/dev/null || true; fi
  rm -rf "$launch_tmp"
}
trap cleanup EXIT
# How the job ended, when the workers ended it on purpose: rank 0 writes `error: ...` (a mistake
# in the input, reported once), `preempted` (a checkpoint was saved), `stalled` (a rank never
# reached a collective; the report names it) or `failed` (an error a restart would repeat); the
# workers restarted after a crash in native code write `crashed`. The workers then exit 0, so
# that torchrun restarts none of them, and this script exits 2, 75, 1 or 1.
export TMPDIR="$launch_tmp" RUN_SH_STATUS_FILE="$launch_tmp/status"

# Check the settings, the command line and this machine before any worker starts (one line, in
# a second), and get torchrun's command line: NUL-separated words.
"$python" -m ddpkit.launcher "$launch_tmp" --nproc-per-node "$nproc_per_node" \
  --nnodes "$nnodes" "$@" &
echo "$!" >>"$launch_tmp/owner"
wait "$!" || exit 2
mapfile -d '' -t command <"$launch_tmp/command"

# Signals, once torchrun runs. SLURM (or another scheduler) sends SIGTERM or SIGUSR1 before it
# kills a job, a closed terminal SIGHUP, Ctrl-C SIGINT. torchrun starts with the four ignored and
# keeps them so (given --signals-to-handle without them, where it has that flag: torch 2.10+; an
# older one starts with them blocked too: ddpkit/launcher.py), so it neither kills the workers nor
# prints a traceback. This script passes them on to the workers torchrun has (SIGHUP
# as SIGTERM): on SIGTERM or SIGUSR1 they save a checkpoint at the step all ranks agree on, on
# SIGINT they leave at once. It writes a mark beside the status file first (.preempted,
# .interrupted): a worker still starting ignores the signal, and finds the mark when it listens.
# Workers that leave on purpose exit 0, so torchrun restarts none of them.
launcher=""
stopped_early=""  # the signal that stopped torchrun before it had workers
interrupted=""
pending=""  # a signal that came before torchrun's pid was known
deadline=""  # after SIGINT: a sleep of SHUTDOWN_TIMEOUT s, then what is left is killed
signalled=()  # the workers signalled
# shellcheck disable=SC2329  # called by on_signal
pass_on() {  # $1: the signal for the workers; $2: the mark written first
  : >"$RUN_SH_STATUS_FILE.$2"
  mapfile -t signalled < <(pgrep -P "$launcher" || true)
  if [[ -z "${signalled[*]}" ]]; then  # no worker: torchrun starts, or waits for other nodes
    : >"$RUN_SH_STATUS_FILE.interrupted"  # one it is starting right now leaves at once
    kill -s KILL "$launcher" 2>/dev/null || true
    return 1
  fi
  kill -s "$1" "${signalled[@]}" 2>/dev/null || true
}
# shellcheck disable=SC2329  # called by the traps below
on_signal() {
  if [[ -z "$launcher" ]]; then pending="$1"; return 0; fi
  case "$1" in
    INT)
      interrupted=1
      if pass_on INT interrupted && [[ -z "$deadline" ]]; then
        sleep "${SHUTDOWN_TIMEOUT:-120}" &
        deadline=$!
      fi ;;
    HUP) pass_on TERM preempted || stopped_early=HUP ;;
    *) pass_on "$1" preempted || stopped_early="$1" ;;
  esac
}
for signal in TERM HUP USR1 INT; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "on_signal $signal" "$signal"
done
(
  trap '' TERM USR1 HUP INT  # torchrun and the workers start ignoring them; the workers then handle them
  exec "${command[@]}"
) &
launcher=$!
echo "$launcher" >>"$launch_tmp/owner"
if [[ -n "$pending" ]]; then on_signal "$pending"; fi

# `wait` returns early when a trapped signal arrives: wait until torchrun has really ended.
while kill -0 "$launcher" 2>/dev/null; do
  if [[ -z "$deadline" ]]; then
    wait "$launcher" 2>/dev/null || true
  elif kill -0 "$deadline" 2>/dev/null; then
    wait -n 2>/dev/null || true  # torchrun, or the deadline, whichever ends first
  else  # SHUTDOWN_TIMEOUT is up: what is left of the job is killed
    kill -s KILL "$launcher" "${signalled[@]}" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
  fi
done
status=0
wait "$launcher" 2>/dev/null || status=$?  # (bash would report a torchrun killed here)
if [[ -n "$interrupted" ]]; then
  # Once training has started, rank 0 has said at which step and from which checkpoint.
  if [[ "$(head -c 40 "$RUN_SH_STATUS_FILE" 2>/dev/null)" != interrupted* ]]; then
    echo "interrupted (SIGINT): the job stopped; to continue it (from its newest checkpoint, if it saved one), run the same command again: $same_command" >&2
  fi
  exit 130
fi
if [[ -n "$stopped_early" && "$status" -eq 137 ]]; then  # (not a job that ended meanwhile)
  echo "stopped by SIG$stopped_early before the workers started, nothing to save: run the same command again: $same_command" >&2
  exit 75
fi
case "$(head -c 40 "$RUN_SH_STATUS_FILE" 2>/dev/null)" in
  error:*) exit 2 ;;
  preempted*) exit 75 ;;
  stalled* | failed*) exit 1 ;;
esac
# A worker that crashed in native code (its restarted workers left at once, writing `crashed`, or
# there were no restarts): its stack once and one line (ddpkit/crash_report.py), exit 1.
if [[ "$status" -ne 0 || -s "$RUN_SH_STATUS_FILE" ]] && ! "$python" -m ddpkit.crash_report "$launch_tmp"; then
  exit 1
fi
exit "$status"
