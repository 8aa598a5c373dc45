"""The template's engine: distributed set-up, data, training, checkpoints, evaluation, launch.

Everything in this folder comes from the template and is replaced by `cruft update`; your own
code lives in the files beside it (model.py, data_sources.py, tasks.py, settings.py), which import
from here and are never imported by it: the entry points load them with `recipes.load()`.
"""

# The template release this engine belongs to (the template's CHANGELOG.md lists them): printed
# beside each run's folder, and recorded in each checkpoint's state.pt as `template_version`.
__version__ = "1.1.0"

import gc as _gc
import sys as _sys
from pathlib import Path as _Path

# A command of this project (`python train.py`, `python -m ddpkit.worker ...`) imports torch next:
# millions of objects that live as long as the process, which the garbage collector would walk
# again and again while they are made (0.8 s of CPU at the start of every process). Until
# lifecycle.run_main starts the command's work (which freezes them out of its way and sets the
# collector back: collector_as_usual), it runs once every STARTUP_COLLECTION allocations.
STARTUP_COLLECTION = 100_000
_COLLECTOR = _gc.get_threshold()
if "torch" not in _sys.modules and _sys.argv and (
        _sys.argv[0] == "-m" or _sys.argv[0].endswith(".py") and _Path(_sys.argv[0]).resolve()
        .parent == _Path(__file__).resolve().parents[1]):  # (not `python -c`: no run_main)
    _gc.set_threshold(STARTUP_COLLECTION, *_COLLECTOR[1:])


def collector_as_usual() -> None:
    """The command's imports are done: what they made is frozen (never walked again) and the
    garbage collector runs at its usual thresholds."""
    if _gc.get_threshold()[0] == STARTUP_COLLECTION:
        _gc.freeze()
        _gc.set_threshold(*_COLLECTOR)
