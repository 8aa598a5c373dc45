#!/usr/bin/env bash
# What every node of a Kubernetes or SkyPilot job runs: the variables that system sets, mapped
# onto run.sh's, then run.sh with the arguments (a script and key=value overrides, as run.sh).
#
#   bash launch/node.sh kubeflow [args]   launch/trainjob.yaml's command, in each pod: the torch
#                                         plugin's PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
#                                         PET_MASTER_ADDR, PET_MASTER_PORT; RDZV_ID from the manifest
#   bash launch/node.sh skypilot [args]   launch/sky.yaml's run block, on each node:
#                                         SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE,
#                                         SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (the first one hosts
#                                         the rendezvous), SKYPILOT_TASK_ID (the same after a
#                                         recovery: the run folder is found again by it)
#
# Exit status: run.sh's. 75: preempted, a checkpoint saved; the same job started again resumes
# from it (SkyPilot: recover_on_exit_codes; Kubernetes: the TrainJob applied again).
# `python -m ddpkit.targets` prints what each launcher runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need() {  # the variables the system sets on each node, all of them
  local name
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then
      echo "error: $name is not set: launch/node.sh $system runs on a node that $where starts ($where sets it)" >&2
      exit 2
    fi
  done
}

system="${1:-}"
shift || true
case "$system" in
  kubeflow)
    where="a Kubeflow TrainJob (launch/trainjob.yaml)"
    need PET_NNODES PET_NPROC_PER_NODE PET_NODE_RANK PET_MASTER_ADDR PET_MASTER_PORT RDZV_ID
    export NNODES="$PET_NNODES" NPROC_PER_NODE="$PET_NPROC_PER_NODE" NODE_RANK="$PET_NODE_RANK" \
      MASTER_ADDR="$PET_MASTER_ADDR" MASTER_PORT="$PET_MASTER_PORT" ;;
  skypilot)
    where="SkyPilot (launch/sky.yaml)"
    need SKYPILOT_NUM_NODES SKYPILOT_NUM_GPUS_PER_NODE SKYPILOT_NODE_RANK SKYPILOT_NODE_IPS \
      SKYPILOT_TASK_ID
    MASTER_ADDR="$(head -n 1 <<<"$SKYPILOT_NODE_IPS")"
    export NNODES="$SKYPILOT_NUM_NODES" NPROC_PER_NODE="$SKYPILOT_NUM_GPUS_PER_NODE" \
      NODE_RANK="$SKYPILOT_NODE_RANK" MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}" \
      RDZV_ID="${RDZV_ID:-$SKYPILOT_TASK_ID}" ;;
  *)
    echo "error: launch/node.sh ${system:-(nothing)}: give the system that starts this node, kubeflow or skypilot" >&2
    exit 2 ;;
esac
exec ./run.sh "$@"
