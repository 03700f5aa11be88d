"""Files named by users opened safely: regular files only, never a blocking open, bounded reads.

A path may name a FIFO (whose plain ``open`` waits forever for a writer), a device or a
directory; it is opened non-blocking and refused unless ``fstat`` says it is a regular file.
Reads of small metadata files (``config.json``, an index, a ``--config`` file) are bounded,
so a hostile file cannot make the process allocate without limit. Errors are ``ValueError``
naming the file. Needs only the standard library (the CLI reads ``--config`` before JAX).

Example::

    raw = read_regular("model/config.json", limit=16 * 2**20)
    fd = open_regular("model/model.safetensors")   # an fd of a regular file; close it
"""

from __future__ import annotations

import os
import stat

__all__ = ["open_regular", "read_regular"]


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
