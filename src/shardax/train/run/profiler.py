"""``--profile-steps 10:13``: a ``jax.profiler`` trace of chosen train steps, in the run directory.

The trace covers steps ``start`` to ``stop - 1`` (a Python range; steps count from 1, as in
``metrics.jsonl``), each wrapped in a ``jax.profiler.StepTraceAnnotation`` so viewers mark
the step boundaries. It lands in ``<run>/profile/plugins/profile/<time>/``: an ``.xplane.pb``
for TensorBoard's profile plugin / XProf and a ``perfetto_trace.json.gz`` for
https://ui.perfetto.dev.

>>> profiler = StepProfiler(parse_profile_steps("10:13"), Path("runs/a/profile"))  # doctest: +SKIP
>>> profiler.before(10); state = step_fn(state, batch); profiler.after(10, state)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

__all__ = ["parse_profile_steps", "StepProfiler", "trace_files"]

log = logging.getLogger("shardax.train")


def parse_profile_steps(text: str) -> range | None:
    """``'10:13'`` -> ``range(10, 13)``; ``'12'`` -> ``range(12, 13)``; ``''`` -> None.
    A ValueError names the flag.

    >>> parse_profile_steps('10:13')
    range(10, 13)
    """
    if not text:
        return None
    start, sep, stop = text.partition(":")
    try:
        first = int(start)
        end = int(stop) if sep else first + 1
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: expected START:STOP, e.g. 10:13") from None
    if first < 1 or end <= first:
        raise ValueError(f"--profile-steps {text!r}: need 1 <= START < STOP (steps count from 1)")
    return range(first, end)


class StepProfiler:
    """Starts a trace before the first chosen step and stops it after the last one."""

    def __init__(self, steps: range | None, logdir: Path):
        self.steps, self.logdir, self.active = steps, Path(logdir), False
        self._annotation: Any = None

    def before(self, step: int) -> None:
        """Call before running train step ``step``: starts the trace at the first chosen step
        and opens the step's ``StepTraceAnnotation``."""
        if not self.steps or step not in self.steps:
            return
        if not self.active:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir), create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d-%d into %s", self.steps[0], self.steps[-1], self.logdir)
        self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
        self._annotation.__enter__()

    def after(self, step: int, outputs: Any = None) -> None:
        """Call after train step ``step`` with its outputs: waits for them (so the device work
        is inside the trace), closes the step's annotation, and stops after the last step."""
        if self._annotation is None or not self.steps or step not in self.steps:
            return
        jax.block_until_ready(outputs)
        self._annotation.__exit__(None, None, None)
        self._annotation = None
        if step == self.steps[-1]:
            self.stop()

    def stop(self) -> None:
        """Ends the trace if one is running (also when a run stops early)."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info("wrote a profile of steps %d-%d to %s", self.steps[0], self.steps[-1],
                     self.logdir)


def trace_files(logdir: Path) -> list[Path]:
    """The trace files a profile wrote under ``logdir`` (xplane.pb and perfetto json.gz)."""
    root = Path(logdir)
    return sorted([*root.rglob("*.xplane.pb"), *root.rglob("perfetto_trace.json.gz")])
