#!/usr/bin/env bash
# The benchmark, one command: set up .venv (as scripts/setup.sh does), add the bench extras
# (PyTorch Lightning; skip them with BENCH_LIGHTNING=0), then run bench/bench.py with any
# arguments given here, e.g.  bash bench/run.sh --pairs 7 --workloads tiny
#                             bash bench/run.sh --pairs 3 --workloads gpt   # memory, start-up
#                             bash bench/run.sh --pairs 5 --workloads lm    # the LM recipe
#                             bash bench/run.sh --pairs 3 --workloads switches,tiny-switches
#                             (issue 46's switches, each alone: time per step on / off)
# Every workload also reports, per round against its base (the hand-written loop; stream:
# map-style; switches: off), the peak RSS per training process (a ratio) and launch to first step
# (a difference), both recorded by bench/peak.py; lm adds the training loss at matched steps,
# each round its own seed.
# Results: bench/results/results.md and results.json. About 30 minutes on 2 cores, plus about 2
# minutes a round for lm, 3 for switches and half a minute for tiny-switches.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
if [[ "${BENCH_LIGHTNING:-1}" != 0 ]]; then
  "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$root/bench/requirements.txt"
fi
exec "$root/.venv/bin/python" "$root/bench/bench.py" "$@"
