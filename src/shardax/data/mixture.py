"""Weighted data mixtures: which source each row of a global batch comes from, as f(seed, step).

A `Mixture` of ``K`` sources with weights interleaves them deterministically, as Grain's
``MapDataset.mix`` does: the weights become integer proportions ``p`` (summing to ``R``) and
the number of rows source ``i`` has given among the first ``n`` rows of the mixed stream is a
closed form, O(K) for any ``n``: source 0 takes ``ceil(n * p0 / R)`` of them and the remaining
sources share the rest the same way, recursively. So every prefix of the stream gives each
source its weight's share of rows to within fewer than ``K`` rows (measured: under 1.2 rows for
``K`` up to 5), row ``g`` of the stream is computed without walking the stream, and a source's
*position* (its row index in its own order, which its reader maps to a window by the seed) is
how many rows it gave before. Global batch ``t`` of size ``B``
is stream rows ``[t * B, (t + 1) * B)``, permuted within the batch by ``(seed, t)`` so that no
row slot is tied to a source; each process takes its slice, so the global batch is the same on
any number of processes.

**Changing weights on resume.** A mixture is a list of *segments*: a segment starts at a
stream row with each source's count so far and has its own proportions. `Mixture.reweighted`
starts a new segment at a step: rows before it are unchanged, and every source continues at its
own position (no row of a source repeated or skipped) with shares moving to the new weights.

**What the trainer saves.** ``mixture.state()`` (JSON: the seed and the segments) goes into the
checkpoint next to the data state (the step). On resume, ``Mixture.from_state(saved)`` gives
exactly the saved schedule; with different ``--data`` weights, ``.reweighted(new, step, B)``
continues it (unchanged weights give back the same schedule). ``counts(step, B)`` is the rows
each source gave before ``step`` (times ``seq_len``: the tokens for ``data/tokens/<source>``).

Example:

>>> mix = Mixture([0.7, 0.3], seed=0)
>>> sources, positions = mix.rows(step=0, batch_size=10)
>>> sorted(zip(sources.tolist(), positions.tolist()))[:3], int((sources == 0).sum())
([(0, 0), (0, 1), (0, 2)], 7)
>>> mix.counts(step=100, batch_size=10).tolist()
[700, 300]
>>> later = Mixture.from_state(mix.state()).reweighted([0.5, 0.5], step=100, batch_size=10)
>>> later.counts(step=200, batch_size=10).tolist()
[1200, 800]
>>> parse_weighted("web/:0.7,code.jsonl:0.2,math/:0.1")
[('web/', 0.7), ('code.jsonl', 0.2), ('math/', 0.1)]
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardax.errors import UsageError

__all__ = ["Mixture", "parse_weighted", "weighted_entries"]

# Weights become integer proportions summing to about this; shares are exact to 1e-6.
_SCALE = 1 << 20
# ``n * R`` must fit in int64 for the closed form.
_MAX_ROWS = (1 << 62) // (_SCALE * 2)
_NUMBERISH = re.compile(r"[-+0-9.eE]*")


def _check_weights(weights: Sequence[float]) -> list[float]:
    """The weights as floats; a one-line `UsageError` naming the first bad one."""
    out = []
    for i, w in enumerate(weights):
        try:
            value = float(w)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"mixture weight {i} is {w!r}: every weight must be a positive "
                             f"finite number")
        out.append(value)
    if not out:
        raise UsageError("a mixture needs at least one weight")
    return out


def _proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """Normalised weights as positive integers summing to about ``_SCALE``."""
    total = sum(weights)
    return tuple(max(1, round(w / total * _SCALE)) for w in weights)


def _counts(n: np.ndarray, proportions: tuple[int, ...]) -> np.ndarray:
    """``[K, len(n)]``: rows each source gave among the first ``n`` rows of the stream."""
    out = np.empty((len(proportions), len(n)), np.int64)
    remaining, rest = sum(proportions), n.astype(np.int64)
    for i, p in enumerate(proportions):
        # Source i takes ceil(rest * p / remaining) of the rows the later sources left.
        after = rest * (remaining - p) // remaining
        out[i] = rest - after
        remaining, rest = remaining - p, after
    return out


class Mixture:
    """The schedule of a weighted mixture: global batch ``step`` as (source, position) per row.

    Args:
        weights: one positive weight per source; normalised (``[7, 3]`` = ``[0.7, 0.3]``).
        seed: permutes the rows within each batch (``shuffle=True``).
        shuffle: ``False`` keeps the stream's own order within a batch.

    Example::

        mix = Mixture([0.7, 0.2, 0.1], seed=0)
        src, pos = mix.rows(step, batch_size=32, process_index=p, process_count=P)
        # row r of this process reads row pos[r] of source src[r] (in that source's own order)
    """

    def __init__(self, weights: Sequence[float], seed: int = 0, shuffle: bool = True):
        weights = _check_weights(weights)
        if seed < 0:
            raise UsageError(f"seed must be >= 0, got {seed}")
        self.seed, self.shuffle = int(seed), shuffle
        # (first stream row, each source's count before it, proportions), by first row.
        self._segments: list[tuple[int, np.ndarray, tuple[int, ...]]] = [
            (0, np.zeros(len(weights), np.int64), _proportions(weights))
        ]

    @property
    def num_sources(self) -> int:
        """How many sources the mixture draws from."""
        return len(self._segments[0][2])

    @property
    def weights(self) -> np.ndarray:
        """The weights in force at the end of the schedule, normalised to sum to 1."""
        p = np.asarray(self._segments[-1][2], np.float64)
        return p / p.sum()

    @classmethod
    def resumed(
        cls,
        counts_so_far: Sequence[int],
        weights: Sequence[float],
        step: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> Mixture:
        """A mixture that starts at ``step`` with each source at ``counts_so_far``.

        Rows from ``step`` on continue every source where it stopped, with ``weights``; steps
        before ``step`` are not part of it (`reweighted` keeps them).

        Example::

            mix = Mixture.resumed([700, 300], [0.5, 0.5], step=100, batch_size=10)
        """
        mix = cls(weights, seed=seed, shuffle=shuffle)
        counts = np.asarray(counts_so_far, np.int64)
        if counts.shape != (mix.num_sources,) or (counts < 0).any():
            raise UsageError(f"counts_so_far must be {mix.num_sources} counts >= 0, got "
                             f"{list(counts_so_far)}")
        mix._segments = [(_start_row(step, batch_size), counts, mix._segments[0][2])]
        return mix

    def reweighted(self, weights: Sequence[float], step: int, batch_size: int) -> Mixture:
        """This schedule up to ``step``, then ``weights``, each source continuing where it was.

        Weights equal to the current ones (after normalisation) give the same schedule back.

        Example::

            mix = Mixture.from_state(saved).reweighted([0.5, 0.3, 0.2], step, batch_size)
        """
        weights = _check_weights(weights)
        if len(weights) != self.num_sources:
            raise UsageError(f"the mixture has {self.num_sources} sources, the new weights "
                             f"{len(weights)}")
        proportions, start = _proportions(weights), _start_row(step, batch_size)
        out = Mixture.__new__(Mixture)
        out.seed, out.shuffle = self.seed, self.shuffle
        if proportions == self._segments[-1][2]:
            out._segments = list(self._segments)
            return out
        base = self._counts_at(start)
        out._segments = [*(s for s in self._segments if s[0] < start), (start, base, proportions)]
        return out

    def _segment(self, row: int) -> tuple[int, np.ndarray, tuple[int, ...]]:
        for segment in reversed(self._segments):
            if segment[0] <= row:
                return segment
        raise UsageError(f"stream row {row} is before this mixture starts (row "
                         f"{self._segments[0][0]}); it was resumed after it")

    def _counts_at(self, row: int) -> np.ndarray:
        """``[K]``: rows each source gave before stream row ``row``."""
        start, base, proportions = self._segment(row)
        return base + _counts(np.array([row - start]), proportions)[:, 0]

    def _stream(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, position) of consecutive stream rows ``rows``, in stream order."""
        sources = np.empty(len(rows), np.int64)
        positions = np.empty(len(rows), np.int64)
        for start, base, proportions in self._segments:
            mask = rows >= start
            if not mask.any():
                continue
            k = rows[mask] - start
            before, after = _counts(k, proportions), _counts(k + 1, proportions)
            src = np.argmax(after - before, axis=0)
            sources[mask] = src
            positions[mask] = base[src] + before[src, np.arange(len(k))]
        if len(rows) and rows[0] < self._segments[0][0]:
            self._segment(int(rows[0]))  # raises
        return sources, positions

    def rows(
        self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of global batch ``step``: ``(source_ids, positions)``, int64.

        The global batch is a pure function of ``(seed, step)`` (and the segments); process
        ``p`` of ``P`` gets rows ``[p * B // P, (p + 1) * B // P)`` of it.
        """
        if process_count < 1 or not 0 <= process_index < process_count:
            raise UsageError(f"process_index {process_index} is not in [0, {process_count})")
        if batch_size % process_count:
            raise UsageError(f"batch_size {batch_size} is not divisible by the "
                             f"{process_count} processes")
        first = _start_row(step + 1, batch_size) - batch_size
        sources, positions = self._stream(np.arange(first, first + batch_size, dtype=np.int64))
        if self.shuffle:
            order = np.random.default_rng([self.seed, step]).permutation(batch_size)
            sources, positions = sources[order], positions[order]
        local = batch_size // process_count
        part = slice(process_index * local, (process_index + 1) * local)
        return sources[part], positions[part]

    def counts(self, step: int, batch_size: int) -> np.ndarray:
        """``[K]`` int64: rows each source gave in the global batches before ``step``."""
        return self._counts_at(_start_row(step, batch_size))

    def state(self) -> dict[str, Any]:
        """JSON-serialisable schedule to save with the checkpoint (see the module docstring)."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "segments": [{"start_row": start, "counts": base.tolist(),
                          "proportions": list(proportions)}
                         for start, base, proportions in self._segments],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Mixture:
        """The schedule `state` saved: the same rows at every step.

        Example::

            mix = Mixture.from_state(json.loads(saved))
        """
        segments = state["segments"]
        mix = cls(segments[-1]["proportions"], seed=state["seed"], shuffle=state["shuffle"])
        mix._segments = [(int(s["start_row"]), np.asarray(s["counts"], np.int64),
                          tuple(int(p) for p in s["proportions"])) for s in segments]
        return mix


def _start_row(step: int, batch_size: int) -> int:
    if step < 0 or batch_size < 1:
        raise UsageError(f"step must be >= 0 and batch_size >= 1, got {step} and {batch_size}")
    if step * batch_size > _MAX_ROWS:
        raise UsageError(f"step {step} of batch {batch_size} is past the {_MAX_ROWS} rows a "
                         f"mixture schedule indexes")
    return step * batch_size


def parse_weighted(data: str | Sequence[str]) -> list[tuple[str, float]]:
    """``--data`` entries with optional weights: ``"PATH:WEIGHT,PATH:WEIGHT"`` -> pairs.

    A trailing ``:NUMBER`` is the weight; with no weights at all, every entry weighs 1.0.
    Entries may be given as one comma-separated string or several (one per ``--data``
    value). Weights are returned as given (`Mixture` normalises them).

    Raises:
        UsageError: (a ValueError) one line naming the entry, for a weight that is not a
        positive number, an empty entry, or weights on some entries but not others.

    Example:

    >>> parse_weighted(["a.txt", "b/"])
    [('a.txt', 1.0), ('b/', 1.0)]
    >>> parse_weighted("web/:0")
    Traceback (most recent call last):
    shardax.errors.UsageError: --data entry 'web/:0': the weight must be a positive number
    """
    items = [data] if isinstance(data, str) else list(data)
    entries = [e.strip() for item in items for e in item.split(",")]
    out: list[tuple[str, float | None]] = []
    for entry in entries:
        path, colon, tail = entry.rpartition(":")
        if not entry or (colon and not path):
            raise UsageError(f"--data entry {entry!r}: expected PATH or PATH:WEIGHT")
        try:
            weight = float(tail) if colon else None
        except ValueError:
            weight = math.nan if _NUMBERISH.fullmatch(tail) else None
        if weight is None:
            out.append((entry, None))  # no weight; a colon in a path (hf:DIR) stays
            continue
        if not (math.isfinite(weight) and weight > 0):
            raise UsageError(f"--data entry {entry!r}: the weight must be a positive number")
        out.append((path, weight))
    weighted = [e for e, w in out if w is not None]
    if weighted and len(weighted) != len(out):
        bare = next(e for e, w in out if w is None)
        raise UsageError(f"--data entry {bare!r} has no weight while others have one; give "
                         f"every entry a weight (PATH:WEIGHT) or none")
    return [(path, 1.0 if w is None else w) for path, w in out]


def weighted_entries(data: str | Sequence[str]) -> list[tuple[str, float]] | None:
    """The ``(path, weight)`` entries of ``--data`` when it gives weights (`parse_weighted`);
    None when no entry has one: the paths are then read as they are, one after the other.

    Raises:
        UsageError: one line naming the entry, as `parse_weighted`, and for ``PATH:TEXT``
        where ``PATH`` exists and ``PATH:TEXT`` does not (a weight that is not a number).

    Example:

    >>> weighted_entries(["a.txt", "b/"]) is None
    True
    >>> weighted_entries(["web/:0.7", "code.jsonl:0.3"])
    [('web/', 0.7), ('code.jsonl', 0.3)]
    """
    items = [data] if isinstance(data, str) else list(data)
    weighted = False
    for entry in (e.strip() for item in items for e in item.split(",")):
        path, colon, tail = entry.rpartition(":")
        if not (colon and path):
            continue
        if _NUMBERISH.fullmatch(tail):
            weighted = True
        elif os.path.exists(path) and not os.path.exists(entry):
            raise UsageError(f"--data entry {entry!r}: the weight {tail!r} is not a number "
                             f"(and there is no file {entry!r})")
    return parse_weighted(items) if weighted else None
