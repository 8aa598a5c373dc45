"""The template's engine: distributed set-up, data, training, checkpoints, evaluation, launch.

Everything in this folder comes from the template and is replaced by `cruft update`; your own
code lives in the files beside it (model.py, data_sources.py, tasks.py, settings.py), which import
from here and are never imported by it: the entry points load them with `recipes.load()`.
"""

# The template release this engine belongs to (the template's CHANGELOG.md lists them): printed
# beside each run's folder, and recorded in each checkpoint's state.pt as `template_version`.
__version__ = "1.1.0"
