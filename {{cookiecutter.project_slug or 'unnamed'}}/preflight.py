"""Checks run.sh makes before torchrun starts a single worker: each problem is one line, exit 2.

    python preflight.py --nproc-per-node N --nnodes M [--script train.py]
                        [--endpoint HOST:PORT --node-rank R] [--config FILE] [key=value ...]

It checks the config (and, for train.py, that the global batch splits over N x M processes),
that this machine has the GPUs the processes need, that ddp.backend=nccl has CUDA to run on, and
on the head node (R = 0) of a multi-node job that the rendezvous port is free. torch is imported
only on a machine with NVIDIA devices, so on a CPU machine this takes a fraction of a second.
"""

import errno
import os
import socket
import sys
from pathlib import Path

from config import UserError, load_config


def visible_gpus() -> int:
    if not Path("/dev/nvidiactl").exists() and not os.environ.get("PREFLIGHT_ASSUME_NVIDIA"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_port_free(endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise UserError(f"rendezvous endpoint {endpoint!r} needs a port: MASTER_PORT=29500")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", int(port)))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise UserError(
                    f"rendezvous port {port} on this head node ({host}) is already in use, "
                    "perhaps by another job: set MASTER_PORT to a free port"
                ) from None
            raise


def preflight(argv: list[str]) -> None:
    options = {"--nproc-per-node": "1", "--nnodes": "1", "--script": "train.py",
               "--endpoint": "", "--node-rank": ""}
    while argv and argv[0] in options:
        options[argv[0]], argv = argv[1], argv[2:]
    nproc, nnodes = int(options["--nproc-per-node"]), int(options["--nnodes"])
    training = Path(options["--script"]).name == "train.py"
    cfg = load_config(argv, world_size=nproc * nnodes if training else None)

    gpus = visible_gpus()
    if cfg.ddp.backend == "nccl" and gpus == 0:
        raise UserError("ddp.backend=nccl needs CUDA GPUs and this machine has none: use "
                        "ddp.backend=gloo (or auto, which picks gloo on CPU)")
    if cfg.train.device == "cuda" and gpus == 0:
        raise UserError("train.device=cuda but this machine has no CUDA GPU: use train.device=auto")
    if cfg.train.device != "cpu" and 0 < gpus < nproc:
        raise UserError(f"{nproc} processes per node need {nproc} GPUs and this machine has "
                        f"{gpus}: set NPROC_PER_NODE={gpus} (or use more nodes)")
    if nnodes > 1 and options["--node-rank"] == "0" and options["--endpoint"]:
        check_port_free(options["--endpoint"])


def main(argv: list[str]) -> int:
    try:
        preflight(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
