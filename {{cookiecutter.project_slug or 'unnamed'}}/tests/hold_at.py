"""Run a command of the project (a script, or `-m module`) held at one function, so that a test
can stop it there: HOLD_IN=module:attribute names the function (a class's method as
module:Class.method). Its first call creates the file HOLD_MARKER, then waits until the file
HOLD_RELEASE exists (if that is set) and goes on; a signal that stops the command cuts the wait
short. The test sends the signal once the marker is there: it arrives while the command is at
that function, however fast this machine is.

    HOLD_IN=ddpkit.writes:settle HOLD_MARKER=... python tests/hold_at.py -m ddpkit.tokens ...
"""

import importlib
import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

module_name, attribute = os.environ["HOLD_IN"].split(":")
owner = importlib.import_module(module_name)
*path, name = attribute.split(".")
for part in path:
    owner = getattr(owner, part)
real = getattr(owner, name)
calls = []


def held(*args, **kwargs):
    if not calls:
        calls.append(1)
        Path(os.environ["HOLD_MARKER"]).touch()
        release = os.environ.get("HOLD_RELEASE")
        while not release or not Path(release).exists():
            time.sleep(0.05)  # (a signal's handler raises out of the sleep)
    return real(*args, **kwargs)


setattr(owner, name, held)

if __name__ == "__main__":
    command = sys.argv[1:]
    if command[0] == "-m":
        sys.argv = command[1:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        sys.path[0] = str(Path(command[0]).resolve().parent)  # as `python <script>` sets it
        runpy.run_path(command[0], run_name="__main__")
