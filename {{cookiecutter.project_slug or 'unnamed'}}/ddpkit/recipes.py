"""Loads your recipe files: the one place where the engine meets your code.

Your files import the engine (its registries MODELS, DATASETS, TASKS and its helpers); no engine
module imports them back. The entry points call `load()` once, before they look anything up, so
that what your files register is there. A file that cannot be imported (a syntax error, an import
of a module that moved) stops the run with one line naming the file and line.
"""

import importlib.util
import sys

from ddpkit.project import PROJECT_DIR, UserError

SETTINGS = "settings"  # read by the config schema; kept free of torch (run.sh checks configs fast)
RECIPES = ("model", "data_sources", "tasks")

# Engine modules that moved into this package, and what a recipe file imports instead.
# Deprecated, removed in release 2.0.0 (CHANGELOG.md): the move predates release 1.0.0, and a
# project baked before it rewrites its imports when it takes a 1.x release (docs/updates.md).
MOVED = {"builtin_models": "ddpkit.models", "builtin_datasets": "ddpkit.datasets",
         "builtin_tasks": "ddpkit.tasks", "splits": "ddpkit.splits", "config": "ddpkit.config"}


def load_settings():
    """settings.py, the classes that extend the data, model and task sections of the config."""
    return _load(SETTINGS)


def load() -> None:
    """Import all your recipe files (settings, models, datasets, tasks), each once."""
    for name in (SETTINGS, *RECIPES):
        _load(name)


def _load(name: str):
    path = PROJECT_DIR / f"{name}.py"
    known = sys.modules.get(name)
    if known is not None and getattr(known, "__file__", None) == str(path):
        return known
    if not path.is_file():
        raise UserError(f"{path.name} is missing from {PROJECT_DIR}: restore it (the template "
                        "starts it; an empty one is fine)")
    # Imported from its file, so that another installed module of the same name cannot stand in.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        where = f"{path.name} line {error.lineno}" if error.lineno else path.name
        raise UserError(f"{where}: {error.msg}: fix that line of your file") from None
    except ModuleNotFoundError as error:
        del sys.modules[name]
        if error.name not in MOVED:
            raise
        raise UserError(f"{path.name} imports {error.name}, which the template moved to "
                        f"{MOVED[error.name]}: write `from {MOVED[error.name]} import ...` at the "
                        "top of your file (README: Taking template updates)") from None
    except BaseException:
        del sys.modules[name]
        raise
    return module
