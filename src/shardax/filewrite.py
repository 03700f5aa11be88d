"""Files written only inside their directory: atomically, replacing a symlink, never following it.

Every file shardax writes (an export's ``config.json`` and safetensors, a PEFT adapter, a
run's ``config.json``, ``metrics.jsonl`` and ``loss.png``, tokenizer copies) is written to a
temporary file in its directory and renamed over the target (``os.replace``): a reader never
sees half a file, and a symlink planted at the target's name is replaced by the new file
instead of having the file it points to overwritten (anyone who can write into a shared
export folder could otherwise make an export overwrite ``~/.bashrc``). A target directory
that is itself a symlink is refused (`check_target_dir`): what is written into it would land
where the link leads. Errors are ``ValueError`` naming the path; ``OSError`` passes through.
Needs only the standard library.

Example::

    check_target_dir("export/llama", "--to")
    write_text("export/llama/config.json", "{}\\n")
    with replacing("export/llama/model.safetensors") as tmp:
        write_weights(tmp)                        # renamed over the target when it succeeds
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["append_text", "check_target_dir", "copy_file", "make_dir", "remove_tree",
           "replacing", "write_text"]


def check_target_dir(path: str | os.PathLike, flag: str) -> None:
    """Refuses (``ValueError``) a directory to write into that is a symlink, or a file.

    >>> check_target_dir("no/such/dir/yet", "--to")
    """
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"{flag} {p} is a symlink to {os.readlink(p)}; shardax writes only "
                         "into a real directory (give the directory it leads to, if that is "
                         "meant)")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is a file; give a directory")


def make_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory (parents created); a symlink there is replaced by a directory,
    never written through.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> (d / "sub").symlink_to("/"); make_dir(d / "sub").is_symlink()
    False
    """
    p = Path(path)
    if p.is_symlink():
        p.unlink()
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` (a symlink there
    included: it is replaced, not followed) when the block succeeds, removed when it fails.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> with replacing(d / "a.txt") as tmp:
    ...     _ = tmp.write_text("hi")
    >>> (d / "a.txt").read_text()
    'hi'
    """
    p = Path(path)
    while True:  # mode 0o666 less the umask, as open() gives (mkstemp's would be 0o600)
        tmp = p.parent / f".{p.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes ``text`` to ``path`` atomically (`replacing`); returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def copy_file(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Copies the contents of ``source`` to ``path`` atomically (`replacing`)."""
    with replacing(path) as tmp:
        shutil.copyfile(source, tmp)
    return Path(path)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends ``text`` to ``path`` (created if absent); a symlink at ``path`` is refused
    (``OSError``), never appended through.

    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> append_text(p, "1\\n"); append_text(p, "2\\n"); p.read_text()
    '1\\n2\\n'
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(text)


def remove_tree(path: str | os.PathLike) -> None:
    """Removes directory ``path``; when it is a symlink, only the link (never what it leads
    to). Errors are ignored, as by ``shutil.rmtree(..., ignore_errors=True)``."""
    p = Path(path)
    if p.is_symlink():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)
