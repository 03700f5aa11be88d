"""Byte-level language-model data: a built-in corpus, file loading, deterministic batches.

Tokens are raw bytes (vocabulary 256). A batch is a pure function of ``(seed, step)``, so
resuming needs only the step, and any number of processes can each build just their own rows
of the same global batch. Pure numpy: indexing a shuffled window order is a few lines, has no
hidden iterator state, and keeps this module free of a grain dependency.

Example::

    files = default_corpus("train")
    data = TokenBatches(load_bytes(files), seq_len=128, batch_size=16, seed=0)
    inputs, targets = next(data)            # int32 [16, 128]; targets = inputs shifted by one
    saved = data.state()                    # {"step": 1, ...}: store it with the checkpoint
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SEPARATOR",
    "TokenBatches",
    "default_corpus",
    "list_text_files",
    "load_bytes",
    "split_tokens",
    "val_batches",
]

#: Byte written between files by `load_bytes`: NUL never occurs in text, so it marks
#: the end of a document.
SEPARATOR = b"\x00"

# The default corpus: public top-level stdlib modules plus these packages.
_CORPUS_PACKAGES = (
    "collections",
    "concurrent",
    "email",
    "http",
    "importlib",
    "json",
    "logging",
    "urllib",
)
_CORPUS_MAX_FILE_BYTES = 256 * 1024
_CORPUS_MAX_BYTES = 6 * 1024 * 1024
_VAL_EVERY = 10
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def _corpus_files(root: Path) -> list[Path]:
    candidates = [p for p in root.glob("*.py") if not p.name.startswith("_")]
    for package in _CORPUS_PACKAGES:
        candidates += (root / package).rglob("*.py") if (root / package).is_dir() else []
    rel = sorted(
        p.relative_to(root).as_posix()
        for p in candidates
        # Symlinks and private modules (e.g. _sysconfigdata_*) differ between machines.
        if p.is_file() and not p.is_symlink()
        and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    chosen, total = [], 0
    for name in rel:
        size = (root / name).stat().st_size
        if size > _CORPUS_MAX_FILE_BYTES or total + size > _CORPUS_MAX_BYTES:
            continue
        chosen.append(root / name)
        total += size
    return chosen


def default_corpus(split: str = "train") -> list[Path]:
    """Python-stdlib source files used as a built-in text corpus (no download needed).

    The selection is fixed: public top-level modules of ``sysconfig.get_paths()['stdlib']``
    plus a few packages (json, email, http, ...), sorted by relative path, test folders and
    files over 256 KiB skipped, capped at 6 MiB. Every 10th file (index 9, 19, ...) is the
    held-out ``"val"`` split; ``"train"`` is the rest, ``"all"`` both. The same Python version
    gives the same files on every machine; another Python version gives another (still fixed)
    corpus.

    Example::

        train, val = default_corpus("train"), default_corpus("val")
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    files = _corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    if not files:
        raise FileNotFoundError(
            f"no stdlib sources found under {sysconfig.get_paths()['stdlib']!r}"
        )
    if split == "all":
        return files
    is_val = split == "val"
    return [f for i, f in enumerate(files) if (i % _VAL_EVERY == _VAL_EVERY - 1) == is_val]


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # A multi-byte character cut by the end of the sample is still text.
        return len(head) == 8192 and e.start >= len(head) - 3
    return True


def list_text_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Expands files and directories into a list of text files (the ``--data PATH...`` rule).

    A file is taken as given; a directory contributes its text files (UTF-8, no NUL bytes),
    recursively, sorted by relative path, skipping hidden entries. Order follows ``paths``.

    Example::

        files = list_text_files(["notes.txt", "corpus/"])
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"data path does not exist: {str(path)!r}")
        if path.is_file():
            out.append(path)
            continue
        found = sorted(
            (p for p in path.rglob("*")
             if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        out += [p for p in found if _is_text(p)]
    return out


def load_bytes(paths: Sequence[str | os.PathLike], separator: bytes = SEPARATOR) -> np.ndarray:
    """Reads files (or directories, see `list_text_files`) into one uint8 array.

    Files are joined with ``separator`` (default NUL, one byte), which also ends the last file.

    Example::

        tokens = load_bytes(["a.txt", "b.txt"])    # b"<a>\\0<b>\\0" as uint8
    """
    files = list_text_files(paths)
    if not files:
        raise ValueError(f"no text files found in {[str(p) for p in paths]}")
    data = b"".join(Path(f).read_bytes() + separator for f in files)
    if len(data) == len(files) * len(separator):
        raise ValueError(f"all data files are empty: {[str(f) for f in files]}")
    return np.frombuffer(data, dtype=np.uint8).copy()


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Splits one token array into (train, val): the last ``val_fraction`` is held out.

    For user data given as a single file; `default_corpus` splits by file instead.

    Example::

        train, val = split_tokens(load_bytes(["book.txt"]), 0.05)
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = len(tokens) - int(round(len(tokens) * val_fraction))
    return tokens[:cut], tokens[cut:]


def _check_sizes(
    n_tokens: int, seq_len: int, batch_size: int, process_index: int, process_count: int
) -> int:
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index must be in [0, process_count), got {process_index}, {process_count}"
        )
    if batch_size % process_count:
        raise ValueError(
            f"global batch_size {batch_size} is not divisible by process_count {process_count}"
        )
    windows = (n_tokens - 1) // seq_len
    if windows < 1:
        raise ValueError(
            f"need at least seq_len + 1 = {seq_len + 1} tokens for one window, got {n_tokens}"
        )
    return windows


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


class TokenBatches:
    """Deterministic, resumable language-model batches over a token array.

    The token stream is cut into ``W = (len(tokens) - 1) // seq_len`` windows of
    ``seq_len + 1`` tokens (inputs and the next-token targets). Each epoch visits every window
    once, in an order shuffled from ``(seed, epoch)``, with window boundaries shifted by a
    random offset per epoch. Global sample ``g = step * batch_size + row`` is window
    ``perm[epoch][g % W]`` of epoch ``g // W``, so the batch for ``step`` is a pure function of
    ``(seed, step)``.

    Multi-process: process ``p`` of ``P`` gets the contiguous rows
    ``[p * batch_size // P, (p + 1) * batch_size // P)`` of each global batch and reads only
    those windows. Concatenating the processes' batches in process order gives the
    single-process batch exactly, which is the layout `jax.make_array_from_process_local_data`
    expects for a batch sharded over all devices.

    Example::

        data = TokenBatches(tokens, seq_len=64, batch_size=8, seed=0,
                            process_index=jax.process_index(), process_count=jax.process_count())
        x, y = next(data)               # int32 [8 // process_count, 64]
        data.restore(saved_state)       # continue exactly where a checkpointed run stopped
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.tokens = np.asarray(tokens)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        self.windows = _check_sizes(
            len(self.tokens), seq_len, batch_size, process_index, process_count
        )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = batch_size // process_count
        self.step = 0
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        """(shift, window permutation) of ``epoch``; the last two are cached."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            slack = len(self.tokens) - 1 - self.windows * self.seq_len
            shift = int(rng.integers(0, slack + 1))
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = (shift, rng.permutation(self.windows))
        return self._epochs[epoch]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's ``(inputs, targets)`` for ``step``; does not move the iterator."""
        first = step * self.batch_size + self.process_index * self.local_batch_size
        samples = np.arange(first, first + self.local_batch_size, dtype=np.int64)
        starts = np.empty_like(samples)
        epochs = samples // self.windows
        for epoch in np.unique(epochs):
            shift, perm = self._epoch(int(epoch))
            mask = epochs == epoch
            starts[mask] = shift + perm[samples[mask] % self.windows] * self.seq_len
        return _gather(self.tokens, starts, self.seq_len)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: the next step to read, plus the settings it depends on."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_tokens": len(self.tokens),
        }

    def restore(self, state: dict[str, Any]) -> TokenBatches:
        """Continues from ``state()``; the process count may differ from the saving run."""
        mine = self.state()
        for key in ("seed", "seq_len", "batch_size", "num_tokens"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"data state mismatch for {key!r}: saved {state[key]}, this dataset has "
                    f"{mine[key]}; the resumed run would read different batches"
                )
        self.step = int(state["step"])
        return self


def val_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    num_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed evaluation batches: consecutive windows from the start of ``tokens``, in order.

    ``num_batches=None`` takes every full batch. Rows are split over processes as in
    `TokenBatches`.

    Example::

        for x, y in val_batches(load_bytes(default_corpus("val")), 128, 16, num_batches=4):
            ...
    """
    tokens = np.asarray(tokens)
    windows = _check_sizes(len(tokens), seq_len, batch_size, process_index, process_count)
    available = windows // batch_size
    if available < 1:
        raise ValueError(
            f"validation data has {windows} windows of {seq_len + 1} tokens, fewer than one "
            f"batch of {batch_size}"
        )
    if num_batches is None:
        num_batches = available
    elif not 1 <= num_batches <= available:
        raise ValueError(f"num_batches must be in [1, {available}], got {num_batches}")
    local = batch_size // process_count
    out = []
    for b in range(num_batches):
        first = b * batch_size + process_index * local
        out.append(_gather(tokens, np.arange(first, first + local) * seq_len, seq_len))
    return out
