"""Optional features, each behind one seam, imported only when a run enables it: sweeps (sweep/,
run by sweep.py: grid, random and Optuna searches, each trial a run of run.sh). Nothing here is
imported by a run that does not use it."""
