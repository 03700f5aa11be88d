"""What ``--data`` accepts, read piece by piece: text, ``.jsonl``, Parquet, Arrow and token files.

`list_data_files` turns ``--data`` paths (files and directories) into typed `DataFile` s;
`read_pieces` yields a text-like file's documents as bounded pieces (so no file is ever held in
memory whole); `open_token_file` opens a pre-tokenized file for reading window by window
(`TokenFile`). Every problem is a
`DataError`: one line naming the file and what to do.

Formats, by file name:

- ``*.jsonl``: one JSON object per line; the document is its ``text_field`` (``--text-field``,
  default ``"text"``). Blank lines are skipped.
- ``*.parquet``: the ``text_field`` column, read a record batch at a time (needs ``pyarrow``).
- a Hugging Face ``datasets`` folder (``save_to_disk``'s Arrow files, or a folder of Parquet
  shards; `shardax.data.dataset_dirs`): the files of one split (``--data-split``), each read
  a record batch at a time; ``text_field`` as above, or ``messages`` records as chat data.
- ``*.u8`` / ``*.u16`` / ``*.u32``: token ids, that unsigned little-endian integer type.
  ``*.bin`` too, with ``--token-dtype uint16|uint32`` (as nanoGPT writes them).
- anything else: a text file (UTF-8, no NUL bytes in its first 8 KiB), one document per file.
  Inside a directory, files that are none of these (binaries, hidden files) are skipped. A
  byte that is not UTF-8 further into a text file is refused (naming the file, line and
  offset), as Hugging Face ``datasets`` does, rather than trained on as U+FFFD.

Example::

    for f in list_data_files(["corpus/", "extra.jsonl"]):
        for piece in read_pieces(f, text_field="text"):
            ...                                   # piece.text, piece.first, piece.last
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardax.data.dataset_dirs import find_dataset
from shardax.errors import DataError
from shardax.filecheck import parse_json

__all__ = [
    "TOKEN_DTYPES",
    "DataError",
    "DataFile",
    "Piece",
    "TokenFile",
    "check_dataset_entries",
    "columns",
    "is_text",
    "list_data_files",
    "open_token_file",
    "read_pieces",
    "read_records",
]

#: Token file extensions and their integer types.
TOKEN_DTYPES = {".u8": np.uint8, ".u16": np.uint16, ".u32": np.uint32}
_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: Text files are read (and encoded) in pieces of about this many bytes, cut after a newline.
PIECE_BYTES = 1 << 20
_SNIFF = 8192




@dataclass(frozen=True)
class DataFile:
    """One input file and how to read it: ``kind`` is text, jsonl, parquet, arrow or tokens;
    ``split``: the split of a ``datasets`` folder it was chosen for (None: not chosen)."""

    path: Path
    kind: str
    dtype: type | None = None  # token files only
    split: str | None = None

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class Piece:
    """Part of a document: ``first``/``last`` say whether it starts/ends the document."""

    text: str | bytes
    first: bool
    last: bool


def is_text(path: str | os.PathLike) -> bool:
    """Whether a file looks like text: no NUL byte and valid UTF-8 in its first 8 KiB."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # A multi-byte character cut by the end of the sample is still text.
        return len(head) == _SNIFF and e.start >= len(head) - 3
    return True


def _token_dtype(path: Path, token_dtype: str | None) -> type | None:
    suffix = path.suffix.lower()
    if suffix in TOKEN_DTYPES:
        return TOKEN_DTYPES[suffix]
    if suffix == ".bin" and token_dtype:
        if token_dtype not in _BIN_DTYPES:
            raise DataError(f"--token-dtype {token_dtype!r}: must be one of {list(_BIN_DTYPES)}")
        return _BIN_DTYPES[token_dtype]
    return None


def _classify(path: Path, token_dtype: str | None, explicit: bool) -> DataFile | None:
    """The `DataFile` for ``path``; None for a file a directory scan skips."""
    dtype = _token_dtype(path, token_dtype)
    if dtype is not None:
        return DataFile(path, "tokens", dtype)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return DataFile(path, "jsonl")
    if suffix == ".parquet":
        return DataFile(path, "parquet")
    if suffix == ".bin" and explicit:
        raise DataError(f"--data {path}: a .bin token file needs --token-dtype uint16 or "
                        "uint32 (or name it .u16 / .u32)")
    try:
        text = is_text(path)
    except OSError as e:
        raise DataError(f"--data {path}: cannot read it ({e.strerror})") from None
    if text:
        return DataFile(path, "text")
    if explicit:
        raise DataError(
            f"--data {path}: not a text file (NUL bytes or not UTF-8) and not a known "
            "format (.jsonl, .parquet, .u8/.u16/.u32 token files, .bin with --token-dtype)")
    return None


def _scan(directory: Path, token_dtype: str | None) -> list[DataFile]:
    try:
        found = sorted(
            (p for p in directory.rglob("*")
             if p.is_file() and not any(s.startswith(".")
                                        for s in p.relative_to(directory).parts)),
            key=lambda p: p.relative_to(directory).as_posix())
    except OSError as e:
        raise DataError(f"--data {directory}: cannot list it ({e.strerror})") from None
    files = [f for f in (_classify(p, token_dtype, explicit=False) for p in found) if f]
    if not files:
        what = (f"its {len(found)} files are all binary (e.g. {found[0]})" if found
                else "it holds no files")
        raise DataError(
            f"--data {directory}: no data files: {what}; give text files (UTF-8), "
            ".jsonl, .parquet or token files (.u8/.u16/.u32)")
    return files


def list_data_files(paths: Sequence[str | os.PathLike], token_dtype: str | None = None,
                    split: str = "train") -> list[DataFile]:
    """``--data`` paths -> typed files, in order; a directory contributes its data files
    recursively, sorted by relative path, hidden entries and binaries skipped; a ``datasets``
    folder (`find_dataset`) the files of ``split``.

    Example::

        list_data_files(["notes.txt", "shards/"])     # [DataFile('notes.txt', 'text'), ...]
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError("--data: no paths given")
    out: list[DataFile] = []
    for raw in paths:
        path = Path(raw)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise DataError(f"--data {path}: no such file or directory") from None
        except OSError as e:
            raise DataError(f"--data {path}: cannot read it ({e.strerror})") from None
        if stat.S_ISDIR(mode):
            found = find_dataset(path, split)
            out += ([DataFile(f, found.kind, split=found.split) for f in found.files] if found
                    else _scan(path, token_dtype))
        elif stat.S_ISREG(mode):
            out.append(_classify(path, token_dtype, explicit=True))
        else:
            raise DataError(f"--data {path}: not a regular file or directory (a device, "
                            "pipe or socket); give files or directories of data")
    return out


def _text_pieces(path: Path) -> Iterator[Piece]:
    """A text file in pieces of about `PIECE_BYTES`, cut after a newline when there is one
    (else between two UTF-8 characters), each checked to be UTF-8."""
    with open(path, "rb") as f:
        carry, first, line, offset = b"", True, 1, 0
        while True:
            block = f.read(PIECE_BYTES)
            data = carry + block
            if not block:  # the end: always a last piece (maybe empty) to close the document
                _check_utf8(path, data, line, offset)
                yield Piece(data, first, True)
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0 or len(data) - cut > PIECE_BYTES:  # no line end close enough
                cut = len(data) - _partial_char(data)
            carry = data[cut:]
            if data[:cut]:
                _check_utf8(path, data[:cut], line, offset)
                line, offset = line + data.count(b"\n", 0, cut), offset + cut
                yield Piece(data[:cut], first, False)
                first = False


def _partial_char(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character that they do not end."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:  # ASCII: complete
            return 0
        if b >= 0xC0:  # a lead byte: its character takes 2, 3 or 4 bytes
            return back if (2 if b < 0xE0 else 3 if b < 0xF0 else 4) > back else 0
    return 0


def _check_utf8(path: Path, data: bytes, line: int, offset: int) -> None:
    """A DataError naming the file, line and offset unless ``data`` (which starts on ``line``,
    at byte ``offset`` of the file) is UTF-8."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line += data.count(b"\n", 0, e.start)
        raise DataError(f"--data {path}: not UTF-8 text (byte {data[e.start]:#04x} on line "
                        f"{line}, offset {offset + e.start}); convert the file to UTF-8, e.g. "
                        "with iconv") from None


def _jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:  # strict UTF-8, bounded nesting, no lone surrogate: see shardax.filecheck
                record = parse_json(line, f"--data {path} line {number}")
            except ValueError as e:
                raise DataError(str(e)) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"--data {path} line {number}: no {text_field!r} field "
                                f"(has {keys}); choose the field with --text-field")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"--data {path} line {number}: field {text_field!r} is "
                                f"{type(text).__name__}, not a string; choose the text field "
                                "with --text-field")
            yield Piece(text, True, True)


def _pyarrow(path: Path, what: str):
    try:
        import pyarrow  # optional: extra "data"
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"--data {path}: reading {what} needs pyarrow: "
                        "pip install 'shardax[data]'") from None
    return pyarrow


def _parquet_rows(parquet, names: Sequence[str]) -> int:
    """Rows per batch that hold about `PIECE_BYTES` of the columns ``names`` (at most 256):
    long documents make small batches, so a batch's memory is bounded in bytes."""
    meta, size = parquet.metadata, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                    if group.column(c).path_in_schema.split(".")[0] in names)
    return int(np.clip(PIECE_BYTES * max(meta.num_rows, 1) // max(size, 1), 1, 256))


def _batches(file: DataFile, names: Sequence[str] | None = None
             ) -> Iterator[tuple[list[str], object]]:
    """``(column names, record batch)`` of a Parquet or Arrow stream file, a batch at a time
    (Parquet: only the columns ``names``, when given); a file with no batch yields its names
    once with None."""
    path, kind = file.path, file.kind
    pa = _pyarrow(path, "Parquet" if kind == "parquet" else "Arrow files")
    what = "Parquet file" if kind == "parquet" else "Arrow stream file (datasets' format)"
    try:
        with (contextlib.nullcontext() if kind == "parquet"
              else pa.OSFile(str(path), "rb")) as source:  # a file read, not a memory map
            if kind == "parquet":
                # pre_buffer (pyarrow's default) would cache the whole file's column data
                parquet = pa.parquet.ParquetFile(path, pre_buffer=False)
                have = parquet.schema_arrow.names
                wanted = [n for n in have if names is None or n in names]
                batches = parquet.iter_batches(batch_size=_parquet_rows(parquet, wanted),
                                               columns=wanted, use_threads=False)
            else:  # datasets writes Arrow IPC streams
                batches = pa.ipc.open_stream(source)
                have = batches.schema.names
            empty = True
            for batch in batches:
                empty = False
                yield have, batch
            if empty:
                yield have, None
    except pa.ArrowException as e:  # ArrowInvalid (and others) for a bad file
        raise DataError(f"--data {path}: not a readable {what} "
                        f"({str(e).splitlines()[0]})") from None


def columns(file: DataFile) -> list[str]:
    """The column names of a Parquet or Arrow file, from its schema alone.

    Example::

        columns(DataFile(Path("wiki/data-00000-of-00001.arrow"), "arrow"))  # ['id', 'text']
    """
    pa = _pyarrow(file.path, "Parquet" if file.kind == "parquet" else "Arrow files")
    try:
        if file.kind == "parquet":
            return pa.parquet.read_schema(file.path).names
        with pa.OSFile(str(file.path), "rb") as source:
            return pa.ipc.open_stream(source).schema.names
    except pa.ArrowException as e:
        raise DataError(f"--data {file.path}: not a readable "
                        f"{'Parquet' if file.kind == 'parquet' else 'Arrow stream'} file "
                        f"({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise DataError(f"--data {file.path}: cannot read it ({e.strerror})") from None


def read_records(file: DataFile, names: Sequence[str]) -> Iterator[dict]:
    """The records of a Parquet or Arrow file as dicts of the columns ``names``, in order,
    read a record batch at a time; a missing column is a DataError naming the columns there.

    Example::

        next(read_records(DataFile(Path("chat/train-0.parquet"), "parquet"), ["messages"]))
    """
    for have, batch in _batches(file, names):
        missing = [n for n in names if n not in have]
        if missing:
            raise DataError(f"--data {file.path}: no column {missing[0]!r} (has {have}); "
                            "choose the column with --text-field")
        if batch is not None:
            yield from batch.select(list(names)).to_pylist()


def _table_pieces(file: DataFile, text_field: str) -> Iterator[Piece]:
    for record in read_records(file, [text_field]):
        text = record[text_field]
        if text is not None and not isinstance(text, (str, bytes)):
            raise DataError(f"--data {file.path}: column {text_field!r} holds "
                            f"{type(text).__name__}, not text; choose it with --text-field")
        if text is not None:
            yield Piece(text, True, True)


def read_pieces(file: DataFile, text_field: str = "text") -> Iterator[Piece]:
    """The documents of a text, jsonl, Parquet or Arrow file, as `Piece` s of bounded size.

    Example::

        [p.text for p in read_pieces(DataFile(Path("a.txt"), "text"))]   # [b'...']
    """
    try:
        if file.kind == "text":
            yield from _text_pieces(file.path)
        elif file.kind == "jsonl":
            yield from _jsonl_pieces(file.path, text_field)
        elif file.kind in ("parquet", "arrow"):
            yield from _table_pieces(file, text_field)
        else:
            raise ValueError(f"read_pieces reads text, jsonl, parquet and arrow files, not "
                             f"{file.kind}")
    except OSError as e:
        raise DataError(f"--data {file.path}: cannot read it ({e.strerror})") from None


class TokenFile:
    """A token file read by positioned reads (``os.pread``): ``len(f)`` tokens, ``f[a:b]`` an
    array of tokens ``a`` to ``b``; nothing is read or kept otherwise.

    Not a memory map: with large page-cache folios (Linux 6) every window read through a map
    maps up to 2 MiB of the file into the process, so its RSS would grow with the corpus as
    training visits it; a read copies just the window. Nor an open descriptor per file: a
    directory of thousands of shards would run out of them.

    Example::

        f = TokenFile("train.u16", np.uint16)
        f[1000:1129]                                # uint16 [129]
    """

    ndim = 1

    def __init__(self, path: str | os.PathLike, dtype: type, size: int | None = None):
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        size = self.path.stat().st_size if size is None else size
        self._len = size // self.dtype.itemsize

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"TokenFile takes contiguous slices, got {key!r}")
        start, stop, _ = key.indices(self._len)
        want = max(stop - start, 0) * self.dtype.itemsize
        chunks, offset = [], start * self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while want:
                chunk = os.pread(fd, want, offset)
                if not chunk:
                    raise DataError(f"--data {self.path}: the file shrank while in use")
                chunks.append(chunk)
                want, offset = want - len(chunk), offset + len(chunk)
        finally:
            os.close(fd)
        return np.frombuffer(b"".join(chunks), self.dtype)


def open_token_file(file: DataFile) -> TokenFile:
    """A token file, checked to hold whole tokens, read window by window (`TokenFile`).

    Example::

        tokens = open_token_file(DataFile(Path("train.u16"), "tokens", np.uint16))
    """
    itemsize = np.dtype(file.dtype).itemsize
    try:
        size = file.path.stat().st_size
    except OSError as e:
        raise DataError(f"--data {file.path}: cannot read it ({e.strerror})") from None
    if size % itemsize:
        raise DataError(f"--data {file.path}: {size} bytes is not a whole number of "
                        f"{np.dtype(file.dtype).name} tokens; is --token-dtype / the extension "
                        "right?")
    return TokenFile(file.path, file.dtype, size)


def check_dataset_entries(paths: Sequence[str | os.PathLike], split: str, text_field: str,
                          flag: str = "--data") -> None:
    """Checks the ``datasets`` folders among ``paths`` without reading their records: the
    layout, that ``split`` is there and that its first file has ``text_field`` (or
    ``messages``: chat records). A `DataError` names ``flag`` and the folder; other paths
    are left to the reader.

    Example::

        check_dataset_entries(["wiki/", "notes.txt"], "train", "text")
    """
    for path in map(Path, paths):
        if not path.is_dir():
            continue
        try:
            found = find_dataset(path, split)
            have = columns(DataFile(found.files[0], found.kind)) if found else []
        except DataError as e:
            raise DataError(str(e).replace("--data", flag, 1)) from None
        if found and text_field not in have and "messages" not in have:
            where = f"split {found.split!r}" if found.split else "records"
            raise DataError(f"{flag} {path}: no column {text_field!r} in its {where} (has "
                            f"{have}); choose the text column with --text-field (or give chat "
                            "records with 'messages')")
