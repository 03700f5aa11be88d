"""The error types every layer of shardax raises for the user to read.

A bottom module (it imports nothing of shardax), so the planner, the data readers and the
checkpointer raise the same types without importing the training wing. The ``shardax``
command prints `UsageError` and `DataError` as one line and exits with code 2.

>>> raise UsageError("--steps 0: must be >= 1")
Traceback (most recent call last):
shardax.errors.UsageError: --steps 0: must be >= 1
"""

from __future__ import annotations

__all__ = [
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "DataError",
    "MissingExtra",
    "UsageError",
    "require",
]


class UsageError(ValueError):
    """Bad input from the user: the CLI prints it as one line and exits with code 2."""


class DataError(ValueError):
    """Unusable ``--data``: the message is one line naming the file and what to do."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint step could not be read back intact."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint step could not be written (a full disk, a lost mount, no permission);
    the step was never committed, so the older committed steps are untouched."""

    def __init__(self, step: int | None, directory: str, reason: str, committed: list[int]):
        self.step, self.directory, self.reason = step, directory, reason
        before = [s for s in committed if step is None or s < step]
        kept = (f"the newest committed checkpoint, step {before[-1]}, is intact: continue from "
                "it with --resume" if before else "no checkpoint was committed before it")
        which = f"step {step}" if step is not None else "a step"
        super().__init__(f"cannot write checkpoint {which} in {directory} ({reason}); {kept} "
                         "once the cause is fixed")


def require(ok: bool, message: str) -> None:
    """Raises `UsageError` with ``message`` unless ``ok``: one line per check of user input.

    >>> require(3 >= 1, "--steps 3: must be >= 1")  # nothing happens
    """
    if not ok:
        raise UsageError(message)
