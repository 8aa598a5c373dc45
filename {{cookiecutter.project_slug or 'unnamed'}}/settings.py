"""Settings of your own. This file is yours: the template starts it and never changes it again
(`cruft update` skips it), so write here freely.

The `data`, `model` and `task` sections of config.py extend the three classes below, so a field
declared here is a setting like any other: typed and checked, set in a YAML file or on the
command line (`model.aux_head=true`), printed by `python config.py` and saved with each run.
Builders read it from their section (`cfg.aux_head` in a model builder). Give each field a type
and a default (the default is documented here, not in configs/default.yaml, which shows the
template's settings), and a name the template's section does not use already (a test in
tests/test_config.py names any clash). Keep the three classes, even empty, and keep torch out of
this file: run.sh checks a command line with config.py in a fraction of a second.
"""

from dataclasses import dataclass


@dataclass
class DataSettings:
    """data.<name>: read by your dataset builders as cfg.<name>."""

    # data settings of your own:


@dataclass
class ModelSettings:
    """model.<name>: read by your model builders as cfg.<name>."""

    # model settings of your own:


@dataclass
class TaskSettings:
    """task.<name>: read by your tasks as self.cfg.<name>."""

    # task settings of your own:
