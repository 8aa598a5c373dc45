"""Your tasks: a loss, logged scalars or metrics the built-in tasks lack. This file is yours: the
template starts it and never changes it again (`cruft update` skips it), so write here freely.

Subclass a built-in task (or `Task`, the interface) and register it in `TASKS`; select it with
`task.name=<key>`:

    class MyBinary(BinaryTask):
        def loss(self, outputs, batch):
            return {"bce": super().loss(outputs, batch), "extra": ...}

    TASKS["my_binary"] = MyBinary

Every command loads this file (ddpkit/recipes.py) before it looks a task up, so every entry you add
here is seen. The interface and the built-in tasks (multiclass, binary, regression) live in
ddpkit/tasks.py, which is the template's: read it for what each method receives and returns. A
setting of your own (`task.<name>`) is declared in settings.py.
"""

import numpy as np  # noqa: F401
import torch  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from omegaconf import DictConfig  # noqa: F401

from ddpkit.splits import Splits  # noqa: F401
from ddpkit.tasks import TASKS, BinaryTask, MulticlassTask, RegressionTask, Task  # noqa: F401
