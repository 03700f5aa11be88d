"""Safetensors files read by byte ranges and written tensor by tensor.

Reading parses the JSON header and ``os.pread``s only the requested slice (one read per
contiguous run), so a process touches just the bytes its devices own and every read is
logged; writing streams one tensor at a time after a header computed from shapes alone.
Both handle bfloat16 (through ``ml_dtypes``), which safetensors' NumPy API does not.

Example::

    f = SafetensorsFile('model.safetensors')
    block = f.read('model.embed_tokens.weight', [(0, 128), (0, 64)])   # rows 0..127
    write_safetensors('out.safetensors', {'w': (np.float32, (4, 4))}, lambda name: w)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from shardax.filecheck import open_regular, read_json
from shardax.filewrite import replacing

__all__ = ["ReadLog", "SafetensorsFile", "contained_path", "dtype_code", "tensor_index",
           "write_safetensors"]

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
# The safetensors package's own limit on a header.
MAX_HEADER_BYTES = 100_000_000


def dtype_code(dtype: object) -> str:
    """The safetensors dtype code of a NumPy/JAX dtype (``'F32'``, ``'BF16'``, ...)."""
    dt = np.dtype(dtype)
    if dt not in _CODES:
        raise ValueError(f"dtype {dt} has no safetensors code")
    return _CODES[dt]


@dataclasses.dataclass
class ReadLog:
    """Every read of this process: ``(file name, tensor, [(start, stop) per dim], bytes)``."""

    reads: list[tuple[str, str, tuple[tuple[int, int], ...], int]] = dataclasses.field(
        default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r[3] for r in self.reads)


class SafetensorsFile:
    """Header of one ``.safetensors`` file; :meth:`read` fetches slices of its tensors."""

    def __init__(self, path: str | os.PathLike, log: ReadLog | None = None):
        self.path = Path(path)
        self.log = log
        fd = open_regular(self.path)  # never a FIFO or device: see shardax.filecheck
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, 8, 0)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_HEADER_BYTES, size - 8):  # checked before anything is allocated
                raise ValueError(f"{self.path}: damaged safetensors header: its length field "
                                 f"says {n} bytes, the file holds {size} bytes (at most "
                                 f"{MAX_HEADER_BYTES} are allowed)")
            text = os.pread(fd, n, 8)
        finally:
            os.close(fd)
        try:
            header = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{self.path}: damaged safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: damaged safetensors header (a JSON "
                             f"{type(header).__name__}, expected an object)")
        metadata = header.pop("__metadata__", None) or {}
        self.metadata = metadata if isinstance(metadata, dict) else {}
        _check_header(self.path, header, size - 8 - n)
        self.tensors: dict[str, dict] = header
        self._data_start = 8 + n

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.tensors[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def read(self, name: str, ranges: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """The block ``[start:stop]`` per dim of tensor ``name`` (whole tensor by default)."""
        shape, dtype = self.shape(name), self.dtype(name)
        ranges = [(0, d) for d in shape] if ranges is None else [tuple(r) for r in ranges]
        if len(ranges) != len(shape) or any(
                not 0 <= a <= b <= d for (a, b), d in zip(ranges, shape)):
            raise ValueError(f"{self.path}: slice {ranges} out of bounds for {name!r} {shape}")
        out = np.empty([b - a for a, b in ranges], dtype)
        base = self._data_start + self.tensors[name]["data_offsets"][0]
        strides = [dtype.itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
        # Trailing dims read whole fold into one contiguous run per leading index.
        k = len(shape)
        while k > 0 and ranges[k - 1] == (0, shape[k - 1]):
            k -= 1
        if out.size:
            flat = out.reshape(-1)
            if k == 0:
                runs = [((), 0)]
                run_len = flat.size
            else:
                a, b = ranges[k - 1]
                run_len = (b - a) * math.prod(shape[k:])
                runs = [(idx, a) for idx in itertools.product(*(range(*r) for r in ranges[:k - 1]))]
            fd = open_regular(self.path)
            try:
                for i, (idx, start) in enumerate(runs):
                    offset = base + sum(j * s for j, s in zip(idx, strides)) + (
                        start * strides[k - 1] if k else 0)
                    data = os.pread(fd, run_len * dtype.itemsize, offset)
                    if len(data) != run_len * dtype.itemsize:
                        raise ValueError(f"{self.path}: truncated data for tensor {name!r}")
                    flat[i * run_len:(i + 1) * run_len] = np.frombuffer(data, dtype)
            finally:
                os.close(fd)
        if self.log is not None:
            self.log.reads.append((self.path.name, name, tuple(ranges), out.nbytes))
        return out


def write_safetensors(path: str | os.PathLike, specs: Mapping[str, tuple[object, Sequence[int]]],
                      fetch: Callable[[str], np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Writes ``{name: (dtype, shape)}`` to ``path``, calling ``fetch(name)`` for each tensor in
    turn (only one tensor is held at a time). Returns the bytes written."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (dtype, shape) in specs.items():
        n = np.dtype(dtype).itemsize * math.prod(shape)
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with replacing(path) as tmp, open(tmp, "wb") as f:  # a symlink at path is replaced
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (dtype, shape) in specs.items():
            x = np.ascontiguousarray(fetch(name))
            if x.dtype != np.dtype(dtype) or x.shape != tuple(shape):
                raise ValueError(f"tensor {name!r}: got {x.dtype}{x.shape}, expected "
                                 f"{np.dtype(dtype)}{tuple(shape)}")
            f.write(x.tobytes())
    return 8 + len(raw) + offset


def tensor_index(directory: str | os.PathLike, log: ReadLog | None = None,
                 ) -> dict[str, SafetensorsFile]:
    """``{tensor name: file}`` over a model directory's ``*.safetensors`` (through
    ``model.safetensors.index.json`` when present), every header checked (`SafetensorsFile`).

    Raises ``ValueError`` naming the file for a damaged index, a file outside the directory
    (an absolute or ``..`` path, or a symlink leaving it: only the Hugging Face hub cache's
    snapshot -> blob links may), a file that is not a regular one, or a tensor held twice."""
    d = Path(directory)
    index = d / INDEX_NAME
    if index.exists() or index.is_symlink():
        weight_map = _weight_map(contained_path(d, INDEX_NAME, None))
        files = {f: SafetensorsFile(contained_path(d, f, index), log)
                 for f in sorted(set(weight_map.values()))}
        for name, f in weight_map.items():
            if name not in files[f].tensors:
                raise ValueError(f"{index}: weight_map puts tensor {name!r} in {f}, whose header "
                                 "does not hold it")
        return {name: files[f] for name, f in weight_map.items()}
    out: dict[str, SafetensorsFile] = {}
    for p in sorted(d.glob("*.safetensors")):
        f = SafetensorsFile(contained_path(d, p.name, None), log)
        for name in f.tensors:
            if name in out:
                raise ValueError(f"{d}: tensor {name!r} is in both {out[name].path.name} and "
                                 f"{p.name} (a stale file of an earlier export?)")
            out[name] = f
    if not out:
        raise ValueError(f"{d}: no *.safetensors files (PyTorch .bin checkpoints are not read; "
                         "convert them with transformers' save_pretrained(safe_serialization)")
    return out


def _check_header(path: Path, header: dict, data_bytes: int) -> None:
    """Every tensor entry well formed, its byte span that of its dtype and shape, inside the
    file's ``data_bytes``, and overlapping no other tensor's (as the safetensors package
    requires), so that no read goes past the file or takes one tensor's bytes for another."""
    spans = []
    for name, entry in header.items():
        where = f"{path}: damaged safetensors header: tensor {name!r}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is a JSON {type(entry).__name__}, expected an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(code, str) or code not in _DTYPES:
            raise ValueError(f"{where} has unsupported dtype {code!r} (known: {list(_DTYPES)})")
        if not isinstance(shape, list) or not all(_count(n) for n in shape):
            raise ValueError(f"{where} has shape {shape!r}, expected a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))
                and offsets[0] <= offsets[1]):
            raise ValueError(f"{where} has data_offsets {offsets!r}, expected [begin, end]")
        want = _DTYPES[code].itemsize * math.prod(shape)
        begin, end = offsets
        if end - begin != want:
            raise ValueError(f"{where}: {code}{shape} takes {want} bytes but its data_offsets "
                             f"{offsets} span {end - begin} (the dtype or shape disagrees with "
                             "the data)")
        if end > data_bytes:
            raise ValueError(f"{where}: data_offsets {offsets} end past the data in the file "
                             f"({data_bytes} bytes; the file is truncated or the header lies)")
        if want:
            spans.append((begin, end, name))
    spans.sort()
    for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:]):
        if begin1 < end0:
            raise ValueError(f"{path}: damaged safetensors header: tensors {name0!r} and "
                             f"{name1!r} overlap (bytes {begin1}..{end0})")


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def contained_path(d: Path, name: object, index: Path | None = None) -> Path:
    """``d / name``, refused unless it stays in ``d`` (a symlink may lead only from a hub cache
    snapshot to its blobs: ``models--org--name/snapshots/REV/f -> ../../blobs/SHA``);
    ``index``: the index file that named it, for the message.

    >>> contained_path(Path("model"), "model.safetensors")
    PosixPath('model/model.safetensors')
    """
    where = f"{index}: weight_map names {name!r}, which" if index else f"{d / str(name)}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} is not a file name")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{where} is outside the model directory {d}")
    path = d / rel
    root, real = d.resolve(), path.resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (real.is_relative_to(root) or (hub_blobs and real.parent == hub_blobs)):
        raise ValueError(f"{where} is a symlink to {real}, outside the model directory {d}")
    return path


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, checked to be
    ``{tensor: file name}``."""
    value = read_json(index)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        got = ("no 'weight_map'" if weight_map is None else
               f"'weight_map' is a JSON {type(weight_map).__name__}" if weight_map != {} else
               "'weight_map' is empty")
        raise ValueError(f"{index}: {got}; expected {{tensor name: file name}}")
    for name, f in weight_map.items():
        if not isinstance(f, str):
            raise ValueError(f"{index}: weight_map[{name!r}] is {f!r}, expected a file name")
    return weight_map
