"""GRPO reward functions from the user's code (``--reward SPEC``), called and checked as TRL does.

A spec is ``path/to/file.py:function`` or ``package.module:function``. The function is called
as ``function(prompts=[...], completions=[...], **fields) -> list[float]``, where ``fields`` are
the prompt records' other columns as lists (one entry per completion), as TRL's
``GRPOTrainer`` passes a dataset's extra columns; ``None`` means "not applicable" and counts
as NaN, and several functions are summed with weights by ``nansum`` (TRL's rule). Running the
user's function is the point here, as in TRL: these modules are the only code of the user's
that shardax executes (data, configs and checkpoints never run code).

>>> def length(prompts, completions, **fields):
...     return [float(len(c)) for c in completions]
>>> total, per_function = RewardSet([length], weights=[0.5])(["p", "p"], ["ab", "abcd"],
...                                                          [{"prompt": "p"}] * 2)
>>> total.tolist(), per_function["length"].tolist()
([1.0, 2.0], [2.0, 4.0])
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import numbers
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardax.errors import UsageError

__all__ = ["RewardError", "RewardSet", "load_reward", "reward_metrics"]

# Record columns that are not passed as fields: the prompt itself (as text or chat messages)
# and names that would collide with the two arguments every reward function gets.
_NOT_FIELDS = ("prompt", "messages", "completion", "prompts", "completions")


class RewardError(UsageError):
    """A reward function raised or returned something that is not one number per completion."""


def _one_line(text: object, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _import_file(spec: str, path: str) -> Any:
    """Imports ``path`` under a module name derived from it; its folder is on ``sys.path``
    only while it runs (so that it can import its neighbours)."""
    where = os.path.abspath(path)
    if not os.path.exists(where):
        raise UsageError(f"--reward {spec}: no such file {path}")
    if not os.path.isfile(where):
        raise UsageError(f"--reward {spec}: {path} is not a regular file")
    if not where.endswith(".py"):
        raise UsageError(f"--reward {spec}: {path} is not a .py file")
    stem = re.sub(r"\W", "_", os.path.basename(where)[:-3])
    name = f"_shardax_reward_{stem}_{hashlib.sha1(where.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    folder = os.path.dirname(where)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def load_reward(spec: str) -> Callable:
    """The reward function named by ``--reward SPEC``: ``file.py:function`` or
    ``package.module:function`` (the function may be a dotted attribute, ``module:Class.method``).

    This imports, and so runs, the user's module: that is what a reward function is for.

    Args:
      spec: ``path/to/file.py:function`` (a path: it ends in ``.py`` or holds a ``/``) or
        ``package.module:function``.

    Returns:
      The callable.

    Raises:
      UsageError: one line naming ``--reward SPEC``: no colon, a missing / not regular / not
        ``.py`` file, a module that cannot be imported (its exception's type and message),
        a missing or non-callable name.

    >>> load_reward("op")
    Traceback (most recent call last):
    shardax.errors.UsageError: --reward op: expected file.py:function or package.module:function
    >>> load_reward("operator:length_hint")([1, 2, 3])
    3
    """
    where, colon, attr = spec.rpartition(":")
    if not colon or not where or not attr:
        raise UsageError(f"--reward {spec}: expected file.py:function or "
                         "package.module:function")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    try:
        module = _import_file(spec, where) if is_file else importlib.import_module(where)
    except UsageError:
        raise
    except (Exception, SystemExit) as e:
        raise UsageError(f"--reward {spec}: cannot import {where}: "
                         f"{type(e).__name__}: {_one_line(e)}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--reward {spec}: {where} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--reward {spec}: {attr} is not callable (a {type(target).__name__})")
    return target


def _as_rewards(spec: str, out: Any, n: int) -> np.ndarray:
    """``out`` checked as ``n`` real numbers (``None`` -> NaN); one-line `RewardError` else."""
    if hasattr(out, "tolist") and not isinstance(out, str | bytes):
        out = out.tolist()  # numpy / JAX / torch arrays
    if not isinstance(out, Sequence) or isinstance(out, str | bytes):
        raise RewardError(f"--reward {spec}: returned {type(out).__name__} "
                          f"{_one_line(repr(out), 60)}, expected a list of {n} numbers "
                          "(one per completion)")
    if len(out) != n:
        raise RewardError(f"--reward {spec}: returned {len(out)} values for {n} completions")
    values = np.empty(n, np.float32)
    for i, v in enumerate(out):
        if v is None:
            values[i] = np.nan
        elif isinstance(v, numbers.Real) and not np.isinf(v):
            values[i] = v
        else:
            raise RewardError(f"--reward {spec}: value {_one_line(repr(v), 60)} at index {i} "
                              "is not a finite number or None")
    return values


class RewardSet:
    """Several reward functions, weighted and summed as TRL's ``GRPOTrainer`` does.

    Args:
      specs: ``--reward`` specs (see `load_reward`) or callables.
      weights: ``--reward-weights``, one per function; 1.0 each by default.

    Calling it with ``(prompts, completions, records)`` (``n`` of each: a prompt repeated once
    per completion of its group, and that prompt's record) returns ``(total, per_function)``:
    ``total[i] = nansum_f(weight_f * reward_f[i])`` as float32 ``[n]``, and each function's
    float32 ``[n]`` rewards (NaN where it returned ``None``) under its name.
    A completion that every function calls "not applicable" gets 0, as in TRL, with a warning.

    >>> RewardSet(["operator:length_hint"], weights=[1.0, 2.0])
    Traceback (most recent call last):
    shardax.errors.UsageError: --reward-weights 1.0 2.0: 2 weights for 1 --reward
    """

    def __init__(self, specs: Sequence[str | Callable], weights: Sequence[float] | None = None):
        self.specs = [s if isinstance(s, str) else getattr(s, "__name__", repr(s)) for s in specs]
        self.functions = [load_reward(s) if isinstance(s, str) else s for s in specs]
        if weights is None:
            weights = [1.0] * len(self.functions)
        if len(weights) != len(self.functions):
            raise UsageError(f"--reward-weights {' '.join(map(str, weights))}: {len(weights)} "
                             f"weights for {len(self.functions)} --reward")
        self.weights = np.asarray(weights, np.float32)
        names = [s.rpartition(":")[2].rpartition(".")[2] for s in self.specs]
        # Two functions of the same name (a.py:score, b.py:score) are told apart by their spec.
        self.names = [s if names.count(m) > 1 else m for s, m in zip(self.specs, names)]

    def __call__(self, prompts: Sequence, completions: Sequence,
                 records: Sequence[Mapping]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(completions)
        keys = [k for k in (records[0] if records else {}) if k not in _NOT_FIELDS]
        fields = {k: [r.get(k) for r in records] for k in keys}
        per_function = {}
        for spec, name, fn in zip(self.specs, self.names, self.functions):
            try:
                out = fn(prompts=list(prompts), completions=list(completions), **fields)
            except Exception as e:
                raise RewardError(f"--reward {spec}: raised {type(e).__name__}: "
                                  f"{_one_line(e)}") from None
            per_function[name] = _as_rewards(spec, out, n)
        table = np.stack(list(per_function.values()), axis=1).reshape(n, len(self.functions))
        if n and np.isnan(table).all(axis=1).any():
            i = int(np.isnan(table).all(axis=1).argmax())
            warnings.warn(f"every reward function returned None for completion {i}: its "
                          "reward is 0", stacklevel=2)
        total = np.nansum(table * self.weights[None, :], axis=1).astype(np.float32)
        return total, per_function


def reward_metrics(total: np.ndarray, per_function: Mapping[str, np.ndarray],
                   group_size: int) -> dict[str, float]:
    """The reward metrics under TRL's names: ``rewards/<name>/mean`` and ``/std`` (NaN-aware,
    over completions), ``reward`` (mean of the weighted total) and ``reward_std`` (the
    within-group standard deviation, ddof=1 as torch's, averaged over groups).

    >>> m = reward_metrics(np.array([1.0, 3.0, 2.0, 2.0]), {"f": np.array([1.0, np.nan, 2, 2])}, 2)
    >>> m["reward"], round(m["reward_std"], 4), m["rewards/f/mean"]
    (2.0, 0.7071, 1.6666666269302368)
    """
    total = np.asarray(total, np.float32)
    metrics = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-None column is NaN, as in TRL
        for name, values in per_function.items():
            values = np.asarray(values, np.float32)
            metrics[f"rewards/{name}/mean"] = float(np.nanmean(values))
            metrics[f"rewards/{name}/std"] = float(np.nanstd(values, ddof=1))
        metrics["reward"] = float(total.mean())
        metrics["reward_std"] = float(total.reshape(-1, group_size).std(axis=1, ddof=1).mean())
    return metrics
