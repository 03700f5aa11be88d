"""What each ``--objective`` trains with: its inputs, its compiled step and its set-up.

The training loop (`shardax.train.loop`) asks `objective_of` and nothing else about the
objective, so a new one is a row of `OBJECTIVES`: how its data is read (``inputs(run,
run_dir) -> Inputs``), its sharded step (``step(run, graphdef, end_id=...)``, called with
``(state, batch)``) and what happens once before the first step (``setup(run, run_dir,
inputs, graphdef, state, start)``: DPO's reference log-probabilities, computed from the
initial state and saved, or read back when the run resumes).

>>> objective_of(TrainConfig(objective="dpo")).step.__module__
'shardax.train.post.preference_step'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from shardax import _compat
from shardax.train import build
from shardax.train.config import TrainConfig
from shardax.train.inputs import Inputs, prepare_inputs
from shardax.train.post import preference_step
from shardax.train.post.preference_batches import (
    REFERENCE_FILE,
    preference_inputs,
    read_reference,
    write_reference,
)
from shardax.train.resolve import Resolved
from shardax.train.run.report import phase
from shardax.train.rundir import RunDir

__all__ = ["OBJECTIVES", "Objective", "objective_of"]


class Objective(NamedTuple):
    """How the loop trains one objective (see the module's doc)."""

    inputs: Callable[[Resolved, RunDir], Inputs]
    step: Callable[..., Any]
    setup: Callable[..., None]


def _nothing(run: Resolved, run_dir: RunDir, inputs: Inputs, graphdef: Any, state: Any,
             start: int) -> None:
    """No set-up."""


def _reference(run: Resolved, run_dir: RunDir, inputs: Inputs, graphdef: Any, state: Any,
               start: int) -> None:
    """DPO's reference log-probabilities of every row: a resumed run reads the run's file;
    a new one computes them from its initial state (sharded, as the step runs) and writes
    the file (process 0)."""
    data, path = inputs.train, run_dir.out / REFERENCE_FILE
    if start > 0:
        data.reference = read_reference(path, data)
        return
    with phase("computing the reference log-probabilities"):
        chunks = ((inputs.global_batch(local), valid)
                  for local, valid in data.chunks(inputs.rows))
        data.reference = preference_step.reference_logps(run, graphdef, state, lambda: chunks)
    if jax.process_index() == 0:
        write_reference(path, data, data.reference)
    _compat.sync_processes("shardax-reference-logps")


_PREFERENCE = dict(inputs=preference_inputs, step=preference_step.step_function)

#: ``--objective`` -> how it trains.
OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(prepare_inputs, build.step_function, _nothing),
    "dpo": Objective(**_PREFERENCE, setup=_reference),
    "simpo": Objective(**_PREFERENCE, setup=_nothing),
    "orpo": Objective(**_PREFERENCE, setup=_nothing),
}


def objective_of(config: TrainConfig) -> Objective:
    """How ``config.objective`` trains (a row of `OBJECTIVES`)."""
    return OBJECTIVES[config.objective]
