"""What the ``shardax`` commands tell the user besides their output: one line on stderr.

Every note of ``train``, ``generate`` and ``export`` goes through `note`, so each reads
``shardax COMMAND: message`` and a job of many processes says it once (process 0).

>>> note("train", "note: validation: skipped")  # doctest: +SKIP
"""

from __future__ import annotations

import sys

import jax

__all__ = ["note"]


def note(command: str, message: str) -> None:
    """Prints ``shardax COMMAND: message`` on stderr, from process 0 only."""
    if jax.process_index() == 0:
        print(f"shardax {command}: {message}", file=sys.stderr, flush=True)
