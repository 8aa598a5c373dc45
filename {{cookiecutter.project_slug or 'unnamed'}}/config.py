"""Check a command line and print the resolved config as YAML (run.sh checks every launch so).

    python config.py [--world-size N] [--config FILE] [key=value ...]

The schema, its defaults and its checks are in ddpkit/config.py; your own settings in settings.py.
"""

import sys

from ddpkit.config import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
