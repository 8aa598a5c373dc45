"""Check a command line and print the resolved config as YAML (run.sh checks every launch so).

    python config.py [--world-size N] [--config FILE] [key=value ...]
    python config.py --write-defaults    # configs/default.yaml, from ddpkit/schema.py

Every setting is declared in ddpkit/schema.py (its type, default, doc and the values it takes);
loading and checking are in ddpkit/config.py; your own settings in settings.py.
"""

import sys

from ddpkit.config import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
