"""Loaded at start-up by the Python processes that bench/peak.py starts (it puts this folder on
their PYTHONPATH, and only theirs): it records when the process's first optimizer step ends,
the same way for every contender, without touching their code.

Nothing is imported here beyond the standard library. When torch.optim.optimizer has been
imported (by `import torch`, whenever the script does it), a global post-step hook is registered
(torch.optim.optimizer.register_optimizer_step_post_hook: every optimizer, any loop); at its
first call it appends {"rank": RANK, "first_step": unix time} to $BENCH_PROBE_FILE and removes
itself, so later steps pay nothing.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

WATCHED = "torch.optim.optimizer"


def _record_first_step(module) -> None:
    def first_step(optimizer, args, kwargs) -> None:
        handle.remove()
        record = {"rank": int(os.environ.get("RANK", "0")), "first_step": time.time()}
        with open(os.environ["BENCH_PROBE_FILE"], "a") as out:
            out.write(json.dumps(record) + "\n")

    handle = module.register_optimizer_step_post_hook(first_step)


class _Watch(importlib.abc.MetaPathFinder):
    """Finds WATCHED as the path finder would, and registers the hook once it has run."""

    def find_spec(self, name, path, target=None):
        if name != WATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _record_first_step(module)

            spec.loader.exec_module = exec_module
        return spec


if os.environ.get("BENCH_PROBE_FILE"):
    sys.meta_path.insert(0, _Watch())
