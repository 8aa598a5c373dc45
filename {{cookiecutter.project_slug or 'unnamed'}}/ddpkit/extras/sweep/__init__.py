"""Hyperparameter sweeps: every trial a normal run, launched with run.sh.

    python sweep.py optim.lr=1e-3,3e-3 model.hidden_dim=128,256        # a grid: 4 trials
    python sweep.py --random 8 optim.lr=loguniform(1e-4,1e-2) model.dropout=0,0.1,0.2
    python sweep.py --nproc 2 --name lr-scan optim.lr=1e-3,3e-3 train.epochs=50
    python sweep.py --slurm optim.lr=1e-3,3e-3                          # a SLURM job array
    python sweep.py --optuna 20 optim.lr=loguniform(1e-4,1e-2) model.hidden_dim=128,256

An override with a comma (or a range, for --random) is swept; one without is set in every
trial, unless its key is swept too (commas inside brackets or quotes split nothing:
optim.milestones=[100,200],[300] sweeps two lists). Optuna's samplers draw the plan once, kept
in sweep.json: GridSampler the whole grid in an order shuffled by --seed (so that the first
trials already spread over it), RandomSampler the --random draws. With --optuna N, TPE picks each
trial when a slot is free instead, hears every epoch's headline validation value and prunes a
trial below the median of the earlier ones at that epoch (it gets SIGTERM, saves a checkpoint
and leaves); the study is <sweep>/optuna.db.

Before the sweep folder is made, the options and every trial's command line go through the
checks its run.sh would make before launch (the config, the global batch over --nproc
processes on one node, your files compiling; a range stands for its two ends, --random's draws
for themselves): a mistake is one line naming the trial (or every trial), exit 2, none started.

Each trial runs `./run.sh <its overrides> run.dir=<sweep>/trial-NNN` with --nproc processes
(default: $NPROC_PER_NODE, else 1): an ordinary run folder, resumable, evaluable, tracked. Here
the trials are packed onto the GPUs (k GPUs of its own for a trial of k processes, one trial at
a time without GPUs); with --slurm they are a job array (<sweep>/array.sbatch) whose elements
each run slurm.sbatch on one node.

The sweep folder (default runs/sweeps/<name>) holds sweep.json, the trials' run folders,
logs/trial-NNN.log and, when every trial has ended, summary.csv and summary.md (trials ranked by
the task's headline validation metric) and summary.png (that metric against each swept setting).
The same command again (same --name) reruns only the trials that did not finish (from their
checkpoints), or continues the study up to N trials. A failing trial is reported with its
one-line error; the others go on. The exit status is 0 when every trial finished, 1 otherwise.

The modules, by concern: space.py (the overrides swept and fixed, the plan drawn from them),
folder.py (the sweep folder and its plan file, sweep.json), checks.py (every trial checked
before the first launch), local.py (trials packed onto this machine's GPUs, started and stopped),
slurm.py (the job array), optuna_search.py (the Optuna study, its pruning), summary.py (the
ranked summary and its plot) and main.py (the command line, which sweep.py runs). optuna is
imported only when a sweep runs.
"""
