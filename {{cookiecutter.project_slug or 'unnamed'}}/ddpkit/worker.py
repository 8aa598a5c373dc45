"""What run.sh has torchrun start in each process: `python -m ddpkit.worker <script> <args>`.

The process's handlers are installed (lifecycle.install) before the script is even imported,
then the script runs as __main__, as `python <script>` would run it. So an error at the top of
the script (an import that fails, in every rank) is reported like an error inside run_main:
once, and not retried by torchrun's restarts. A worker restarted after a crash in native code
leaves first thing (ddpkit/crashes.py).
"""

import os
import runpy
import sys

from ddpkit import crashes


def main() -> None:
    crashes.leave_after_a_crash()  # a restart after a crash of the code: at once, without torch
    from ddpkit import lifecycle

    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python <script>` sets it
    try:
        lifecycle.install()  # (a Ctrl-C held back until it listens may come at once)
        # The script's absolute path, as `python <script>` has it (3.9+): tracebacks and the
        # stall watchdog find the project's frames by it.
        runpy.run_path(os.path.abspath(script), run_name="__main__")
    except KeyboardInterrupt:  # a Ctrl-C while the script is imported: as inside run_main
        lifecycle.leave_interrupted()
    except Exception as error:  # before the script's run_main: it reports everything after
        lifecycle.report_failure(error)


if __name__ == "__main__":
    main()
