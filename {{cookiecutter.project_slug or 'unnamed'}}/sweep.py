"""Hyperparameter sweeps, every trial a normal run launched with run.sh (ddpkit/extras/sweep/):

    python sweep.py optim.lr=1e-3,3e-3 model.hidden_dim=128,256        # a grid: 4 trials
    python sweep.py --random 8 optim.lr=loguniform(1e-4,1e-2) model.dropout=0,0.1,0.2
    python sweep.py --optuna 20 optim.lr=loguniform(1e-4,1e-2) model.hidden_dim=128,256
    python sweep.py --slurm optim.lr=1e-3,3e-3                          # a SLURM job array

`python sweep.py --help` lists every option.
"""

import sys

from ddpkit.extras.sweep.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
