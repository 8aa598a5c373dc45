"""Replica groups: per-step fault tolerance with torchft, the job as replica groups that lose and
regain members without a restart (README: "When a machine is lost").

Each replica group is one torchrun (./run.sh with REPLICA_GROUP set; ./run_replicas.sh starts
them all, and the torchft lighthouse that keeps their membership). Inside a group, training is
what it is without torchft: DDP or FSDP over the group's processes. Across groups, a torchft
Manager forms a quorum of the live groups before every step and averages the gradients over
them; a group that dies leaves the others going on at the next step, and a group that starts (or
restarts) copies the live groups' state before its first step ("heals").

What this module adds to a run:
- the data is sharded over every process of every group (group g's rank r is data rank
  g x processes + r), so each group trains on its own share of each global batch; a missing
  group's share of a step is skipped;
- the optimizer steps only when every live group's gradients arrived (`VotedOptimizer`);
  otherwise train_step runs the same batch again with the groups still alive;
- the run's files (checkpoints, the training log, TensorBoard, the summary) are written by one
  live group: the first in the quorum (dist_utils.DistEnv.is_main asks `leads`); each window of
  train_log.jsonl says the fewest and the most groups that took part in one of its steps;
- replica_groups/group-<g>.jsonl, written by each group's rank 0: one line per step with how
  many groups took part, the step's wall time and how many tries it took; the last line holds a
  digest of the final weights, equal in every group.

The engine imports this package only for a job run.sh launched as a replica group
(REPLICA_GROUP set): launch.py holds what the preflight checks before torchrun starts (no torch
imported), groups.py the run's part (the Manager, the voted step, healing, the step log).
"""
