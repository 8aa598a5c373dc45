"""Where the project lives, and the one kind of error a user fixes by changing their input."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[1]  # the folder of train.py and your files
# run.sh's exit status when the job stopped on purpose with a checkpoint saved (sysexits'
# EX_TEMPFAIL): the same command resumes, on any launcher (run_folder.continued_run; its line
# prints that command). Every cluster launcher restarts on it (targets.py).
PREEMPTED_EXIT = 75


class UserError(Exception):
    """A mistake the user fixes by changing a command line, a config file, a path or a file of
    theirs.

    Entry points print its message once (on rank 0) and exit with status 2, no traceback.
    """
