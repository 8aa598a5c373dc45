"""The template's engine: distributed set-up, data, training, checkpoints, evaluation, launch.

Everything in this folder comes from the template and is replaced by `cruft update`; your own
code lives in the files beside it (model.py, data_sources.py, tasks.py, settings.py), which import
from here and are never imported by it: the entry points load them with `recipes.load()`.
"""
