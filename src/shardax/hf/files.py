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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["ReadLog", "SafetensorsFile", "dtype_code", "write_safetensors"]

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}


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
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: damaged safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
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
            with open(self.path, "rb") as f:
                fd = f.fileno()
                for i, (idx, start) in enumerate(runs):
                    offset = base + sum(j * s for j, s in zip(idx, strides)) + (
                        start * strides[k - 1] if k else 0)
                    data = os.pread(fd, run_len * dtype.itemsize, offset)
                    if len(data) != run_len * dtype.itemsize:
                        raise ValueError(f"{self.path}: truncated data for tensor {name!r}")
                    flat[i * run_len:(i + 1) * run_len] = np.frombuffer(data, dtype)
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
    with open(path, "wb") as f:
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
    ``model.safetensors.index.json`` when present)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: SafetensorsFile(d / f, log) for f in sorted(set(weight_map.values()))}
        return {name: files[f] for name, f in weight_map.items()}
    paths: Iterable[Path] = sorted(d.glob("*.safetensors"))
    out: dict[str, SafetensorsFile] = {}
    for p in paths:
        f = SafetensorsFile(p, log)
        out.update({name: f for name in f.tensors})
    if not out:
        raise ValueError(f"{d}: no *.safetensors files (PyTorch .bin checkpoints are not read; "
                         "convert them with transformers' save_pretrained(safe_serialization)")
    return out
