"""The checks made before torchrun starts a single worker (run.sh's launcher.py, and sweeps, call
`preflight`): each problem is one line, exit 2.

    python -m ddpkit.preflight --nproc-per-node N --nnodes M|MIN:MAX [--script train.py]
                        [--endpoint HOST:PORT --node-rank R --rdzv-conf K=V,...]
                        [--config FILE] [key=value ...]

checks the command line and this machine: it compiles the files of
your own (a syntax error would otherwise stop every rank, and every restart, with its own
traceback), checks the config (and, for train.py, that the global batch splits over N x M
processes, or over every world size an elastic MIN:MAX job can take), that this machine has the
GPUs the processes need, that ddp.backend=nccl has CUDA to run on, and that the rendezvous port of
a multi-node job is free on the head node (R = 0), or held by the job's rendezvous when the node
rank is not given, and that torchrun can read RDZV_CONF's values (a key it does not read is a
warning). torch is imported only on a machine with NVIDIA devices or a taken port, or for a
setting given that names something in torch or in your files (optim.name, optim.schedule,
train.best_metric, ...), so a plain launch on a CPU machine takes a fraction of a second.
"""

from __future__ import annotations  # (a Python too old to run the project gets its one line)

import datetime
import difflib
import errno
import os
import re
import socket
import sys
import threading
from pathlib import Path

# Nothing but the standard library here (these two import only it): the launcher looks up the
# project's packages before anything imports one; the checks below import them when they run.
from ddpkit.project import PROJECT_DIR
from ddpkit.recipes import RECIPES, SETTINGS

OWN_FILES = [f"{name}.py" for name in (SETTINGS, *RECIPES)]  # the files a user edits


class Refused(Exception):
    """A reason not to launch, in one line."""


def check_compiles(paths: list[str]) -> None:
    for name in dict.fromkeys(paths):
        path = Path(name) if Path(name).is_absolute() else PROJECT_DIR / name
        if not path.is_file():
            continue  # a missing file gets its own message where it is used
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as error:
            line = f" line {error.lineno}" if error.lineno else ""
            raise Refused(f"{name}{line}: {error.msg}: fix it and run again") from None
        except (ValueError, UnicodeDecodeError) as error:  # null bytes, not UTF-8
            raise Refused(f"{name}: {error}: fix it and run again") from None


def named_files(values: list[str]) -> list[str]:
    """The `path/file.py` of every `key=path/file.py:name` (a builder of the user's own)."""
    return [found for value in values for found in re.findall(r"([^=:\s]+\.py):\w", value)]


def visible_gpus() -> int:
    if not Path("/dev/nvidiactl").exists() and not os.environ.get("PREFLIGHT_ASSUME_NVIDIA"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise Refused(f"rendezvous endpoint {endpoint!r} needs a port: MASTER_PORT=29500")
    return host, int(port)


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def is_this_machine(host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))  # only an address of this machine binds
        except OSError:
            return False
    return True


def answers_as_a_store(host: str, port: int, seconds: float = 5) -> bool:
    """Whether a torchrun rendezvous store (a TCPStore) listens there. Its client waits forever
    on a program that accepts and never answers, so it gets a few seconds in a thread."""
    from torch.distributed import TCPStore

    answered = []
    client = threading.Thread(daemon=True, target=lambda: answered.append(TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds),
        wait_for_workers=False)))
    client.start()
    client.join(seconds)
    return bool(answered)


def check_rendezvous_port(endpoint: str, node_rank: str) -> None:
    """The head node (NODE_RANK=0) needs the port free. Without a node rank, torchrun hosts the
    rendezvous when the port is free and joins whatever holds it otherwise: a program that is
    not a store would keep it waiting, silently, until the join timeout."""
    host, port = split_endpoint(endpoint)
    if node_rank == "0" and port_taken(port):
        raise Refused(f"rendezvous port {port} on this head node ({host}) is already in use, "
                      "perhaps by another job: set MASTER_PORT to a free port")
    if (not node_rank and is_this_machine(host) and port_taken(port)
            and not answers_as_a_store(host, port)):
        raise Refused(f"rendezvous port {port} on this machine ({host}) is taken by a program "
                      "that is not torchrun's rendezvous, perhaps another job: set MASTER_PORT "
                      "to a free port")


# Settings that name something in torch or in your files. Checking them takes importing torch
# and your files (a second or two), so it is done here only when one is given; otherwise the
# workers check them as they start.
NAMED_SETTINGS = ("optim.name", "optim.args", "optim.schedule", "optim.param_groups",
                  "train.best_metric", "task.name")


def check_named_settings(cfg, given: list[str]) -> None:
    if not any(key.startswith(NAMED_SETTINGS) for key in given):
        return
    from ddpkit import recipes
    from ddpkit.config import UserError, lookup
    from ddpkit.schema import SCHEDULE_NAMES

    try:
        recipes.load()
    except UserError:
        raise
    except Exception:  # a file of yours that fails to import: the workers report it in full
        return
    from ddpkit import optimizers, schedules, tasks

    optimizers.check_optimizer(cfg)
    if cfg.optim.schedule not in SCHEDULE_NAMES:
        schedules.schedule_builder(cfg.optim.schedule)
    if cfg.optim.param_groups:
        lookup(optimizers.PARAM_GROUPS, cfg.optim.param_groups, "optim.param_groups",
               "a parameter-group builder")
    if cfg.task.name:
        task = lookup(tasks.TASKS, cfg.task.name, "task.name", "a task")
        tasks.check_best_metric(cfg.train.best_metric, [task], f"task.name={cfg.task.name}")
    else:  # the data's own task is known once the data is built: any task's metric here
        tasks.check_best_metric(cfg.train.best_metric, list(tasks.TASKS.values()), "any task")


# What torchrun's c10d rendezvous reads from --rdzv-conf (torch 2.9 to 2.14), and the values
# it takes: a whole number (seconds, or times), a flag, or one of a few words.
WHOLE, FLAG = "a whole number, at least 1", "true or false"
RDZV_KEYS = {**dict.fromkeys(("join_timeout", "last_call_timeout", "close_timeout",
                              "heartbeat_timeout", "read_timeout", "keep_alive_interval",
                              "keep_alive_max_attempt"), WHOLE),
             "is_host": FLAG, "store_type": "tcp or file"}
FLAG_WORDS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # as torchrun reads them


def readable_by_torchrun(kind: str, value: str) -> bool:
    if kind == WHOLE:
        return value.isdigit() and int(value) > 0
    if kind == FLAG:
        return value.lower() in FLAG_WORDS
    return value in kind.split(" or ")


def check_rdzv_conf(text: str) -> list[str]:
    """RDZV_CONF's key=value pairs: a value torchrun cannot read refuses the launch (torchrun
    would fail with two chained tracebacks); a key it does not read is a warning, returned (a
    newer torch may read it)."""
    warnings = []
    for pair in filter(None, text.split(",")):
        key, equals, value = pair.partition("=")
        if not (equals and key and value):
            raise Refused(f"RDZV_CONF={text} is not valid: give key=value pairs joined by commas, "
                          "e.g. RDZV_CONF=last_call_timeout=5")
        kind = RDZV_KEYS.get(key)
        if kind is None:
            close = difflib.get_close_matches(key, RDZV_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"RDZV_CONF: torchrun's c10d rendezvous does not read {key}, so "
                            f"{key}={value} has no effect{hint}")
        elif not readable_by_torchrun(kind, value):
            raise Refused(f"RDZV_CONF: {key}={value} is not valid: {key} must be {kind}")
    return warnings


def preflight(argv: list[str]) -> None:
    options, argv = leading_options(argv, {
        "--nproc-per-node": "1", "--nnodes": "1", "--script": "train.py", "--endpoint": "",
        "--node-rank": "", "--rdzv-conf": ""})
    nproc = int(options["--nproc-per-node"])
    low, _, high = options["--nnodes"].partition(":")
    nodes = range(int(low), int(high or low) + 1)  # an elastic job: any count in MIN..MAX
    for warning in check_rdzv_conf(options["--rdzv-conf"]):
        print(f"warning: {warning}", file=sys.stderr)
    check_compiles([*OWN_FILES, options["--script"], *named_files(argv)])
    from ddpkit.config import UserError, check_batch_divides, given_keys, load_config

    training = Path(options["--script"]).name == "train.py"
    try:
        cfg = load_config(argv, world_size=nproc * nodes[-1] if training else None)
        for count in nodes[:-1] if training else ():
            check_batch_divides(cfg, nproc * count, f" (NNODES={options['--nnodes']}: the job "
                                f"can shrink to {count} node(s))")
        if training:
            check_named_settings(cfg, given_keys(argv))
    except UserError as error:
        raise Refused(str(error)) from None
    check_compiles(named_files([str(cfg.data.dataset), str(cfg.model.name), str(cfg.task.name)]))

    gpus = visible_gpus()
    if cfg.ddp.backend == "nccl" and gpus == 0:
        raise Refused("ddp.backend=nccl needs CUDA GPUs and this machine has none: use "
                      "ddp.backend=gloo (or auto, which picks gloo on CPU)")
    if cfg.train.device == "cuda" and gpus == 0:
        raise Refused("train.device=cuda but this machine has no CUDA GPU: use train.device=auto")
    if cfg.train.device != "cpu" and 0 < gpus < nproc:
        raise Refused(f"{nproc} processes per node need {nproc} GPUs and this machine has "
                      f"{gpus}: set NPROC_PER_NODE={gpus} (or use more nodes)")
    if nodes[-1] > 1 and options["--endpoint"]:
        check_rendezvous_port(options["--endpoint"], options["--node-rank"])
    if training and "REPLICA_GROUP" in os.environ:  # torchft installed, its lighthouse there
        from ddpkit.extras.replicas.launch import launch_problem

        if problem := launch_problem():
            raise Refused(problem)


def leading_options(argv: list[str], defaults: dict[str, str]) -> tuple[dict[str, str], list]:
    """The options of `defaults` at the start of argv (each with its value), and the rest."""
    options = dict(defaults)
    while argv and argv[0] in options:
        options[argv[0]], argv = argv[1], argv[2:]
    return options, argv


def main(argv: list[str]) -> int:
    try:
        preflight(argv)
    except Refused as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    if "torch" in sys.modules:  # (a check imported it) its temporary folder, which os._exit skips
        from ddpkit.exits import remove_torch_temp_folder

        remove_torch_temp_folder()
    os._exit(code)  # not waiting for a store client that never got an answer
