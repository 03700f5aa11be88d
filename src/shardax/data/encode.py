"""Encoding text into a token cache ahead of training, in parallel, with bounded memory.

`encode_files` tokenizes text / jsonl / Parquet / Arrow files once into a token file
(``<cache>/tokens/<key>/tokens.u8|u16|u32`` + ``meta.json``) and opens it; later runs
with the same files (path, size, modification time, and the split of a ``datasets`` folder),
tokenizer and ``--text-field`` reuse it.
Files are read piece by piece (`readers.read_pieces`) and pieces are grouped into chunks of
about 1 MiB that worker threads encode (the Hugging Face tokenizer releases the GIL and is
itself multi-threaded); chunks are written in order as they finish, at most ``2 * workers``
in flight. Host memory therefore depends on the chunk size and the worker count, never on
the corpus size.

The cache lives under ``$SHARDAX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/shardax`` or
``~/.cache/shardax``). A cache is written to a temporary directory and renamed into place, so
processes that build the same cache at once (several processes of a job, on a shared or a
local disk) never see a partial one.

Example::

    tokens = encode_files(list_data_files(["corpus/"]), load_tokenizer("bytes"))
    len(tokens)                       # tokens of every document, each followed by the eos id
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from shardax.data.readers import DataFile, Piece, TokenFile, open_token_file, read_pieces
from shardax.data.tokenizer import Tokenizer
from shardax.errors import DataError
from shardax.filewrite import remove_tree

__all__ = ["CACHE_ENV", "cache_root", "encode_files", "encode_pieces", "token_dtype"]

CACHE_ENV = "SHARDAX_CACHE_DIR"
_FORMAT = 1  # bump when the cache layout or the document encoding changes
CHUNK_BYTES = 1 << 20


def cache_root() -> Path:
    """``$SHARDAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardax``, else ``~/.cache/shardax``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardax"


def token_dtype(vocab_size: int) -> type:
    """The smallest unsigned type that holds every id of a ``vocab_size`` vocabulary."""
    return np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _chunks(pieces: Iterable[Piece], chunk_bytes: int) -> Iterator[list[Piece]]:
    chunk, size = [], 0
    for piece in pieces:
        chunk.append(piece)
        size += len(piece.text)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tokenizer: Tokenizer, chunk: list[Piece], dtype: type) -> np.ndarray:
    bodies = tokenizer.encode_pieces([p.text for p in chunk])
    prefix, end = np.asarray(tokenizer.prefix, dtype), np.asarray(tokenizer.end(), dtype)
    parts = []
    for piece, body in zip(chunk, bodies):
        parts += [prefix] if piece.first else []
        parts.append(body.astype(dtype, copy=False))
        parts += [end] if piece.last else []
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def encode_pieces(pieces: Iterable[Piece], tokenizer: Tokenizer, workers: int | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """Token arrays of ``pieces``, in order, encoded by ``workers`` threads ahead of the reader.

    Example::

        ids = np.concatenate(list(encode_pieces(read_pieces(file), tokenizer)))
    """
    workers = workers or min(8, os.cpu_count() or 1)
    dtype = token_dtype(tokenizer.vocab_size)
    with ThreadPoolExecutor(workers, thread_name_prefix="shardax-encode") as pool:
        pending: deque = deque()
        for chunk in _chunks(pieces, chunk_bytes):
            pending.append(pool.submit(_encode_chunk, tokenizer, chunk, dtype))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _key(files: Sequence[DataFile], tokenizer: Tokenizer, text_field: str) -> str:
    sources = []
    for f in files:
        st = f.path.stat()
        # a datasets folder's split is part of the key (a changed split is a new cache)
        sources.append([str(f.path.resolve()), f.kind, st.st_size, st.st_mtime_ns]
                       + ([f.split] if f.split is not None else []))
    uses_field = any(f.kind in ("jsonl", "parquet", "arrow") for f in files)
    blob = json.dumps([_FORMAT, tokenizer.fingerprint, text_field if uses_field else None,
                       sources])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _open(directory: Path) -> TokenFile | None:
    """The cached tokens in ``directory``, or None if it holds no complete cache."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        file = DataFile(directory / meta["file"], "tokens", np.dtype(meta["dtype"]).type)
        tokens = open_token_file(file)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tokens if len(tokens) == meta["num_tokens"] else None


def _writable_root() -> Path:
    root = cache_root()
    try:
        (root / "tokens").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if os.environ.get(CACHE_ENV):
            raise DataError(f"cannot create the token cache {root} ({e.strerror}); set "
                            f"{CACHE_ENV} to a writable directory") from None
        root = Path(tempfile.gettempdir()) / f"shardax-{os.getuid()}"
        (root / "tokens").mkdir(parents=True, exist_ok=True)
    return root


def encode_files(files: Sequence[DataFile], tokenizer: Tokenizer, text_field: str = "text",
                 workers: int | None = None,
                 log: Callable[[str], None] | None = None) -> TokenFile:
    """Tokenizes text/jsonl/Parquet ``files`` into the cache (once) and opens the result:
    every document is ``prefix + body + suffix + [eos]`` (see `Tokenizer`), documents in file
    order. ``log`` gets a line when a cache is built.

    Example::

        tokens = encode_files(list_data_files(["a.jsonl"]), load_tokenizer("hf:llama"))
    """
    root = _writable_root()
    final = root / "tokens" / _key(files, tokenizer, text_field)
    cached = _open(final)
    if cached is not None:
        return cached
    if final.exists():  # an incomplete cache cannot come from a rename: clear it
        remove_tree(final)  # a symlink there: only the link
    dtype = token_dtype(tokenizer.vocab_size)
    name = f"tokens.u{8 * np.dtype(dtype).itemsize}"
    tmp = final.parent / f".{final.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"
    start, size = time.perf_counter(), sum(f.path.stat().st_size for f in files)
    if log:
        log(f"tokenizing {len(files)} file{'s' * (len(files) != 1)} ({size / 1e6:,.1f} MB) "
            f"into {final}")
    try:
        tmp.mkdir()
        count = 0
        with open(tmp / name, "wb") as out:
            pieces = (p for f in files for p in read_pieces(f, text_field))
            for ids in encode_pieces(pieces, tokenizer, workers):
                out.write(ids.tobytes())
                count += len(ids)
        meta = {"file": name, "dtype": np.dtype(dtype).name, "num_tokens": count,
                "tokenizer": tokenizer.fingerprint, "files": [str(f.path) for f in files]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # another process published the same cache first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot write the token cache {final} ({e.strerror}); set "
                        f"{CACHE_ENV} to a directory with room") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokens = _open(final)
    if tokens is None:
        raise DataError(f"the token cache {final} is unreadable; delete it and retry")
    if log:
        seconds = time.perf_counter() - start
        log(f"tokenized {len(tokens):,} tokens in {seconds:.1f} s "
            f"({size / 1e6 / max(seconds, 1e-9):,.1f} MB/s)")
    return tokens
