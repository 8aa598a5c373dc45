"""SLURM job arrays (--slurm): array_script writes <sweep>/array.sbatch, slurm.sbatch's #SBATCH
lines then the sweep's own (one node and --nproc GPUs per element, --time, --cpus-per-task,
--max-parallel), each element running one trial through slurm.sbatch; submit_array submits it
with sbatch (or only writes it, --dry-run) for the trials that have not finished, so that a rerun
submits only those."""

import re
import shlex
import subprocess

from ddpkit.config import PROJECT_DIR, UserError
from ddpkit.extras.sweep.folder import Sweep
from ddpkit.extras.sweep.summary import write_sweep_summary

# Not submitit: its pickled launch and its own requeue would stand beside slurm.sbatch's (exit
# 75, scontrol requeue) and cluster.sh's environment; each element runs slurm.sbatch instead.
ARRAY_HEAD = """#!/usr/bin/env bash
# Job array of sweep {name}, written by `python sweep.py --slurm` (which resubmits the trials that
# did not finish): slurm.sbatch's #SBATCH lines, then the sweep's; element N runs trial N through
# slurm.sbatch on one node (cluster.sh sets the node up; a preempted element requeues itself).
"""
SBATCH_OPTION = re.compile(r"#SBATCH\s+(--[\w-]+)")


def array_script(sweep: Sweep, indices: list[int], args) -> str:
    """A job array of the trials `indices`: each element one trial on a node of its own."""
    ours = {"--job-name": sweep.folder.name,
            "--array": ",".join(map(str, indices)) + (
                f"%{args.max_parallel}" if args.max_parallel else ""),
            "--nodes": "1", "--gpus-per-node": str(sweep.nproc),
            "--output": f"{sweep.folder}/logs/trial-%a.slurm.out"}
    ours.update({"--time": args.time} if args.time else {})
    ours.update({"--cpus-per-task": str(args.cpus_per_task)} if args.cpus_per_task else {})
    lines = (PROJECT_DIR / "slurm.sbatch").read_text().splitlines()
    kept = [line for line in lines if (option := SBATCH_OPTION.match(line))
            and option[1] not in ours]
    return "\n".join([
        ARRAY_HEAD.format(name=sweep.folder.name).rstrip("\n"), *kept,
        *(f"#SBATCH {option}={value}" for option, value in ours.items()),
        "set -euo pipefail", f"cd {shlex.quote(str(PROJECT_DIR))}",
        'case "$SLURM_ARRAY_TASK_ID" in',
        *(f"  {i}) trial=({shlex.join(sweep.overrides(i))}) ;;" for i in indices),
        '  *) echo "error: no trial $SLURM_ARRAY_TASK_ID in this array" >&2; exit 2 ;;',
        "esac", f"export NPROC_PER_NODE={sweep.nproc}",
        'exec bash ./slurm.sbatch "${trial[@]}"', ""])


def submit_array(sweep: Sweep, args) -> int:
    todo = [i for i in range(len(sweep.trials)) if not sweep.finished(i)]
    if not todo:
        print(f"sweep {sweep.folder}: every trial finished")
        return write_sweep_summary(sweep)
    script = sweep.folder / "array.sbatch"
    script.write_text(array_script(sweep, todo, args))
    (sweep.folder / "logs").mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(f"wrote {script} (not submitted: --dry-run)")
        return 0
    try:
        result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                                text=True, check=False)
    except FileNotFoundError:
        raise UserError("sbatch not found: --slurm submits the trials with SLURM's sbatch; run "
                        "it on a machine of the cluster, or drop --slurm") from None
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines() or ["no message"]
        raise UserError(f"sbatch did not submit the job array ({said[-1]}): run the same "
                        "command again once sbatch works")
    print(f"submitted job array {result.stdout.strip()} ({len(todo)} trial(s)); when it has "
          f"ended, `python sweep.py --summary {sweep.folder}` writes the summary")
    return 0
