"""Plan a deep model whose layers cannot be stacked from two shallow copies of it.

A model whose layers differ (DeepSeek-V3's dense first layers before the experts, Gemma's
sliding and global layers) runs them as a list, so its compiled program grows with its depth:
DeepSeek-V3's 61 layers took over 400 s to plan. Its layers still repeat: ``first_k_dense``
layers, then a unit of ``global_every`` layers (1 without a sliding/global pattern) repeated,
then a partial unit. Every count `compile_config` reads (arguments, outputs, temporaries,
collective counts and bytes) is a sum over the layers, the same for every repeat of the unit,
plus a fixed part (embeddings, head, optimizer of those): so the model cut to one and to two
repeats of the unit, compiled, gives the per-unit difference, and the full depth is the first
plus that difference once per further repeat.

Example::

    cut = repeats(model_config)        # None: compile the whole model
    if cut is not None:
        one, two = (compile_at(shallow(model_config, cut, k)) for k in (1, 2))
        compiled = extend(one, two, cut)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Repeats", "extend", "repeats", "shallow"]

T = TypeVar("T")


@dataclass(frozen=True)
class Repeats:
    """A listed model's depth as ``first + units * unit + tail`` layers."""

    first: int  # layers before the repeats (DeepSeek-V3's dense ones)
    unit: int  # layers per repeat (Gemma's sliding/global period; else 1)
    units: int  # whole repeats in the full model
    tail: int  # the layers of a partial last repeat

    def depth(self, units: int) -> int:
        """The layers of the model cut to ``units`` repeats."""
        return self.first + units * self.unit + self.tail


def repeats(c: Any) -> Repeats | None:
    """How ``c``'s listed layers repeat, when cutting it to 1 and 2 repeats saves compiling
    (more than 2 repeats); None for a model whose layers are identical (it stacks them with
    ``--scan-layers``), not a `LlamaConfig`, or shallow.

    >>> from shardax import models
    >>> repeats(models.get_config("deepseek-v3"))
    Repeats(first=3, unit=1, units=58, tail=0)
    """
    if not getattr(c, "mixed_layers", False):
        return None
    first = c.first_k_dense
    windows = c.global_every > 0 and (c.sliding_window is not None
                                      or c.rope_local_theta is not None)
    unit = c.global_every if windows else 1
    units, tail = divmod(c.n_layers - first, unit)
    return Repeats(first, unit, units, tail) if units > 2 else None


def shallow(c: T, cut: Repeats, units: int) -> T:
    """``c`` cut to ``units`` repeats (the first layers and the tail kept)."""
    return dataclasses.replace(c, n_layers=cut.depth(units))


def _line(one: int, two: int, units: int) -> int:
    return one + (units - 1) * (two - one)


def _dicts(one: dict, two: dict, units: int) -> dict:
    """Every number of two nested dicts extended to ``units`` repeats (a key missing from one:
    0 there)."""
    out = {}
    for key in {**one, **two}:
        a, b = one.get(key, 0), two.get(key, 0)
        if isinstance(a, dict) or isinstance(b, dict):
            out[key] = _dicts(a or {}, b or {}, units)
        else:
            out[key] = _line(a, b, units)
    return out


def extend(one: Any, two: Any, cut: Repeats) -> Any:
    """The `Compiled` of the full model from those of the model cut to 1 and 2 repeats:
    memory and collectives extended linearly to ``cut.units`` repeats, compile time the sum,
    ``depths`` the two depths compiled."""
    return dataclasses.replace(
        one, memory=_dicts(one.memory, two.memory, cut.units),
        collectives=_dicts(one.collectives, two.collectives, cut.units),
        across=_dicts(one.across, two.across, cut.units),
        compile_s=one.compile_s + two.compile_s, depths=[cut.depth(1), cut.depth(2)])
