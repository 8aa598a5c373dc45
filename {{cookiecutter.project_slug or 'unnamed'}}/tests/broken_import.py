"""An entry point that fails on import on every rank, as one does whose user file imports a
package that is not installed. Run by test_faults.py through run.sh."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit import dist_utils  # noqa: E402, F401  (first, as in the entry points: it reports the error)

# isort: split
import uninstalled_package  # noqa: E402, F401
