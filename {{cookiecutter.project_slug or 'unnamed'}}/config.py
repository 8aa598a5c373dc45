"""Check a command line and print the resolved config as YAML (run.sh checks every launch so).

    python config.py [--world-size N] [--config FILE] [key=value ...]
    python config.py --write-defaults    # configs/default.yaml, from ddpkit/schema.py
    python config.py --plan [--world-size N] [key=value ...]   # memory per process (will it fit?)

Every setting is declared in ddpkit/schema.py (its type, default, doc and the values it takes);
loading and checking are in ddpkit/config.py; your own settings in settings.py. The memory plan
(--plan) is ddpkit/memory_plan.py.
"""

import sys

from ddpkit.config import main

if __name__ == "__main__":
    if "--plan" in sys.argv[1:]:  # torch imported only for it: the check above stays fast
        from ddpkit.memory_plan import main as plan

        sys.exit(plan([arg for arg in sys.argv[1:] if arg != "--plan"]))
    sys.exit(main(sys.argv[1:]))
