"""Peak resident memory and the first optimizer step of one training process, recorded the
same way for every contender.

    BENCH_PROBE_FILE=/tmp/probe.jsonl python bench/peak.py train.py train.epochs=2 ...
    BENCH_PROBE_FILE=... torchrun --nproc_per_node=2 bench/peak.py handwritten.py ...

It runs the script as its own child, with the same interpreter, arguments and environment
(plus bench/probe/ on PYTHONPATH: its sitecustomize.py appends {"rank", "first_step": unix
time} when the child's first optimizer step ends), waits for it, and appends one JSON line to
$BENCH_PROBE_FILE: {"rank": RANK, "peak_rss_mib": the child's ru_maxrss from wait4,
"exit_status": ...}. wait4 reports the child's own high-water mark (or that of a process the
child reaped, a DataLoader worker say, if larger), so torchrun's memory and this small
wrapper's are left out. It exits with the child's status. Signals (torchrun's SIGTERM to the
worker's process group) reach the child directly; this process only outlives them to record
the peak.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "probe"


def main(argv: list[str]) -> int:
    for number in (signal.SIGTERM, signal.SIGINT):  # the group's signal is the child's to act on
        signal.signal(number, lambda *_: None)
    path = os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))
    child = subprocess.Popen([sys.executable, *argv], env={**os.environ, "PYTHONPATH": path})
    _, status, usage = os.wait4(child.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    record = {"rank": int(os.environ.get("RANK", "0")), "peak_rss_mib": usage.ru_maxrss / 1024,
              "exit_status": code}
    with open(os.environ["BENCH_PROBE_FILE"], "a") as out:  # one short write: ranks don't mix
        out.write(json.dumps(record) + "\n")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
