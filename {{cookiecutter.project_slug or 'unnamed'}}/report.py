"""Curves and a comparison table of runs (ddpkit/report.py):

    python report.py runs/a runs/b ...           # overlay the runs, print a comparison table
    python report.py runs/a --out runs/report    # where the PNG and the tables go
"""

import sys

from ddpkit.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
