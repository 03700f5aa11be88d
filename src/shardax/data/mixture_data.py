"""Batches of a weighted data mixture: rows chosen by a `Mixture`, each source read in its own
seeded order.

Each source is a `TokenStream` cut into windows as `TokenBatches` cuts one (its own grain
shuffle per epoch, from a seed derived from ``(seed, source index)``); the `Mixture` says which
source and which of that source's samples each row of global batch ``step`` is. So the batch is
a pure function of ``(seed, step, weights)``, the same on any number of processes (each reads
only its rows), and a source's *position* is the number of its samples taken so far.

The data state saved with a checkpoint holds the mixture's schedule (its segments of weights),
the sources and each source's position; `MixtureBatches.restore` continues it bit for bit, or,
with new weights, from every source's position (`Mixture.reweighted`).

Example::

    data = MixtureBatches([("web", web), ("code", code)], [0.7, 0.3], seq_len=128,
                          batch_size=16, seed=0)
    inputs, targets = data.batch(0)          # int32 [16, 128]
    data.tokens_taken(10)                    # {"data/tokens/web": ..., "data/tokens/code": ...}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardax.data.lm_data import TokenBatches, TokenStream
from shardax.data.mixture import Mixture
from shardax.errors import DataError

__all__ = ["MixtureBatches", "source_names"]


def source_names(paths: Sequence[str]) -> list[str]:
    """The names of ``--data`` entries in metrics (``data/tokens/<name>``): each file or folder
    name, or the entry as given where two names would be the same.

    >>> source_names(["data/web/", "code.jsonl"])
    ['web', 'code.jsonl']
    >>> source_names(["a/x.txt", "b/x.txt"])
    ['a/x.txt', 'b/x.txt']
    """
    names = [Path(p).name or p for p in paths]
    return [n if names.count(n) == 1 else p.rstrip("/") or p for n, p in zip(names, paths)]


def _source_seed(seed: int, index: int) -> int:
    """Source ``index``'s own order seed: sources of equal size do not share an order."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class MixtureBatches:
    """Deterministic, resumable batches of several token streams mixed by weight.

    Args:
        sources: ``(path, tokens)`` per ``--data`` entry.
        weights: one positive weight per source (normalised).
        seq_len, batch_size, seed, process_index, process_count, vocab_size: as `TokenBatches`.
        log: where the new shares are said when a resume changes the weights (None: nowhere).

    Example::

        data = MixtureBatches([("a.txt", a), ("b/", b)], [1, 3], 64, 8, seed=0,
                              process_index=p, process_count=P)
        x, y = data.batch(step)                  # this process's rows of global batch step
    """

    def __init__(
        self,
        sources: Sequence[tuple[str, TokenStream]],
        weights: Sequence[float],
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        vocab_size: int | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        self.paths = [p for p, _ in sources]
        self.names = source_names(self.paths)
        self.readers = [TokenBatches(tokens, seq_len, 1, seed=_source_seed(seed, i))
                        for i, (_, tokens) in enumerate(sources)]
        self.given = list(weights)
        self.mixture = Mixture(weights, seed=seed)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.vocab_size, self.log = vocab_size, log
        self.step = 0
        self.mixture.rows(0, batch_size, process_index, process_count)  # checks the split

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's ``(inputs, targets)`` of global batch ``step``."""
        sources, positions = self.mixture.rows(step, self.batch_size, self.process_index,
                                               self.process_count)
        rows = np.empty((len(sources), self.seq_len + 1), np.int32)
        for i, reader in enumerate(self.readers):
            mine = sources == i
            if mine.any():
                rows[mine] = reader.windows_at(positions[mine])
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise DataError(f"--data: token id {rows.max()} at step {step} is outside the "
                            f"vocabulary of {self.vocab_size}; give the matching --tokenizer")
        return rows[:, :-1], rows[:, 1:]

    def positions(self, step: int) -> dict[str, int]:
        """Each source's samples taken in the global batches before ``step``."""
        counts = self.mixture.counts(step, self.batch_size)
        return {name: int(c) for name, c in zip(self.names, counts)}

    def tokens_taken(self, step: int) -> dict[str, int]:
        """``data/tokens/<source>``: the input tokens each source gave before ``step``."""
        return {f"data/tokens/{name}": n * self.seq_len
                for name, n in self.positions(step).items()}

    def state(self, step: int | None = None) -> dict[str, Any]:
        """JSON-serialisable position at ``step`` (default: the iterator's): the step, the
        settings it depends on, the mixture's schedule and each source's position."""
        step = self.step if step is None else step
        return {
            "step": step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "sources": self.paths,
            "num_tokens": [len(r.tokens) for r in self.readers],
            "weights": dict(zip(self.names, self.mixture.weights.round(6).tolist())),
            "positions": self.positions(step),
            "mixture": self.mixture.state(),
        }

    def restore(self, state: dict[str, Any]) -> MixtureBatches:
        """Continues from `state`: the same batches, or, with other weights than the saved
        run's, every source from its position (the new shares are said once through ``log``).
        Another set of sources is a ValueError naming ``--data``."""
        if "mixture" not in state:
            raise ValueError("--data: the run being resumed reads its --data entries one "
                             "after the other (no weights); resume it without weights")
        if state.get("sources") != self.paths:
            raise ValueError(f"--data: the mixture's sources {self.paths} differ from the "
                             f"run's {state.get('sources')}; a resumed run may change the "
                             "weights, not the sources")
        for key in ("seed", "seq_len", "batch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"data state mismatch for {key!r}: saved {state.get(key)}, "
                                 f"this run has {getattr(self, key)}")
        sizes = [len(r.tokens) for r in self.readers]
        for path, saved, now in zip(self.paths, state["num_tokens"], sizes):
            if saved != now:
                raise ValueError(f"--data {path}: it holds {now:,} tokens, the run being "
                                 f"resumed read {saved:,}; the resumed run would read other "
                                 "batches")
        step = int(state["step"])
        saved = Mixture.from_state(state["mixture"])
        self.mixture = saved.reweighted(self.given, step, self.batch_size)
        if self.log is not None and not np.array_equal(self.mixture.weights, saved.weights):
            shares = ", ".join(f"{n} {w:.3g} (was {o:.3g})" for n, w, o in
                               zip(self.names, self.mixture.weights, saved.weights))
            self.log(f"data: mixture weights from step {step}: {shares}; every source "
                     "continues where it stopped")
        self.step = step
        return self
