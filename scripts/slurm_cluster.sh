#!/usr/bin/env bash
# A real one-node SLURM cluster (Debian 12 packages: Slurm 22.05 + MUNGE) for testing slurm.sbatch.
#   scripts/slurm_cluster.sh start    install (once, apt), configure, start, wait until the node is idle
#   scripts/slurm_cluster.sh stop     kill the daemons and their jobs, remove the folder
#   scripts/slurm_cluster.sh status   sinfo + squeue
# Run as root. Config, state, logs and pid files all live in SLURM_CLUSTER_DIR (default
# /tmp/slurm-cluster). Clients need SLURM_CONF=$SLURM_CLUSTER_DIR/slurm.conf: `start` prints the
# export line (eval "$(scripts/slurm_cluster.sh start | grep ^export)"). The node advertises 8 CPUs
# and 2 GPUs whatever the machine has, so jobs asking --cpus-per-task=8 --gpus-per-node=2 run.
set -euo pipefail

dir="${SLURM_CLUSTER_DIR:-/tmp/slurm-cluster}"
export SLURM_CONF="$dir/slurm.conf"
node="$(hostname -s)"
ctld_port="${SLURM_CTLD_PORT:-6817}"
slurmd_port="${SLURM_SLURMD_PORT:-6818}"
deadline_s="${SLURM_START_TIMEOUT:-60}"

log() { echo "slurm_cluster: $*" >&2; }
[[ "$EUID" -eq 0 ]] || { log "run as root"; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"

install_packages() {
  local b
  for b in munged slurmctld slurmd sbatch; do
    command -v "$b" >/dev/null && continue
    log "installing slurmctld slurmd slurm-client munge (apt, one time) ..."
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
    return
  done
}

write_config() {
  mkdir -p "$dir"/{munge,state,spool,log}
  chmod 755 "$dir/munge"  # munged warns unless all users may reach its socket
  # A key only its owner may read (munged checks); 1024 random bytes, as mungekey writes.
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  # Two fake GPUs: slurmd drops a GPU without File=, and wants a character device there, so
  # gpu0/gpu1 are links to /dev/null. Jobs see CUDA_VISIBLE_DEVICES=0,1 as on a real GPU node.
  ln -sf /dev/null "$dir/gpu0"
  ln -sf /dev/null "$dir/gpu1"
  printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/gpu[0-1]\n' "$node" "$dir" >"$dir/gres.conf"
  cat >"$SLURM_CONF" <<EOF
ClusterName=local
# The controller runs on this node; reach it (and slurmd, NodeAddr below) over loopback.
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
# Both daemons run as root: no slurm user, no chown of the state dirs.
SlurmUser=root
SlurmdUser=root
# Our own munged socket; cred_expire is also the wait (+1 s) before a requeued job may start again
# (default 120 s; 5 is the minimum Slurm accepts).
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# An empty SPANK config of our own instead of /etc/slurm/plugstack.conf; no mail on this machine.
PlugStackConfig=$dir/plugstack.conf
MailProg=/bin/true
# No cgroups/systemd in a container: track job processes through /proc, bind nothing, account nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# A requeued job becomes eligible cred_expire+1 s after the requeue, but no event wakes the
# scheduler then: only its periodic full pass (default every 60 s) starts it. Run that every second.
SchedulerParameters=sched_interval=1
# Batch jobs may be requeued (scontrol requeue, --requeue); a requeued job keeps its id.
JobRequeue=1
# Seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time.
KillWait=10
# A node that was DOWN comes back as soon as its slurmd registers.
ReturnToService=2
# Trust the node line below over the hardware that slurmd detects (8 CPUs, 2 GPUs on any machine).
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$node NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  touch "$dir/plugstack.conf"
}

# Whether the process of a pid file lives (not a zombie: PID 1 here may reap orphans late).
alive() {
  local p _ state
  p="$(cat "$dir/$1.pid" 2>/dev/null)" && read -r _ _ state _ 2>/dev/null <"/proc/$p/stat" \
    && [[ "$state" != Z ]]
}
# Ours: the daemons and slurmstepd (they hold files in $dir open: logs, sockets) and the job
# processes (slurmd puts SLURM_CONF=$SLURM_CONF and SLURM_JOB_ID in their environment).
ours() {
  { find /proc/[0-9]*/fd -maxdepth 1 -lname "$dir/*" 2>/dev/null
    grep -lszxF "SLURM_CONF=$SLURM_CONF" /proc/[0-9]*/environ | xargs -r grep -lsz '^SLURM_JOB_ID='
  } | cut -d/ -f3 | sort -u | grep -vx "$$" || true
}

stop() {
  local i pids
  if [[ -f "$SLURM_CONF" ]] && alive slurmctld; then
    squeue -h -o %A 2>/dev/null | xargs -r timeout 10 scancel --quiet || true
  fi
  # SIGTERM for 5 s, then SIGKILL, until none is left.
  for i in $(seq 40); do
    pids="$(ours)"
    [[ -z "$pids" ]] && break
    # shellcheck disable=SC2086
    kill "-$( ((i <= 10)) && echo TERM || echo KILL)" $pids 2>/dev/null || true
    sleep 0.5
  done
  rm -rf "$dir"
}

start() {
  install_packages
  if alive munge/munged && alive slurmctld && alive slurmd \
    && [[ "$(sinfo -h -o %T 2>/dev/null)" =~ ^(idle|mixed|allocated|completing)$ ]]; then
    log "already running"
  else
    stop
    write_config
    # --force: start even over a stale socket that a killed munged left behind.
    munged --force --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
      --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
      --seed-file="$dir/munge/munged.seed"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N "$node"
    local t0=$SECONDS
    until [[ "$(sinfo -h -o %T 2>/dev/null)" == idle ]]; do
      # Give up at the deadline, or when a daemon died (after 2 s: time to write its pid file).
      if ((SECONDS - t0 > deadline_s)) || { ((SECONDS - t0 >= 2)) && ! { alive slurmctld && alive slurmd; }; }; then
        log "node $node not idle after $((SECONDS - t0))s: $(sinfo -h -o '%T %E' 2>&1)"
        tail -n 20 "$dir"/log/*.log >&2
        exit 1
      fi
      sleep 0.5
    done
    log "node $node idle after $((SECONDS - t0))s"
  fi
  echo "export SLURM_CONF=$SLURM_CONF"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo && squeue ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
