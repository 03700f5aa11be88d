"""Stopping a training run cleanly on SIGTERM (preemption) or Ctrl-C.

While `StopRequests` is active, SIGTERM and a first SIGINT only set a flag; the loop asks
`StopRequests.reached` after each step, saves that step and raises `Stopped`. A second SIGINT
aborts at once (exit status 130) without saving. The CLI turns `Stopped` into one line and the
exit status 128 + the signal number (143 for SIGTERM, 130 for SIGINT): the convention
schedulers read as "killed by that signal", so a preempted job is not mistaken for a finished
one.

With several processes, each process may see the signal after a different step, so they agree
on the step to stop at through JAX's preemption service
(``multihost_utils.reached_preemption_sync_point``): JAX's own SIGTERM handler notices the
signal and all processes stop after the same step. A first SIGINT is turned into a SIGTERM to
reach that handler.

>>> with StopRequests() as stop:
...     for step in range(3):
...         pass                          # one train step
...         if stop.reached(step + 1):    # SIGTERM / Ctrl-C arrived: save, then stop
...             raise Stopped(step + 1, stop.signum)
>>> Stopped(7, 15).exit_code
143
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from shardax import _compat
from shardax.train.run.notes import note

__all__ = ["StopRequests", "Stopped"]


class Stopped(Exception):
    """Training stopped on a signal after saving ``step``."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"stopped at step {step}, saved; continue with --resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as for a process killed by it."""
        return 128 + self.signum


def _preemption_service() -> bool:
    """Whether JAX's preemption sync service runs (multi-process jobs)."""
    return jax.process_count() > 1 and _compat.preemption_service_running()


class StopRequests:
    """Catches SIGTERM and SIGINT while active (main thread only; elsewhere it never stops)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._shared = False

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._shared = _preemption_service()
        signals = [signal.SIGINT] if self._shared else [signal.SIGINT, signal.SIGTERM]
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                print("shardax train: interrupted again; aborting without saving",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(128 + signal.SIGINT)
            return  # a repeated SIGTERM: the save is already on its way
        self.signum = signum
        note("train", f"received {signal.Signals(signum).name}; finishing this step and saving "
                      "it (Ctrl-C again aborts without saving)")
        if self._shared:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's handler, which tells the others

    def reached(self, step: int) -> bool:
        """Whether to stop after ``step``: all processes must call it after every step and
        get the same answer."""
        if self._shared:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        return self.signum is not None
