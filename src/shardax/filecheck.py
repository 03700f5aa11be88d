"""Files named by users opened safely: regular files only, never a blocking open, bounded reads.

A path may name a FIFO (whose plain ``open`` waits forever for a writer), a device or a
directory; it is opened non-blocking and refused unless ``fstat`` says it is a regular file.
Reads of small metadata files (``config.json``, an index, a ``--config`` file) are bounded,
so a hostile file cannot make the process allocate without limit. Text is strict UTF-8 and
JSON is parsed with its nesting bounded (Python's recursion limit, caught) and no lone UTF-16
surrogate (``"\\ud800"``) in its strings. Errors are ``ValueError`` naming the file (and the
line). Needs only the standard library (the CLI reads ``--config`` before JAX).

Example::

    raw = read_regular("model/config.json", limit=16 * 2**20)
    config = read_json("model/tokenizer_config.json")     # any JSON value; check its type
    fd = open_regular("model/model.safetensors")   # an fd of a regular file; close it
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

__all__ = ["MAX_JSON_BYTES", "decode_utf8", "open_regular", "parse_json", "read_json",
           "read_regular", "read_text"]

#: The most a JSON metadata file (config.json, tokenizer_config.json, an index) may hold.
MAX_JSON_BYTES = 64 * 2**20
# A \uD800-\uDFFF escape not part of a high+low pair: JSON allows it, UTF-8 cannot hold it.
_LONE_SURROGATE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks followed).

    Opened with ``O_NONBLOCK`` so that a FIFO is refused at once instead of waiting for a
    writer; the flag is cleared again (it means nothing for a regular file).

    Example::

        fd = open_regular("model.safetensors"); os.pread(fd, 8, 0); os.close(fd)
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot open it ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{path}: is {_kind(mode)}, expected a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused unread when it holds more than
    ``limit`` bytes.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(b"{}"); f.flush()
    ...     read_regular(f.name, limit=100)
    b'{}'
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{path}: {size} bytes is more than the {limit} bytes such a file "
                             "may hold")
        chunks, total = [], 0
        try:  # a file growing under us stays bounded
            while chunk := os.read(fd, limit + 1 - total):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise ValueError(f"{path}: more than the {limit} bytes such a file may "
                                     "hold")
        except OSError as e:  # e.g. /proc/self/mem: "regular", yet unreadable
            raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_utf8(raw: bytes, where: str) -> str:
    """``raw`` decoded as UTF-8; a ValueError naming ``where`` and the line of the first
    invalid byte otherwise.

    >>> decode_utf8(b"ok\\n\\xff", "notes.txt")
    Traceback (most recent call last):
    ValueError: notes.txt: not UTF-8 text (byte 0xff on line 2, at offset 3)
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = _line(raw, b"\n", e.start)
        raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} {line}at offset "
                         f"{e.start})") from None


def _line(text: Any, newline: Any, at: int) -> str:
    """``'on line N, '`` of position ``at`` in a text of several lines; ``''`` in one line
    (a record of a ``.jsonl`` file, whose line its caller names)."""
    if newline not in text.rstrip():
        return ""
    return f"on line {text.count(newline, 0, at) + 1}, "


def read_text(path: str | os.PathLike, limit: int) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``limit`` bytes (`read_regular`,
    `decode_utf8`)."""
    return decode_utf8(read_regular(path, limit), str(path))


def parse_json(text: str | bytes, where: str) -> Any:
    """The JSON value of ``text`` (bytes are decoded as strict UTF-8); errors are one-line
    ValueErrors prefixed with ``where``: bad UTF-8, bad JSON, nesting deeper than Python's
    recursion limit, a lone surrogate escape in a string.

    >>> parse_json('{"a": [1, 2]}', "x.json")
    {'a': [1, 2]}
    >>> parse_json('{"a": "\\\\ud800"}', "x.json")
    Traceback (most recent call last):
    ValueError: x.json: a lone UTF-16 surrogate escape ('\\\\ud800') is not text (half of a pair)
    """
    if isinstance(text, bytes):
        text = decode_utf8(text, where)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}, {_line(text, chr(10), e.pos)}"
                         f"column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    match = "\\u" in text and _LONE_SURROGATE.search(text)
    if match and not _all_text(value):  # the match could be an escaped backslash's "\\ud800"
        line = _line(text, "\n", match.start()).removeprefix("on ").removesuffix(", ")
        raise ValueError(f"{where}: a lone UTF-16 surrogate escape ({match.group()!r}"
                         f"{', ' + line if line else ''}) is not text (half of a pair)")
    return value


def read_json(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in the regular file ``path`` of at most ``limit`` bytes; errors are
    one-line ValueErrors naming the file (`read_regular`, `parse_json`).

    Example::

        config = read_json("model/config.json")
        if not isinstance(config, dict): ...       # the caller checks the shape it needs
    """
    return parse_json(read_regular(path, limit), str(path))


def _all_text(value: Any) -> bool:
    """Whether every string (key or value) in a parsed JSON value encodes as UTF-8; iterative,
    so a deeply nested value cannot exhaust the stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return True
