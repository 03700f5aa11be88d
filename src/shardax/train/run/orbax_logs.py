"""Orbax's log noise, silenced: its INFO/WARNING lines for the duration of a call
(`quiet_orbax`), and, for a program that opts in (`drop_orbax_errors`, the ``shardax``
command), its error reports of the failures shardax raises itself.

>>> with quiet_orbax():  # e.g. around opening a read-only CheckpointManager
...     pass
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator
from typing import Any

__all__ = ["drop_orbax_errors", "quiet_orbax"]


class _DropOrbaxErrors(logging.Filter):
    """Drops orbax's own error logs: tracebacks of its background save threads (absl) and of
    the futures it abandons after a failed write or read (asyncio, often at exit). Shardax
    raises those failures itself: `CheckpointWriteError`, `CorruptCheckpointError`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "orbax" in record.pathname:
            return False
        tb = record.exc_info[2] if record.exc_info else None
        frames = traceback.extract_tb(tb) if tb is not None else []
        return not ("orbax" in record.getMessage()
                    or any("orbax" in f.filename for f in frames))


_DROP_ORBAX_ERRORS = _DropOrbaxErrors()


def _orbax_unraisable(unraisable: Any) -> bool:
    """Whether an "Exception ignored in ..." report comes from orbax or TensorStore: a read
    coroutine abandoned after a failed read, or TensorStore calling back into the event loop
    orbax already closed ("Event loop is closed")."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
        return True
    tb = unraisable.exc_traceback
    frames = traceback.extract_tb(tb) if tb is not None else []
    where = f"{unraisable.err_msg or ''} {unraisable.object!r}"
    return any(name in where for name in ("orbax", "tensorstore")) or any(
        "orbax" in f.filename or "tensorstore" in f.filename for f in frames)


def drop_orbax_errors() -> None:
    """Installs `_DropOrbaxErrors` on the loggers orbax's errors reach, and a
    ``sys.unraisablehook`` that drops orbax's and TensorStore's late reports (once; it stays,
    as abandoned futures are reported as late as interpreter exit). A process-wide change, so
    only a program that reports checkpoint failures itself opts in: the ``shardax`` command
    does, before it starts a backend; building a `Checkpointer` changes nothing."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _DROP_ORBAX_ERRORS not in logger.filters:
            logger.addFilter(_DROP_ORBAX_ERRORS)
    previous = sys.unraisablehook
    if getattr(previous, "_shardax", False):
        return

    def hook(unraisable: Any) -> None:
        if not _orbax_unraisable(unraisable):
            previous(unraisable)

    hook._shardax = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Silences orbax's INFO/WARNING log lines (e.g. one per option a read-only manager
    resets) for the duration; errors still show."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)
