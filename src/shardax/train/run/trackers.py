"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

A tracker has two methods: ``log(step, scalars)`` and ``close()``. ``shardax train --log-to
jsonl,tensorboard,wandb`` picks them; JSONL is always on and written by
`shardax.train.run.report.MetricsLog` (``--resume`` and the loss plot read it back), so
`make_trackers` builds only the others. TensorBoard event files are written by ``tensorboardX``
(no TensorFlow needed) into ``<run>/tensorboard``; W&B runs in offline mode unless
``WANDB_MODE`` says otherwise, into ``<run>/wandb`` (``wandb sync`` uploads it later). Both are
optional dependencies: a missing one is a ``MissingExtra`` error naming the extra to install.

>>> trackers = make_trackers("jsonl,tensorboard", Path("runs/a"), config={})  # doctest: +SKIP
>>> for t in trackers: t.log(10, {"loss": 2.3})                                   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from shardax.errors import MissingExtra

__all__ = ["Tracker", "TensorBoardTracker", "WandbTracker", "MissingExtra",
           "TRACKERS", "check_installed", "make_trackers", "parse_log_to"]

log = logging.getLogger("shardax.train")

TRACKERS = ("jsonl", "tensorboard", "wandb")




class Tracker(Protocol):
    """Receives the scalars of a logged step."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _numbers(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The finite-or-nan numeric entries (None, e.g. MFU on a CPU, is left out)."""
    return {k: float(v) for k, v in scalars.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def _require(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"--log-to {extra} needs the '{module}' package: "
                           f"pip install 'shardax[{extra}]'") from None


class TensorBoardTracker:
    """TensorBoard event files under ``logdir`` (``tensorboard --logdir <run>/tensorboard``)."""

    def __init__(self, logdir: Path, config: Mapping[str, Any] | None = None):
        tensorboardx = _require("tensorboardX", "tensorboard")
        self.writer = tensorboardx.SummaryWriter(logdir=str(logdir))
        if config:
            self.writer.add_text("config", f"```\n{json.dumps(dict(config), indent=2)}\n```")

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        for key, value in _numbers(scalars).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run under ``directory``; offline unless ``WANDB_MODE`` is set."""

    def __init__(self, directory: Path, config: Mapping[str, Any] | None = None,
                 name: str | None = None):
        wandb = _require("wandb", "wandb")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "shardax"), dir=str(directory),
            mode=os.environ.get("WANDB_MODE", "offline"), config=dict(config or {}), name=name,
            reinit="create_new", settings=wandb.Settings(console="off", silent=True))
        log.info("wandb run (%s) in %s", self.run.settings.mode, Path(self.run.dir).parent)

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        self.run.log({k: v for k, v in _numbers(scalars).items() if not math.isnan(v)},
                     step=step)

    def close(self) -> None:
        self.run.finish()


_EXTRAS = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # tracker -> module it needs


def check_installed(names: Sequence[str]) -> None:
    """Raises ``MissingExtra`` for the first tracker in ``names`` whose package is missing, so
    a run fails before it compiles or writes anything."""
    for name in names:
        if name in _EXTRAS:
            _require(_EXTRAS[name], name)


def parse_log_to(text: str | Sequence[str]) -> list[str]:
    """``'jsonl,tensorboard'`` -> the tracker names, JSONL always included; a ValueError names
    an unknown one.

    >>> parse_log_to('tensorboard')
    ['jsonl', 'tensorboard']
    """
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"--log-to: unknown tracker(s) {unknown}; choose from {list(TRACKERS)}")
    return ["jsonl", *dict.fromkeys(n for n in names if n != "jsonl")]


def make_trackers(names: str | Sequence[str], out: Path,
                  config: Mapping[str, Any] | None = None) -> list[Tracker]:
    """The trackers ``names`` asks for besides JSONL (which `report.MetricsLog` writes),
    writing into the run directory ``out``. Raises ``MissingExtra``."""
    trackers: list[Tracker] = []
    for name in parse_log_to(names):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(Path(out) / "tensorboard", config))
        elif name == "wandb":
            trackers.append(WandbTracker(Path(out), config, name=Path(out).name))
        log.info("metrics: %s", name)
    return trackers
