"""Language-model batches: documents packed into a token stream on disk, sampled by step.

**Formats.** ``--data`` takes text files and directories, ``.jsonl`` (``--text-field``),
Parquet, Hugging Face ``datasets`` folders (``--data-split``) and pre-tokenized token files
(``.u8``/``.u16``/``.u32``, or ``.bin`` with ``--token-dtype``); see `shardax.data.readers`.
Text-like files are tokenized once, ahead of training and in parallel, into a token cache
(`shardax.data.encode`); token files are read as they are. With no ``--data``, the corpus is
the Python standard library's own sources (`default_corpus`).

**Packing.** Every document becomes ``prefix + tokens + suffix + [eos]`` (the tokenizer's own
special tokens, then the end-of-text id; with the byte tokenizer: the bytes, then NUL), and the
documents of all inputs, in order, form one stream (a `TokenStream` over on-disk
segments). Training cuts the stream into windows of ``seq_len + 1`` tokens (inputs and their
next-token targets): a window may span documents, with the eos token between them, and no
token is padding. Token files are taken as already packed: write the eos id between documents.

**Determinism.** The global batch at step ``k`` is a pure function of ``(seed, k)``: global
sample ``g = k * batch_size + row`` is window ``order[g]`` of the epoch ``g // W`` (``W``
windows per epoch, boundaries shifted by a random offset per epoch), where ``order`` is
``grain.MapDataset.range(W).shuffle(seed).repeat()``: grain's index shuffle, a bijection per
epoch computed per index in O(1) memory (a materialized permutation of a large corpus's
windows would itself grow with the corpus). Each process reads only its rows of that global
batch (`TokenBatches`: ``process_index``/``process_count``, from the mesh), so resuming needs
only the step, and the same step gives the same global batch on any number of processes and
any mesh. grain's ``DataLoader`` is not used: its iterator state and per-worker sharding
would tie the order to the process count; random access into a ``MapDataset`` does not.

**Memory.** Nothing scales with the corpus: token files and the cache are read window by
window with positioned reads (`TokenFile`; a memory map would count every visited 2 MiB
page-cache folio in the process's RSS), and encoding holds a few 1 MiB chunks at a time. The
``data_memory`` benchmark measures it.

Example::

    tok = load_tokenizer("bytes")
    train, val = load_splits(["corpus/", "notes.jsonl"], tok)        # TokenStreams
    data = TokenBatches(train, seq_len=128, batch_size=16, seed=0)
    inputs, targets = next(data)            # int32 [16, 128]; targets = inputs shifted by one
    saved = data.state()                    # {"step": 1, ...}: store it with the checkpoint
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from shardax.data.encode import encode_files
from shardax.data.readers import DataFile, TokenFile, list_data_files, open_token_file
from shardax.data.tokenizer import ByteTokenizer, Tokenizer
from shardax.errors import DataError

__all__ = [
    "SEPARATOR",
    "DataError",
    "TokenBatches",
    "TokenStream",
    "check_splits",
    "count_batches",
    "default_corpus",
    "load_bytes",
    "load_splits",
    "open_data",
    "split_tokens",
    "val_batches",
]

#: Byte written between files by `load_bytes` (the byte tokenizer's eos): NUL never occurs in
#: text, so it marks the end of a document.
SEPARATOR = b"\x00"
VAL_FRACTION = 0.1

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
# Tokens of each token file checked against the vocabulary up front: its start and spread blocks.
_ID_CHECK_HEAD, _ID_CHECK_BLOCKS, _ID_CHECK_BLOCK = 1 << 18, 16, 1 << 14


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


def load_bytes(paths: Sequence[str | os.PathLike], separator: bytes = SEPARATOR) -> np.ndarray:
    """Reads small text corpora into memory as one uint8 array (`open_data` streams instead).

    Files are joined with ``separator`` (default NUL, one byte), which also ends the last file.

    Example::

        tokens = load_bytes(["a.txt", "b.txt"])    # b"<a>\\0<b>\\0" as uint8
    """
    files = list_data_files(paths)
    other = [str(f) for f in files if f.kind != "text"]
    if other:
        raise DataError(f"load_bytes reads text files; use open_data for {other}")
    data = b"".join(f.path.read_bytes() + separator for f in files)
    if len(data) == len(files) * len(separator):
        raise DataError(f"all data files are empty: {[str(f) for f in files]}")
    return np.frombuffer(data, dtype=np.uint8).copy()


class TokenStream:
    """One read-only token sequence over several segments: token files (`TokenFile`, read
    window by window) or arrays.

    ``len(stream)`` tokens; `rows` reads windows, which may span segments; `view` is a
    sub-range. Nothing is copied or read until a window is.

    Example::

        stream = TokenStream([TokenFile("a.u16", np.uint16), np.array([5, 6], np.uint16)])
        stream.rows(np.array([0, 10]), 4)          # int32 [2, 4]
        train, val = stream.view(0, 900), stream.view(900, len(stream))
    """

    def __init__(self, segments: Sequence[np.ndarray | TokenFile]):
        self.segments = [s for s in segments if len(s)]
        for s in self.segments:
            if s.ndim != 1:
                raise ValueError(f"tokens must be 1-D, got shape {s.shape}")
        self._offsets = np.cumsum([0] + [len(s) for s in self.segments])
        self.start, self.stop = 0, int(self._offsets[-1])

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> TokenStream:
        """Tokens ``[start, stop)`` of this stream, sharing its arrays."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"view [{start}, {stop}) outside a stream of {len(self)} tokens")
        out = object.__new__(TokenStream)
        out.segments, out._offsets = self.segments, self._offsets
        out.start, out.stop = self.start + start, self.start + stop
        return out

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 ``[len(starts), length]``: row ``i`` holds tokens ``starts[i]`` onwards."""
        out = np.empty((len(starts), length), np.int32)
        for i, start in enumerate(np.asarray(starts, np.int64)):
            if not 0 <= start <= len(self) - length:
                raise ValueError(f"window [{start}, {start + length}) outside a stream of "
                                 f"{len(self)} tokens")
            pos, filled = self.start + int(start), 0
            seg = int(np.searchsorted(self._offsets, pos, side="right")) - 1
            while filled < length:
                offset = pos - int(self._offsets[seg])
                piece = self.segments[seg][offset:offset + length - filled]
                out[i, filled:filled + len(piece)] = piece
                filled, pos, seg = filled + len(piece), pos + len(piece), seg + 1
        return out


def _check_ids(tokens: TokenFile, file: DataFile, vocab_size: int) -> None:
    """Samples a token file's start and spread blocks for ids outside the vocabulary."""
    n = len(tokens)
    blocks = [tokens[:_ID_CHECK_HEAD]]
    for start in np.linspace(0, max(n - _ID_CHECK_BLOCK, 0), _ID_CHECK_BLOCKS).astype(np.int64):
        blocks.append(tokens[start:start + _ID_CHECK_BLOCK])
    top = max(int(b.max()) for b in blocks if len(b))
    if top >= vocab_size:
        raise DataError(
            f"--data {file.path}: token id {top} is outside the tokenizer's vocabulary of "
            f"{vocab_size}; give the --tokenizer the file was made with (or the right "
            "--token-dtype / extension)")


def open_data(paths: Sequence[str | os.PathLike], tokenizer: Tokenizer | None = None,
              text_field: str = "text", token_dtype: str | None = None,
              log: Callable[[str], None] | None = None, split: str = "train") -> TokenStream:
    """``--data`` paths as one packed `TokenStream`, in order: token files read as they are,
    each run of consecutive text/jsonl/Parquet/Arrow files encoded into the cache
    (`encode_files`); of a ``datasets`` folder, the files of ``split``.

    Raises `DataError` (one line naming the file) for anything unusable.

    Example::

        stream = open_data(["shards/", "extra.u16"], load_tokenizer("hf:models/llama"))
    """
    tokenizer = tokenizer or ByteTokenizer()
    files = list_data_files(paths, token_dtype or None, split)
    try:
        empty = all(f.path.stat().st_size == 0 for f in files)
    except OSError as e:
        raise DataError(f"--data {e.filename}: cannot read it ({e.strerror})") from None
    if empty:
        raise DataError(f"--data: all data files are empty: {[str(f) for f in files][:5]}")
    segments, group = [], []

    def flush():
        if group:
            segments.append(encode_files(group, tokenizer, text_field, log=log))
            group.clear()

    for f in files:
        if f.kind != "tokens":
            group.append(f)
            continue
        flush()
        tokens = open_token_file(f)
        if len(tokens):
            _check_ids(tokens, f, tokenizer.vocab_size)
        segments.append(tokens)
    flush()
    return TokenStream(segments)


def load_splits(paths: Sequence[str | os.PathLike], tokenizer: Tokenizer | None = None,
                text_field: str = "text", token_dtype: str | None = None,
                log: Callable[[str], None] | None = None,
                val_fraction: float = VAL_FRACTION) -> tuple[TokenStream, TokenStream]:
    """(train, validation) streams: with ``paths``, the last ``val_fraction`` of `open_data`'s
    stream is held out; without, the built-in corpus's train and val files (`default_corpus`).

    Example::

        train, val = load_splits([], load_tokenizer("bytes"))      # the stdlib corpus
    """
    tokenizer = tokenizer or ByteTokenizer()
    if not paths:
        return tuple(TokenStream([encode_files([DataFile(p, "text") for p in default_corpus(s)],
                                               tokenizer, log=log)])
                     for s in ("train", "val"))
    return split_tokens(open_data(paths, tokenizer, text_field, token_dtype, log), val_fraction)


def split_tokens(tokens: np.ndarray | TokenStream, val_fraction: float = VAL_FRACTION):
    """Splits tokens into (train, val): the last ``val_fraction`` is held out (views, no copy).

    For user data; `default_corpus` splits by file instead.

    Example::

        train, val = split_tokens(load_bytes(["book.txt"]), 0.05)
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = len(tokens) - int(round(len(tokens) * val_fraction))
    if isinstance(tokens, TokenStream):
        return tokens.view(0, cut), tokens.view(cut, len(tokens))
    return tokens[:cut], tokens[cut:]


def count_batches(n_tokens: int, seq_len: int, batch_size: int) -> int:
    """How many batches of consecutive, disjoint windows ``n_tokens`` tokens hold."""
    return max(n_tokens - 1, 0) // seq_len // batch_size


def check_splits(train_tokens: int, val_tokens: int, seq_len: int, batch_size: int,
                 data: Sequence[str | os.PathLike] = (),
                 val_fraction: float = VAL_FRACTION) -> None:
    """Raises `DataError` (naming the flags, the ``--data`` paths and what to do) when the
    training split holds no window of ``seq_len + 1`` tokens or the validation split not one
    batch of them. No ``data``: the built-in corpus.

    Example::

        check_splits(len(train), len(val), seq_len=128, batch_size=16, data=["corpus/"])
    """
    builtin = not data
    flag = "--data" if builtin else "--data " + " ".join(str(p) for p in data[:3]) + (
        " ..." if len(data) > 3 else "")
    if train_tokens < seq_len + 1:
        raise DataError(
            f"{flag}: the training split has {train_tokens:,} tokens, fewer than --seq-len + 1 "
            f"= {seq_len + 1}; give more data or lower --seq-len")
    need = batch_size * seq_len + 1
    if count_batches(val_tokens, seq_len, batch_size) < 1:
        where = ("the built-in corpus's validation files hold" if builtin else
                 f"the validation split (the last {val_fraction:.0%} of the data) has")
        total = "" if builtin else f"give at least {int(need / val_fraction) + 1:,} tokens of " \
                                   "data in all, or "
        raise DataError(
            f"{flag}: {where} {val_tokens:,} tokens, fewer than one batch of --batch-size "
            f"{batch_size} x --seq-len {seq_len} (+1) = {need:,}; {total}lower --batch-size or "
            "--seq-len")


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


def _as_stream(tokens: np.ndarray | TokenStream) -> TokenStream:
    return tokens if isinstance(tokens, TokenStream) else TokenStream([np.asarray(tokens)])


def _split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rows[:, :-1], rows[:, 1:]


class TokenBatches:
    """Deterministic, resumable language-model batches over a token stream.

    The stream is cut into ``W = (len(tokens) - 1) // seq_len`` windows of ``seq_len + 1``
    tokens (inputs and the next-token targets). Each epoch visits every window once, in an
    order shuffled by grain from ``(seed, epoch)``, with window boundaries shifted by a random
    offset per epoch. Global sample ``g = step * batch_size + row`` is window ``order[g]`` of
    epoch ``g // W``, so the batch for ``step`` is a pure function of ``(seed, step)``.

    Multi-process: process ``p`` of ``P`` gets the contiguous rows
    ``[p * batch_size // P, (p + 1) * batch_size // P)`` of each global batch and reads only
    those windows. Concatenating the processes' batches in process order gives the
    single-process batch exactly, which is the layout `jax.make_array_from_process_local_data`
    expects for a batch sharded over all devices. ``vocab_size``: every batch is checked to hold
    only ids below it.

    Example::

        data = TokenBatches(tokens, seq_len=64, batch_size=8, seed=0,
                            process_index=jax.process_index(), process_count=jax.process_count())
        x, y = next(data)               # int32 [8 // process_count, 64]
        data.restore(saved_state)       # continue exactly where a checkpointed run stopped
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenStream,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        vocab_size: int | None = None,
    ):
        self.tokens = _as_stream(tokens)
        self.windows = _check_sizes(
            len(self.tokens), seq_len, batch_size, process_index, process_count
        )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = batch_size // process_count
        self.vocab_size = vocab_size
        self.step = 0
        # grain adds the epoch to the seed: mix the user's seed so that seeds s and s + 1 do
        # not share epochs.
        mixed = int(np.random.SeedSequence(seed).generate_state(1)[0])
        self._order = grain.MapDataset.range(self.windows).shuffle(seed=mixed).repeat()
        self._shifts: dict[int, int] = {}

    def _shift(self, epoch: int) -> int:
        """Where epoch ``epoch``'s first window starts; the last two are cached."""
        if epoch not in self._shifts:
            slack = len(self.tokens) - 1 - self.windows * self.seq_len
            if len(self._shifts) >= 2:
                self._shifts.pop(next(iter(self._shifts)))
            self._shifts[epoch] = int(np.random.default_rng([self.seed, epoch])
                                      .integers(0, slack + 1))
        return self._shifts[epoch]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's ``(inputs, targets)`` for ``step``; does not move the iterator."""
        first = step * self.batch_size + self.process_index * self.local_batch_size
        rows = self.windows_at(np.arange(first, first + self.local_batch_size))
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise DataError(f"--data: token id {rows.max()} at step {step} is outside the "
                            f"vocabulary of {self.vocab_size}; give the matching --tokenizer")
        return _split_rows(rows)

    def windows_at(self, samples: np.ndarray) -> np.ndarray:
        """int32 ``[len(samples), seq_len + 1]``: the windows of global samples ``samples``
        (sample ``g`` is window ``order[g]`` of epoch ``g // W``), unchecked.

        Example::

            rows = data.windows_at(np.arange(3))     # the first 3 samples of the seed's order
        """
        starts = np.array([self._shift(int(g) // self.windows)
                           + self._order[int(g)] * self.seq_len for g in samples], np.int64)
        return self.tokens.rows(starts, self.seq_len + 1)

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
        if "mixture" in state:
            raise ValueError("--data: the run being resumed reads a weighted mixture; give "
                             "its entries with weights (PATH:WEIGHT)")
        check_same(state, self.state(), ("seed", "seq_len", "batch_size", "num_tokens"))
        self.step = int(state["step"])
        return self


class EpochOrder:
    """Where sample ``g`` of an endless stream over ``n`` items is: epoch ``g // n`` is a
    permutation seeded by ``(seed, epoch)``; the last two epochs' permutations are kept.

    >>> order = EpochOrder(4, seed=0)
    >>> sorted(order(range(4))) == [0, 1, 2, 3] and sorted(order(range(4, 8))) == [0, 1, 2, 3]
    True
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._epochs[epoch]

    def __call__(self, samples: Iterable[int]) -> np.ndarray:
        """The item of each global sample index."""
        return np.array([self._epoch(g // self.n)[g % self.n] for g in samples], np.int64)


def check_same(saved: dict[str, Any], mine: dict[str, Any], keys: Sequence[str]) -> None:
    """A batch source's ``restore`` check: ``saved`` (a checkpoint's data state) holds the
    same ``keys`` as this source's ``mine``; a ValueError naming the first that differs.

    >>> check_same({"seed": 1}, {"seed": 2}, ["seed"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: data state mismatch for 'seed': saved 1, this dataset has 2; ...
    """
    for key in keys:
        if key in saved and saved[key] != mine[key]:
            raise ValueError(f"data state mismatch for {key!r}: saved {saved[key]}, this "
                             f"dataset has {mine[key]}; the resumed run would read different "
                             "batches")


def val_batches(
    tokens: np.ndarray | TokenStream,
    seq_len: int,
    batch_size: int,
    num_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed evaluation batches: consecutive windows from the start of ``tokens``, in order.

    ``num_batches=None`` takes every full batch (`count_batches`). Rows are split over
    processes as in `TokenBatches`.

    Example::

        for x, y in val_batches(load_bytes(default_corpus("val")), 128, 16, num_batches=4):
            ...
    """
    tokens = _as_stream(tokens)
    windows = _check_sizes(len(tokens), seq_len, batch_size, process_index, process_count)
    available = count_batches(len(tokens), seq_len, batch_size)
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
        out.append(_split_rows(tokens.rows(np.arange(first, first + local) * seq_len,
                                           seq_len + 1)))
    return out
