"""``shardax train --eval-tasks``: lm-evaluation-harness scores of the model as it trains.

`TaskEvals` is made at start-up (`shardax.train.loop.prepare`): it indexes the tasks
(``--include-path``'s YAMLs, else lm-eval's own) and checks every name before the first step.
Every ``--eval-tasks-every`` steps (default ``--eval-every``; and at the last step)
`TaskEvals.scores` runs the tasks through `shardax.train.harness.ShardaxLM` on the train
state's own sharded arrays (merged into the model, not copied; no checkpoint round trip), the
same `ShardaxLM` and its compiled forward at every call. Each task's numeric metrics are
logged as ``eval/<task>/<metric>`` (``eval/<task>/<metric>/<filter>`` for a filter other
than lm-eval's ``none``), with the step's other metrics. They are not state: a resumed run
has nothing of them to restore.

This module imports lm-eval (the optional extra ``shardax[eval]``) only when ``--eval-tasks``
is given.

Example::

    tasks = TaskEvals.start(run, tokenizer)       # None without --eval-tasks
    if tasks is not None and tasks.due(step):
        record.update(tasks.scores(graphdef, state))
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from shardax import layout
from shardax.data.tokenizer import Tokenizer
from shardax.train.config import EvalConfig
from shardax.train.resolve import Resolved
from shardax.train.step import TrainState

__all__ = ["TaskEvals", "metric_record"]


def metric_record(results: dict) -> dict[str, float]:
    """``eval/<task>/<metric>`` of lm-eval's ``results`` (numeric values only).

    >>> metric_record({"results": {"mc": {"alias": "mc", "acc,none": 0.5,
    ...                                   "acc_stderr,none": "N/A", "em,strict": 1.0}}})
    {'eval/mc/acc': 0.5, 'eval/mc/em/strict': 1.0}
    """
    record = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            record[f"eval/{task}/{name}"] = float(value)
    return record


class TaskEvals:
    """The ``--eval-tasks`` of a resolved run (module docstring)."""

    def __init__(self, run: Resolved, tokenizer: Tokenizer):
        from shardax.train import harness  # imports lm-eval: only where tasks run

        config = run.config
        self._harness, self.run, self.tokenizer = harness, run, tokenizer
        self.every = config.eval_every if config.eval_tasks_every is None \
            else config.eval_tasks_every
        self.config = EvalConfig(tasks=list(config.eval_tasks), include_path=config.include_path,
                                 num_fewshot=config.num_fewshot, limit=config.eval_limit,
                                 batch_size=config.batch_size)
        self.manager = harness.task_manager(self.config, "--eval-tasks")
        self.lm = None

    @classmethod
    def start(cls, run: Resolved, tokenizer: Tokenizer) -> TaskEvals | None:
        """The run's `TaskEvals`, its task names checked; None without ``--eval-tasks``."""
        return cls(run, tokenizer) if run.config.eval_tasks else None

    def due(self, done: int) -> bool:
        """Whether the tasks run after step ``done`` (1-based)."""
        return done == self.run.config.steps or bool(self.every and done % self.every == 0)

    def scores(self, graphdef: Any, state: TrainState) -> dict[str, float]:
        """``eval/<task>/<metric>`` of the model in ``state`` (its arrays as they are)."""
        model = nnx.merge(graphdef, state.params, state.rest)
        if self.lm is None:
            run = self.run
            lay = layout.Layout(attention=run.layout.attention,
                                scan_layers=run.layout.scan_layers)
            self.lm = self._harness.ShardaxLM(model, self.tokenizer, run.mesh, run.rules.rules,
                                              lay, batch_size=self.config.batch_size)
        else:
            self.lm.use(model)
        return metric_record(self._harness.evaluate_tasks(self.lm, self.config, self.manager))
