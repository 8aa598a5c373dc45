"""A replica group's part of a run: the torchft Manager's quorum before each step, gradients
averaged over the live groups, a step applied only when every live group took part (the same
micro-batches run again otherwise), healing a (re)started group from a live one, and the group's
step log. The package's docstring says what replica groups are.
"""

import datetime
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ddpkit.dist_utils import DistEnv
from ddpkit.extras.replicas.launch import LIGHTHOUSE_VAR, NEEDS_TORCHFT, lighthouse_problem
from ddpkit.position import rng_state, set_rng_state
from ddpkit.project import UserError
from ddpkit.run_state import apply_gradients, compute_gradients

log = logging.getLogger("ddp")

MAX_TRIES = 20  # consecutive failed steps before the group gives up (a peer that keeps failing)


class VotedOptimizer:
    """The optimizer of a replica group: zero_grad() joins the step's quorum (the live groups,
    healing this one first if it is behind); average_gradients() averages the group's gradients
    (DDP's or FSDP's, already averaged within the group) over the live groups; step() applies
    the update only when that worked in every live group (`committed`), as torchft's
    OptimizerWrapper does, but saying whether it did. Everything else is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, replicas: "ReplicaGroups"):
        self.optimizer, self.replicas, self.committed = optimizer, replicas, True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.replicas.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def average_gradients(self) -> None:
        """One all-reduce of every gradient, flattened in the parameters' order, which every
        group shares (a DDP bucket's layout is not: a restarted group lays its buckets out
        anew). Each rank's part with FSDP: the groups shard alike."""
        grads = [param.grad for group in self.optimizer.param_groups
                 for param in group["params"] if param.grad is not None]
        local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
        flat = torch.cat([grad.reshape(-1) for grad in local])
        self.replicas.manager.allreduce(flat).wait()  # a lost group: the step is not committed
        offset = 0
        for grad in local:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def step(self, closure=None) -> None:
        self.committed = self.replicas.commit()
        if self.committed:
            self.optimizer.step(closure)

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)


def check_setup(env: DistEnv, cfg) -> None:
    """What replica groups need of a worker's setup, before the run folder is opened (start_run):
    a mistake is one line, and leaves neither a run folder nor a lock."""
    try:
        import torchft  # noqa: F401  (an optional extra)
    except ImportError:
        raise UserError(NEEDS_TORCHFT) from None
    if not env.launched:
        raise UserError("replica groups need torchrun: launch through run_replicas.sh or "
                        "run.sh, not python train.py")
    trackers = [name for name in ("mlflow", "wandb") if cfg.tracking.get(name)]
    if trackers:  # a tracker run is made before the groups know which one writes
        raise UserError(f"tracking.{trackers[0]}=true does not go with replica groups yet: "
                        f"set tracking.{trackers[0]}=false (train_log.jsonl and TensorBoard "
                        "have the run; a tracker can read them afterwards)")
    if cfg.train.checkpoint_async:
        raise UserError("train.checkpoint_async=true does not go with replica groups (the "
                        "group that writes a checkpoint may change before the write ends): "
                        "set train.checkpoint_async=false")
    # run.sh's preflight asked too, but the lighthouse may have gone since (a group that torchrun
    # restarts), or the launch did not go through run.sh. Rank 0's Manager is the one that
    # talks to the lighthouse.
    problem = lighthouse_problem(os.environ[LIGHTHOUSE_VAR]) if env.rank == 0 else None
    if problem:
        raise UserError(problem)


class ReplicaGroups:
    """This process's part in the replica groups: the torchft Manager (made at `join`, so the
    live groups do not wait on this one while it builds its model), what heals it, the step log."""

    def __init__(self, group: int, groups: int, env: DistEnv, device: torch.device, cfg):
        check_setup(env, cfg)
        self.group, self.groups, self.env, self.device = group, groups, env, device
        # torchft's own log says every quorum and each time that a flight recorder it does not
        # have (no NCCL here) could not be reset; this module says what a user needs to know.
        logging.getLogger("torchft").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        # A peer group that hangs (rather than dies) holds the others this long at most.
        self.timeout = datetime.timedelta(minutes=cfg.ddp.timeout_minutes)
        self.manager = None
        self.run = None
        self.tries, self.step_start, self.healed_at = 0, 0.0, None
        self.leading = False  # as the last quorum said (read without waiting: see leads)
        self.quorum_ready = False  # join's quorum is the first step's
        self.log_file = None

    def leads(self) -> bool:
        """Whether this group writes the run's files: the first live group of the last quorum
        (none before this group has joined one). Kept from start_step: asking the Manager
        would wait for the quorum, which may be what is asking (a peer's heal)."""
        return self.leading

    def join(self, run, resumed: bool) -> None:
        """Join the live groups with the run as start_run built it (`resumed`: from a checkpoint,
        or a restart of a run under way): its steps voted on from now on (train_step), and its
        state copied from a live group that is further on; the training log follows."""
        healed = self._join(run)
        run.replicas, run.train_step = self, train_step
        if self.leads() and not healed and resumed:
            run.training_log.resume(run.position, truncate=run.position.step < run.total_steps)
        elif healed:
            run.training_log.resume(run.position, truncate=False)

    def _join(self, run) -> bool:
        """The Manager made and the first quorum formed; True when this group healed."""
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.run = run
        pg = (ProcessGroupNCCL(timeout=self.timeout) if self.device.type == "cuda"
              else ProcessGroupGloo(timeout=self.timeout))
        self.manager = Manager(pg=pg, load_state_dict=None, state_dict=None,
                               min_replica_size=1, use_async_quorum=False,
                               replica_id=str(self.group), timeout=self.timeout,
                               quorum_timeout=self.timeout, max_retries=MAX_TRIES)
        self.manager.register_state_dict_fn("run", self._load_state, self._state)
        self.manager.load_state_dict({"step": run.position.step, "batches_committed": 0})
        run.optimizer = VotedOptimizer(run.optimizer, self)
        run.buckets_settled = True  # no extra backward: each one is a step of every group
        if self.env.rank == 0:
            folder = run.run_dir / "replica_groups"
            folder.mkdir(exist_ok=True)
            self.log_file = open(folder / f"group-{self.group}.jsonl", "a")  # noqa: SIM115
        start = run.position.step
        self.start_step()
        # A launch's first start (not a torchrun restart of this group), not healed into a run
        # under way: the launcher started the other groups at the same time.
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and run.position.step == start:
            self.wait_for_every_group()
        self.quorum_ready = True
        healed = self.healed_at is not None
        log.info("replica group %d of %d: %s at step %d with %d group(s) live", self.group,
                 self.groups, "healed from a live group" if healed else "joined",
                 run.position.step if healed else start, self.manager.num_participants())
        return healed

    def wait_for_every_group(self) -> None:
        """Quorums until every group is in one (up to the timeout), the last of them the next
        step's. A launch starts so: the lighthouse forms a quorum of the groups that have joined
        it, and the others would heal into a run under way (or, resuming, train on alone from
        the checkpoint they read while a group that finished was leaving). Only where every live
        group waits so too: a group that trains meanwhile would count this one in its step."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.manager.num_participants() < self.groups and time.monotonic() < deadline:
            time.sleep(0.1)  # the others are still starting (seconds): ask again
            self.manager.start_quorum()
        self.leading = self.manager.participating_rank() == 0
        self.quorum_ready = True

    def start_step(self) -> None:
        """The step's quorum; heals this group first when a live one is further on."""
        if self.tries == 0:
            self.step_start = time.perf_counter()
        if self.quorum_ready:  # the quorum join formed: every live group counts it as this step's
            self.quorum_ready = False
            return
        self.manager.start_quorum()
        self.leading = self.manager.participating_rank() == 0

    def commit(self) -> bool:
        """Whether every live group's gradients were averaged in this step (all of this group's
        ranks agree); then the step is written to the group's step log."""
        committed = self.manager.should_commit()
        self.tries += 1
        if committed:
            self.run.training_log.replica_groups.append(self.manager.num_participants())
            self._record({"step": self.run.position.step + 1,
                          "groups": self.manager.num_participants(),
                          "seconds": round(time.perf_counter() - self.step_start, 6),
                          "tries": self.tries, "time": time.time()})
            self.tries = 0
        else:
            log.warning("replica group %d: step %d was not applied (a group was lost during "
                        "it): trying it again with the groups still live", self.group,
                        self.run.position.step + 1)
        return committed

    def participants(self) -> int:
        return self.manager.num_participants() if self.manager is not None else 0

    def finish(self, model: torch.nn.Module) -> None:
        """The step log's last line: a digest of the final weights (equal in every group)."""
        self._record({"end": True, "step": self.run.position.step,
                      "weights_sha256": weights_digest(model)})
        if self.log_file is not None:
            self.log_file.close()
        self.manager.shutdown(wait=False)

    def _record(self, record: dict) -> None:
        if self.log_file is not None:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    # -- healing: what a live group sends a joining one ----------------------------------------

    def _state(self) -> dict:
        run = self.run
        parts = {name: part.state_dict() for name, part in run.parts().items()
                 if part is not None}
        position = run.position
        return {"parts": parts, "rng": rng_state(),
                "position": [position.step, position.epoch, position.step_in_epoch]}

    def _load_state(self, state: dict) -> None:
        run = self.run
        for name, part in run.parts().items():
            if part is not None and name in state["parts"]:
                part.load_state_dict(state["parts"][name])
        set_rng_state(state["rng"])
        run.position.step, run.position.epoch, run.position.step_in_epoch = state["position"]
        run.checkpointer.last_saved = run.position.step
        self.healed_at = run.position.step


def train_step(model, optimizer, micro_batches, task, device, speed, scaler, grad_clip):
    """A replica group's optimizer step (run_state.train_step's, voted on): the step's quorum
    (zero_grad), the gradients averaged within the group and then over the live groups, and the
    update applied only when every live group took part; when a group was lost during the step,
    the same micro-batches run again with the groups still live."""
    while True:
        optimizer.zero_grad(set_to_none=True)
        values, samples = compute_gradients(model, micro_batches, task, device, speed, scaler)
        optimizer.average_gradients()
        grad_norm = apply_gradients(model, optimizer, scaler, grad_clip)
        if optimizer.committed:
            return values, samples, grad_norm


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, in order: equal digests, equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            digest.update(name.encode())
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def step_log(run_dir: Path, group: int) -> list[dict]:
    """A group's step log, as written (for tests and report tools)."""
    path = Path(run_dir) / "replica_groups" / f"group-{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
