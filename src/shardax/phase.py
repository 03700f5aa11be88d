"""What a command says while a slow phase runs: that it started, that it still runs (a
heartbeat), and how long it took, as lines on stdout where the banner and the step lines go.

Light on purpose (the standard library and jax, which ``import shardax`` loads anyway):
``shardax train`` says its first phase before it imports the train stack (Flax, Optax,
Orbax), and before a JAX backend starts, so the process that speaks may be given (``main``)
instead of asked of JAX.

>>> with phase("loading", main=True, every=60):
...     pass
shardax train: loading ...
shardax train: loading ... 0.0 s
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import jax

__all__ = ["HEARTBEAT_S", "Beat", "phase", "say"]

HEARTBEAT_S = 30.0  # a phase or step still running says so this often


def say(line: str, main: bool | None = None) -> None:
    """One line of the run's report on stdout, by the ``main`` process only (None: JAX's
    process 0, which starts JAX's backend if it has not started)."""
    if main if main is not None else jax.process_index() == 0:
        print(line, flush=True)


class Beat:
    """Calls ``say(seconds since start)`` every ``every`` seconds from a daemon thread until
    stopped; ``reset`` restarts the count (something was just said)."""

    def __init__(self, say: Callable[[float], None], every: float):
        self.say, self.every = say, every
        self.start = self.last = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(max(self.last + self.every - time.perf_counter(), 0.05)):
            now = time.perf_counter()
            if now - self.last >= self.every:
                self.last = now
                self.say(now - self.start)

    def reset(self) -> None:
        self.start = self.last = time.perf_counter()

    def stop(self) -> float:
        self.done.set()
        return time.perf_counter() - self.start


@contextmanager
def phase(what: str, command: str = "train", every: float = HEARTBEAT_S,
          main: bool | None = None) -> Iterator[None]:
    """Says on stdout that ``what`` started, every ``every`` seconds that it still runs, and
    how long it took (a phase that may take more than a few seconds: compiling, loading).
    ``main``: whether this process speaks (None: JAX's process 0; give it before a backend
    starts).

    >>> with phase("compiling the train step"):  # doctest: +SKIP
    ...     compiled = lowered.compile()
    shardax train: compiling the train step ...
    shardax train: compiling the train step ... 12.3 s
    """
    if main is None:
        main = jax.process_index() == 0
    say(f"shardax {command}: {what} ...", main)
    beat = Beat(lambda s: say(f"shardax {command}: {what} ... {s:.0f} s so far", main), every)
    try:
        yield
    except BaseException:
        beat.stop()  # the error says what went wrong
        raise
    say(f"shardax {command}: {what} ... {beat.stop():.1f} s", main)
