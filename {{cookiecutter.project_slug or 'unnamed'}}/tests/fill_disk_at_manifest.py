"""train.py on a disk that fills up exactly when a checkpoint's manifest is written: before the
manifest of the checkpoint FILL_AT_STEP, rank 0 fills the disk of FILL_DIR with one file. Run by
test_cluster.py through run.sh, to see that the message gives the space there was when the write
failed, not the space its removal freed again."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import checkpoint, lifecycle  # noqa: E402

real_write_manifest = checkpoint.write_manifest  # as the Checkpointer calls it


def fill(folder: Path) -> None:
    """Write zeros into folder/filler until the disk is full."""
    with open(folder / "filler", "wb") as handle:
        try:
            while True:
                handle.write(bytes(1 << 16))
                handle.flush()
        except OSError:
            pass


def write_manifest_on_a_full_disk(folder: Path) -> None:
    if folder.name == f".step-{int(os.environ['FILL_AT_STEP']):08d}.tmp":
        fill(Path(os.environ["FILL_DIR"]))
    real_write_manifest(folder)


checkpoint.write_manifest = write_manifest_on_a_full_disk

if __name__ == "__main__":
    lifecycle.run_main(train.main)
