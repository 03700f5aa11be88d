"""What ``shardax train`` does when a step's loss or gradient norm is not finite (``--on-nan``).

The train step returns ``metrics["finite"]``; `NonFiniteWatch` reads it one step late (so the
device keeps one step in flight) and always before a checkpoint is saved, and applies the
policy:

- ``stop`` (the default): raise `NonFinite` naming the step; the step is never saved, so every
  checkpoint in the run directory has finite weights (the CLI exits with status 3);
- ``skip``: the step itself kept the parameters and optimizer state (``train_step(...,
  skip_nonfinite=True)``); the skipped steps are counted (``skipped_steps`` in the metrics);
- ``continue``: train on; the newest checkpoint saved before the first non-finite step is
  pinned, so that rotating old checkpoints out never deletes the last good state.

>>> watch = NonFiniteWatch("skip", start=0)
>>> watch.add(1, {"finite": False, "loss": float("nan")}); watch.settle(); watch.skipped
1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_NONFINITE", "NonFinite", "NonFiniteWatch", "POLICIES"]

POLICIES = ("stop", "skip", "continue")
#: The exit status of ``shardax train`` stopped by a non-finite loss (``--on-nan stop``).
EXIT_NONFINITE = 3


class NonFinite(Exception):
    """Training stopped at a step whose loss or gradient norm is not finite (not saved)."""

    exit_code = EXIT_NONFINITE

    def __init__(self, step: int, loss: float, last_good: int | None):
        self.step, self.loss, self.last_good = step, loss, last_good
        where = (f"the newest checkpoint, step {last_good}, has finite weights: continue from "
                 "it with --resume (e.g. with a lower --lr)" if last_good is not None else
                 "no checkpoint was saved before it: start again (e.g. with a lower --lr)")
        super().__init__(f"the loss is not finite at step {step} (loss {loss}; --on-nan stop): "
                         f"stopped without saving it; {where}, or pass --on-nan skip")


class NonFiniteWatch:
    """Applies ``--on-nan`` to the steps it is given (`add`) once their flags are read
    (`settle`). ``start``: the step the run starts from (a resumed run's checkpoint counts as
    saved); ``note`` prints a line; ``pin`` keeps a checkpoint step from being rotated out;
    ``skipped``: the updates skipped before ``start`` (a resumed run counts on)."""

    def __init__(self, policy: str, start: int, note: Callable[[str], None] | None = None,
                 pin: Callable[[int], None] | None = None, skipped: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"--on-nan {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy, self.skipped, self.first_bad = policy, skipped, None
        self.note = note or (lambda _message: None)
        self.pin = pin or (lambda _step: None)
        self.saved: list[int] = [start] if start else []
        self._pending: list[tuple[int, dict]] = []

    def add(self, done: int, metrics: dict) -> None:
        """Step ``done`` (1-based) ran with ``metrics``; its flag is read later."""
        self._pending.append((done, metrics))

    def saved_step(self, done: int) -> None:
        """A checkpoint of step ``done`` is being saved (its steps are settled)."""
        self.saved.append(done)

    def last_good(self) -> int | None:
        """The newest saved step before the first non-finite one."""
        good = [s for s in self.saved if self.first_bad is None or s < self.first_bad]
        return max(good, default=None)

    def settle(self, upto: int | None = None) -> None:
        """Reads the flags of the pending steps up to ``upto`` (all by default) and applies
        the policy to the non-finite ones (raises `NonFinite` under ``stop``)."""
        later = [(d, m) for d, m in self._pending if upto is not None and d > upto]
        ready = [(d, m) for d, m in self._pending if upto is None or d <= upto]
        self._pending = later
        for done, metrics in ready:
            if not bool(metrics["finite"]):
                self._non_finite(done, float(metrics["loss"]))

    def _non_finite(self, done: int, loss: float) -> None:
        if self.policy == "stop":
            self.first_bad = done
            raise NonFinite(done, loss, self.last_good())
        if self.policy == "skip":
            self.skipped += 1
            n = self.skipped
            if n <= 3 or n & (n - 1) == 0:  # the first few, then at powers of two
                self.note(f"the loss is not finite at step {done} (loss {loss}); its update was "
                          f"skipped (--on-nan skip; {n} skipped so far)")
            return
        if self.first_bad is None:
            self.first_bad = done
            good = self.last_good()
            if good is not None:
                self.pin(good)
            kept = (f"checkpoint step {good}, the last with finite weights, is kept" if good
                    is not None else "no checkpoint with finite weights was saved")
            self.note(f"the loss is not finite at step {done} (loss {loss}); training on "
                      f"(--on-nan continue); {kept}")

    def record(self) -> dict[str, Any]:
        """What a metrics record adds: ``skipped_steps`` once a step was skipped."""
        return {"skipped_steps": self.skipped} if self.skipped else {}
