"""Per-step fault tolerance with torchft: the job as replica groups that lose and regain members
without a restart (README: "When a machine is lost").

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
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import http.client
import importlib.util
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.project import UserError

# torch, and the modules of ddpkit that import it, are imported where they are used: run.sh's
# preflight checks a replica group's launch with this module (launch_problem), in milliseconds.
if TYPE_CHECKING:
    import torch

    from ddpkit.dist_utils import DistEnv

log = logging.getLogger("ddp")

GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR = "REPLICA_GROUP", "REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
MAX_TRIES = 20  # consecutive failed steps before the group gives up (a peer that keeps failing)
NEEDS_TORCHFT = ("REPLICA_GROUP needs torchft, an optional extra: pip install -e '.[torchft]' "
                 "(README: \"When a machine is lost\")")
# How long a launch waits for the lighthouse to answer. One started beside the groups (by a
# script, or slurm.sbatch on another node) listens only once it has imported torch, a second or
# more after it starts; an address where none will answer costs no more than this.
LIGHTHOUSE_WAIT_S = 5.0
LIGHTHOUSE_PAGE = b"torchft"  # in the dashboard page every lighthouse serves at /


def from_environment() -> tuple[int, int] | None:
    """(this group, groups) when launched as a replica group, else None."""
    if GROUP_VAR not in os.environ:
        return None
    group, groups = os.environ[GROUP_VAR], os.environ.get(GROUPS_VAR, "")
    if not (group.isdigit() and groups.isdigit() and int(group) < int(groups)):
        raise UserError(f"{GROUP_VAR}={group} and {GROUPS_VAR}={groups} are not valid: "
                        f"{GROUPS_VAR} is the number of replica groups and {GROUP_VAR} this "
                        f"group's number, 0 to {GROUPS_VAR}-1 (run_replicas.sh sets both)")
    if not os.environ.get(LIGHTHOUSE_VAR):
        raise UserError(f"{GROUP_VAR} is set but {LIGHTHOUSE_VAR} is not: give the lighthouse's "
                        "address, http://<host>:<port> (run_replicas.sh starts one and sets it)")
    return int(group), int(groups)


def launch_problem() -> str | None:
    """What stops this launch as a replica group, in a sentence, before torchrun starts (run.sh's
    preflight): torchft missing, or no lighthouse at TORCHFT_LIGHTHOUSE. None when nothing does,
    or the launch is no replica group. Imports neither torch nor torchft."""
    try:
        if from_environment() is None:
            return None
    except UserError as error:
        return str(error)
    if importlib.util.find_spec("torchft") is None:
        return NEEDS_TORCHFT
    return lighthouse_problem(os.environ[LIGHTHOUSE_VAR])


def lighthouse_problem(address: str, seconds: float = LIGHTHOUSE_WAIT_S) -> str | None:
    """Why no torchft lighthouse answers at `address`, in a sentence; None when one does. It is
    asked for its dashboard page (HTTP, beside its gRPC service): torchft's client waits 60 s
    where nothing answers, and its one cheap call, a heartbeat, would make the lighthouse wait
    for this probe at the next quorum."""
    where = f"{LIGHTHOUSE_VAR}={address}"
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port
    except ValueError:  # not a number, or above 65535
        port = None
    if parts.scheme != "http" or not parts.hostname or not port or parts.path not in ("", "/"):
        return (f"{where} is not a lighthouse's address: give it as http://<host>:<port>, "
                "e.g. http://localhost:29510")
    verdict = []
    probe = threading.Thread(daemon=True, target=lambda: verdict.append(
        _ask_lighthouse(parts.hostname, port, time.monotonic() + seconds)))
    probe.start()
    probe.join(seconds + 1)  # past the deadline of its connect and read: a name lookup hangs
    absent, why = verdict[0] if verdict else (True, f"no answer in {seconds:g} s")
    if why is None:
        return None
    if absent:
        return (f"no torchft lighthouse at {where} ({why}): start it first (torchft_lighthouse "
                f"--min_replicas 1 --bind [::]:{port} on {parts.hostname}), or set "
                f"{LIGHTHOUSE_VAR} to its address (run_replicas.sh starts one and sets it)")
    return (f"{where} is not a torchft lighthouse ({why}): set {LIGHTHOUSE_VAR} to the "
            "lighthouse's address, http://<host>:<port>")


def _ask_lighthouse(host: str, port: int, deadline: float) -> tuple[bool, str | None]:
    """(whether nothing is there, why it is no lighthouse: None when it is one)."""
    connection = http.client.HTTPConnection(host, port)
    try:
        while True:
            connection.timeout = max(deadline - time.monotonic(), 0.01)
            try:
                connection.connect()
                break
            except ConnectionRefusedError:
                if time.monotonic() + 0.1 > deadline:
                    return True, "nothing listens there"
                time.sleep(0.1)  # a lighthouse that is starting: it listens within seconds
            except socket.gaierror:
                return True, f"host {host} not found"
            except TimeoutError:
                return True, "the host does not answer"
            except OSError as error:  # no route to the host, the network down
                return True, (error.strerror or str(error)).lower()
        try:
            connection.request("GET", "/")
            response = connection.getresponse()
            page = response.read(1 << 16)
        except TimeoutError:
            return False, "the program there sends no answer"
        except (OSError, http.client.HTTPException):
            return False, "the program there does not answer as a web server"
    finally:
        connection.close()
    if response.status != 200:
        return False, f"the program there answers HTTP {response.status} {response.reason}"
    if LIGHTHOUSE_PAGE not in page:
        return False, "a web server that is not the lighthouse answers there"
    return False, None


def data_env(env: DistEnv, groups: tuple[int, int] | None) -> DistEnv:
    """The ranks the training data is sharded over: every process of every replica group."""
    if groups is None:
        return env
    group, count = groups
    return dataclasses.replace(env, rank=group * env.world_size + env.rank,
                               world_size=count * env.world_size, launched=True)


class VotedOptimizer:
    """The optimizer of a replica group: zero_grad() joins the step's quorum (the live groups,
    healing this one first if it is behind); average_gradients() averages the group's gradients
    (DDP's or FSDP's, already averaged within the group) over the live groups; step() applies
    the update only when that worked in every live group (`committed`), as torchft's
    OptimizerWrapper does, but saying whether it did. Everything else is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, replicas: ReplicaGroups):
        self.optimizer, self.replicas, self.committed = optimizer, replicas, True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.replicas.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def average_gradients(self) -> None:
        """One all-reduce of every gradient, flattened in the parameters' order, which every
        group shares (a DDP bucket's layout is not: a restarted group lays its buckets out
        anew). Each rank's part with FSDP: the groups shard alike."""
        import torch
        from torch.distributed.tensor import DTensor

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
        from ddpkit import dist_utils

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
        dist_utils.lead_group = self.leads

    def leads(self) -> bool:
        """Whether this group writes the run's files: the first live group of the last quorum
        (none before this group has joined one). Kept from start_step: asking the Manager
        would wait for the quorum, which may be what is asking (a peer's heal)."""
        return self.leading

    def join(self, run) -> bool:
        """Join the live groups with the run as start_run built it (a new run or a resumed
        checkpoint): its gradients averaged over the groups from now on, and its state copied
        from a live group that is further on. True when it was."""
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
        from ddpkit.checkpoint import rng_state

        run = self.run
        parts = {name: part.state_dict() for name, part in run.parts().items()
                 if part is not None}
        position = run.position
        return {"parts": parts, "rng": rng_state(),
                "position": [position.step, position.epoch, position.step_in_epoch]}

    def _load_state(self, state: dict) -> None:
        from ddpkit.checkpoint import set_rng_state

        run = self.run
        for name, part in run.parts().items():
            if part is not None and name in state["parts"]:
                part.load_state_dict(state["parts"][name])
        set_rng_state(state["rng"])
        run.position.step, run.position.epoch, run.position.step_in_epoch = state["position"]
        run.checkpointer.last_saved = run.position.step
        self.healed_at = run.position.step


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, in order: equal digests, equal weights."""
    import torch

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
