"""shardax parameters -> a Hugging Face model directory (``config.json`` + safetensors) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Tensors are grouped into files of at most ``max_shard_bytes`` (``model.safetensors`` alone, or
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``). Each file is
written by one process (file ``k`` by process ``k % process_count``), tensor by tensor: a HF
tensor is assembled from its shardax parameter(s) with one per-tensor gather (an all-gather
across processes when the array spans several), written, and dropped, so no host ever holds
more than one tensor of the model.

Example::

    save_model(model, 'export/llama')          # or save_params(config, state, 'export/llama')
    AutoModelForCausalLM.from_pretrained('export/llama')
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from shardax.filewrite import check_target_dir, write_text
from shardax.hf.configs import config_to_hf
from shardax.hf.files import INDEX_NAME, write_safetensors
from shardax.hf.mapping import TensorMap, iter_maps, param_maps, to_hf
from shardax.models.configs import GPT2Config, LlamaConfig
from shardax.models.moe import RouterBias
from shardax.utils import tree_path_to_string

__all__ = ["EXPORTED", "save_model", "save_params", "sync_processes", "to_host"]

#: The model state a Hugging Face checkpoint holds: the parameters and the routers'
#: balancing biases (DeepSeek-V3's ``e_score_correction_bias``).
EXPORTED = nnx.Any(nnx.Param, RouterBias)

DEFAULT_SHARD_BYTES = 2 * 1024**3
# The weights files an export writes (see `_plan`).
_WEIGHTS = re.compile(r"model(?:-\d{5}-of-\d{5})?\.safetensors")


def to_host(x: jax.Array) -> np.ndarray:
    """One array on this host: a per-tensor gather (all-gather across processes if needed)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_params(config: LlamaConfig | GPT2Config, params: Any, directory: str | os.PathLike,
                *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: Any = None,
                config_extra: Mapping[str, Any] | None = None) -> list[Path]:
    """Writes ``params`` (the model's ``nnx.State``, or a ``{path: array}`` dict with '/'-joined
    paths) as a Hugging Face directory.
    ``dtype`` casts the tensors (default: as stored);
    ``config_extra``: more ``config.json`` entries (e.g. the tokenizer's ``eos_token_id``).
    Returns the safetensors files this process wrote.

    Example::

        save_params(model.config, nnx.state(model, nnx.Param), 'export/llama',
                    max_shard_bytes=500 * 2**20)
    """
    flat = _flat(params)
    maps = param_maps(config)
    missing = sorted(set(maps) - set(flat))
    if missing:
        raise ValueError(f"parameters {missing[:3]} are missing: is this state of the model "
                         f"{type(config).__name__}(...)? ")
    # HF tensor name -> [(shardax path, index on its stacked axes, map)], in a stable order.
    sources: dict[str, list[tuple[str, tuple[int, ...], TensorMap]]] = {}
    for path, m in maps.items():
        for index, one in iter_maps(m):
            sources.setdefault(one.name, []).append((path, index, one))
    first = next(iter(flat.values()))
    out_dtype = np.dtype(dtype if dtype is not None else first.dtype)
    specs = {name: (out_dtype, src[0][2].hf_shape) for name, src in sources.items()}
    files = _plan(specs, max_shard_bytes)

    def fetch(name: str) -> np.ndarray:
        src = sources[name]
        out = np.empty(src[0][2].hf_shape, out_dtype)
        for path, index, m in src:
            x = flat[path][index] if index else flat[path]
            to_hf(m, to_host(x).astype(out_dtype), out)
        return out

    d = Path(directory)
    check_target_dir(d, "export directory")  # on every process: all of them stop
    if jax.process_index() == 0:
        d.mkdir(parents=True, exist_ok=True)
        _remove_stale(d, set(files))
        hf_config = {**config_to_hf(config), "torch_dtype": out_dtype.name,
                     **(config_extra or {})}
        write_text(d / "config.json", json.dumps(hf_config, indent=2) + "\n")
        if len(files) > 1:
            weight_map = {n: f for f, names in files.items() for n in names}
            total = sum(out_dtype.itemsize * math.prod(s) for _, s in specs.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_text(d / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    sync_processes("shardax-hf-export-dir")
    written = []
    for k, (fname, names) in enumerate(files.items()):
        mine = k % jax.process_count() == jax.process_index()
        if mine:
            write_safetensors(d / fname, {n: specs[n] for n in names}, fetch)
            written.append(d / fname)
        else:  # take part in the gathers of arrays that span processes
            for n in names:
                for path, index, _ in sources[n]:
                    x = flat[path]
                    if not x.is_fully_addressable:
                        to_host(x[index] if index else x)
    sync_processes("shardax-hf-export-done")
    return written


def save_model(model: nnx.Module, directory: str | os.PathLike, **kwargs: Any) -> list[Path]:
    """Writes ``model`` (a shardax Llama or GPT-2) as a Hugging Face directory; see
    :func:`save_params`."""
    return save_params(model.config, nnx.state(model, EXPORTED), directory, **kwargs)


def _flat(params: Any) -> dict[str, Any]:
    if isinstance(params, Mapping) and all(isinstance(k, str) for k in params) and all(
            isinstance(v, jax.Array | np.ndarray) for v in params.values()):
        return {k.removesuffix("/value"): v for k, v in params.items()}
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return {tree_path_to_string(p, sep="/").removesuffix("/value"): x for p, x in leaves}


def _plan(specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
          max_bytes: int) -> dict[str, list[str]]:
    """Tensors grouped, in order, into files of at most ``max_bytes`` (a larger tensor gets a
    file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, (dt, shape) in specs.items():
        n = dt.itemsize * math.prod(shape)
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    total = len(groups)
    return {f"model-{k + 1:05d}-of-{total:05d}.safetensors": g for k, g in enumerate(groups)}


def _remove_stale(d: Path, keep: set[str]) -> None:
    """Removes the weights of an earlier export to ``d`` that this one does not overwrite (its
    other shards, its index): left in place they would be loaded with, or instead of, the new
    ones. Only files named as exports name them are touched."""
    for p in d.iterdir():
        if p.name not in keep and (p.name == INDEX_NAME or _WEIGHTS.fullmatch(p.name)):
            p.unlink()


def sync_processes(name: str) -> None:
    """Every process of a multi-process job waits here for the others (a no-op alone)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
