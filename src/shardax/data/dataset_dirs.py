"""Hugging Face ``datasets`` folders on disk: which Arrow or Parquet files hold a split.

Two layouts are recognised, as ``datasets`` writes and names them:

- **save_to_disk**: a ``Dataset`` folder (``state.json`` whose ``_data_files`` list the Arrow
  stream files, ``data-00000-of-00001.arrow`` ..., and ``dataset_info.json``), or a
  ``DatasetDict`` folder (``dataset_dict.json`` with ``{"splits": [...]}`` and one such
  folder per split). A single ``Dataset`` is one split: it is read whole, whatever the split.
- **Parquet shards**: a folder whose files are ``.parquet`` (besides ``README.md`` and the
  ``datasets`` metadata files), split by their names as ``datasets`` splits them: the hub's
  ``data/{split}-00000-of-00003.parquet``; else a folder named after a split keyword
  (``train/``, ``validation/``, ``dev/``, ``test/`` ...); else a file name with the keyword
  (``train.parquet``, ``wiki-test-0.parquet``); else the folder is one split, read whole.

`find_dataset` tells such a folder from a plain data folder (None) and lists the files of a
split in order; anything inconsistent, a missing split (naming the splits there) or Arrow
files outside these layouts is a one-line `DataError` naming ``--data <folder>``.

Example::

    found = find_dataset(Path("wiki/"), "validation")
    found.kind, found.split      # 'arrow', 'validation'
    found.files                  # [Path('wiki/validation/data-00000-of-00001.arrow')]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardax.errors import DataError
from shardax.filecheck import read_json

__all__ = ["DatasetFiles", "find_dataset"]

DICT_FILE, STATE_FILE, INFO_FILE = "dataset_dict.json", "state.json", "dataset_info.json"
# Files ``datasets`` itself ignores in a data folder (data_files.FILES_TO_IGNORE).
_IGNORED = {"README.md", "config.json", INFO_FILE, "dataset_infos.json", DICT_FILE}
# datasets' split keywords (data_files.SPLIT_KEYWORDS), in the order it tries the splits.
_KEYWORDS = {"train": ("train", "training"),
             "validation": ("validation", "valid", "dev", "val"),
             "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"
_SHARDED = re.compile(r"data/(\w+)-\d{5}-of-\d{5}[^/]*\.parquet")
_IN_DIR = {split: re.compile(rf"(.*{_SEP})?({'|'.join(words)})({_SEP}.*)?")
           for split, words in _KEYWORDS.items()}
_IN_NAME = {split: re.compile(rf"(.*{_SEP})?({'|'.join(words)}){_SEP}.*")
            for split, words in _KEYWORDS.items()}
_MAX_STATE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one split of a dataset folder: ``kind`` is ``arrow`` (save_to_disk) or
    ``parquet``; ``split`` is None for a single save_to_disk ``Dataset`` (read whole)."""

    kind: str
    split: str | None
    files: list[Path]


def _fail(folder: Path, problem: str) -> DataError:
    return DataError(f"--data {folder}: {problem}")


def _json(folder: Path, name: str) -> object:
    try:
        return read_json(folder / name, _MAX_STATE_BYTES)
    except (OSError, ValueError) as e:
        raise _fail(folder, f"not a readable datasets folder: {name}: "
                            f"{str(e).splitlines()[0]}") from None


def _saved_dataset(folder: Path, where: Path) -> list[Path]:
    """The Arrow files of a save_to_disk ``Dataset`` folder, in order (``where``: the
    ``--data`` entry, for errors)."""
    state = _json(folder, STATE_FILE)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [e.get("filename") if isinstance(e, dict) else None for e in entries or []]
    if not names or not all(isinstance(n, str) and n and Path(n).name == n and n != ".."
                            for n in names):
        raise _fail(where, f"{folder / STATE_FILE} has no '_data_files' list of Arrow file "
                           "names; not a datasets save_to_disk folder")
    files = [folder / n for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise _fail(where, f"{folder / STATE_FILE} lists {missing[0]}, which is not in "
                           f"{folder}; the save_to_disk folder is incomplete")
    return files


def _parquet_splits(folder: Path, found: list[Path]) -> dict[str, list[Path]]:
    """Split -> Parquet files (sorted by relative path), named as ``datasets`` names them;
    {} when no file is named for a split."""
    rel = sorted(p.relative_to(folder).as_posix() for p in found)
    sharded: dict[str, list[str]] = {}
    for r in rel:
        if m := _SHARDED.fullmatch(r):
            sharded.setdefault(m.group(1), []).append(r)
    if sharded:
        return {s: [folder / r for r in rs] for s, rs in sharded.items()}
    for patterns, part in ((_IN_DIR, lambda r: r.split("/")[:-1]),
                           (_IN_NAME, lambda r: r.split("/")[-1:])):
        splits: dict[str, list[Path]] = {}
        for r in rel:
            split = next((s for s, pattern in patterns.items()
                          if any(pattern.fullmatch(x) for x in part(r))), None)
            if split is not None:
                splits.setdefault(split, []).append(folder / r)
        if splits:
            return splits
    return {}


def _pick(folder: Path, splits: list[str], split: str) -> None:
    if split not in splits:
        raise _fail(folder, f"no split {split!r} (its splits: {', '.join(splits)}); choose "
                            "one with --data-split (--val-split for --val-data)")


def find_dataset(folder: Path, split: str = "train") -> DatasetFiles | None:
    """The files of ``split`` of the ``datasets`` folder ``folder``; None for a folder in
    neither layout and with no Arrow file (a plain folder of data files).

    Example::

        find_dataset(Path("hub/"), "train").files   # [hub/data/train-00000-of-00002.parquet, ...]
    """
    if (folder / DICT_FILE).is_file():
        info = _json(folder, DICT_FILE)
        splits = info.get("splits") if isinstance(info, dict) else None
        if not (isinstance(splits, list) and splits
                and all(isinstance(s, str) and s and Path(s).name == s != ".." for s in splits)):
            raise _fail(folder, f"{DICT_FILE} has no 'splits' list of split names; not a "
                                "datasets save_to_disk folder")
        _pick(folder, splits, split)
        return DatasetFiles("arrow", split, _saved_dataset(folder / split, folder))
    if (folder / STATE_FILE).is_file():
        return DatasetFiles("arrow", None, _saved_dataset(folder, folder))
    try:
        found = [p for p in folder.rglob("*") if p.is_file() and not any(
            s.startswith(".") for s in p.relative_to(folder).parts)]
    except OSError as e:
        raise _fail(folder, f"cannot list it ({e.strerror})") from None
    arrow = [p for p in found if p.suffix == ".arrow"]
    if arrow or (folder / INFO_FILE).is_file():
        what = f"Arrow files ({arrow[0].relative_to(folder)})" if arrow else INFO_FILE
        raise _fail(folder, f"{what} but no {STATE_FILE} or {DICT_FILE}: neither a datasets "
                            "save_to_disk folder nor a folder of Parquet shards; give the "
                            "folder save_to_disk wrote (or its split's folder)")
    data = [p for p in found if p.name not in _IGNORED]
    if not data or any(p.suffix != ".parquet" for p in data):
        return None
    splits = _parquet_splits(folder, data)
    order = list(_KEYWORDS)
    names = sorted(splits, key=lambda s: (order.index(s) if s in order else len(order), s))
    if not splits:  # no file named for a split: one split (datasets calls it train), whole
        return DatasetFiles("parquet", None, sorted(data, key=lambda p: p.relative_to(folder)
                                                    .as_posix()))
    _pick(folder, names, split)
    return DatasetFiles("parquet", split, splits[split])
