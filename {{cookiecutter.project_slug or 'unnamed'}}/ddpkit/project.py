"""Where the project lives, and the one kind of error a user fixes by changing their input."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[1]  # the folder of train.py and your files


class UserError(Exception):
    """A mistake the user fixes by changing a command line, a config file, a path or a file of
    theirs.

    Entry points print its message once (on rank 0) and exit with status 2, no traceback.
    """
