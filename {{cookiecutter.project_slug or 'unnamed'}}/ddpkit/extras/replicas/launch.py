"""What a replica group's launch needs before any process starts, without importing torch (run.sh's
preflight asks launch_problem, in milliseconds): this group and the group count from the
environment, torchft installed, a lighthouse that answers at TORCHFT_LIGHTHOUSE; and the pieces
of a run that follow from them (the shared run folder, the ranks the data is split over).
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.util
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ddpkit.project import UserError

if TYPE_CHECKING:  # (dist_utils imports torch, which the preflight does without)
    from ddpkit.dist_utils import DistEnv

GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR = "REPLICA_GROUP", "REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"


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


def replica_run_dir(cfg: DictConfig) -> tuple[Path, bool]:
    """Replica groups share one run folder, named by the job id they share (run.dir if set), so
    that groups starting at once find the same one without asking each other. Returns it, and
    whether this call created it."""
    if cfg.run.dir:
        path = Path(cfg.run.dir)
    elif os.environ.get("DDP_JOB_ID"):  # run.sh's: RDZV_ID or the SLURM job id
        path = Path(cfg.run.output_dir) / f"{cfg.run.name}-{os.environ['DDP_JOB_ID']}"
    else:
        raise UserError("replica groups need a job id to share their run folder: set RDZV_ID "
                        "(run_replicas.sh sets one), or give run.dir")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, created
