"""A Hugging Face model directory checked before anything is built from it: ``config.json``'s
values, and the tensors its safetensors headers hold against those the config implies.

Everything here reads only ``config.json`` and the headers (`shardax.hf.files` checks each
header's offsets against its file), so a directory whose config claims 10**7 layers or a
10**9-token vocabulary over a small file is refused before any array is shaped or allocated.
Errors are one-line ValueErrors naming the file and the key or tensor.

Example::

    hf = read_config_json('llama')                     # a dict, sizes checked
    check_tensors(config_from_hf(hf), tensor_index('llama'), 'llama')
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardax.filecheck import read_json
from shardax.hf.files import SafetensorsFile, contained_path
from shardax.hf.mapping import TensorMap, param_maps

__all__ = ["check_tensors", "read_config_json"]

# config.json keys that must be positive integers where present (null allowed for the second;
# sliding_window may also be 0: Qwen2-MoE writes it so with use_sliding_window false).
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "intermediate_size", "n_embd", "n_layer", "n_head")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "n_inner",
                   "n_positions", "sliding_window")
_ZERO_ALLOWED = ("sliding_window",)
# The layer number in a tensor name: 'model.layers.3.mlp...' (Llama family), 'transformer.h.3.'.
_LAYER = re.compile(r"^(?:model\.layers|transformer\.h)\.(\d+)\.")
# Buffers some checkpoints hold that are not weights (transformers ignores them on load too):
# old Llama rotary inverse frequencies, GPT-2's causal-mask buffers.
_BUFFERS = re.compile(r"(?:^|\.)rotary_emb\.inv_freq$|\.attn\.(?:bias|masked_bias)$")


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a model directory as a dict: a regular file of bounded size,
    UTF-8 JSON holding an object whose size keys (``hidden_size``, ``num_attention_heads``,
    ...) are positive integers.

    Example::

        read_config_json('llama')['hidden_size']     # 2048
    """
    path = Path(directory) / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    path = contained_path(Path(directory), "config.json")  # a symlink may not lead out
    hf = read_json(path)  # bounded size and nesting, strict UTF-8: see shardax.filecheck
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: a JSON {type(hf).__name__}, expected an object such as "
                         '{"model_type": "llama", ...}')
    for key in (*_SIZES, *_OPTIONAL_SIZES):
        value = hf.get(key)
        least = 0 if key in _ZERO_ALLOWED else 1
        if key in hf and not (value is None and key in _OPTIONAL_SIZES) and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ValueError(f"{path}: {key}={value!r} must be a "
                             + ("non-negative" if least == 0 else "positive") + " integer")
    return hf


def check_tensors(config: Any, index: Mapping[str, SafetensorsFile],
                  directory: str | os.PathLike) -> None:
    """Raises ``ValueError`` unless the checkpoint ``index`` (`tensor_index`) holds exactly the
    tensors ``config`` implies, with their shapes: a missing tensor and an unexpected one
    (e.g. a fifth layer when ``config.json`` says 4) are named. Unexpected tensors are an
    error, not a warning: they mean ``config.json`` and the weights disagree, so the model
    built would not be the one in the directory. Layer counts are compared first, from the
    tensor names, so a config claiming millions of layers costs nothing."""
    n_layers = config.n_layers
    layers: dict[int, str] = {}
    for name in index:
        if m := _LAYER.match(name):
            layers.setdefault(int(m.group(1)), name)
    extra = sorted(i for i in layers if i >= n_layers)
    if extra:
        raise ValueError(f"{directory}: unexpected tensor {layers[extra[0]]!r}: config.json "
                         f"says {n_layers} layers, the weights hold "
                         f"{len(layers)} (layers {extra[0]}..{extra[-1]} would be dropped)")
    if len(layers) < n_layers:
        gap = next(i for i in range(len(layers) + 1) if i not in layers)
        short = {"n_layers": gap + 1}  # bounded, as above
        if getattr(config, "first_k_dense", 0):
            short["first_k_dense"] = min(config.first_k_dense, gap + 1)
        probe = param_maps(dataclasses.replace(config, **short))
        name = next(one.name for one in _leaves(probe)
                    if (hit := _LAYER.match(one.name)) and int(hit.group(1)) == gap)
        raise ValueError(f"{directory}: Hugging Face tensor {name!r} is missing from the "
                         f"checkpoint: config.json says {n_layers} layers, the weights hold "
                         f"{len(layers)}")
    maps = param_maps(config)  # now bounded by the number of tensors in the headers
    expected = {one.name: one for one in _leaves(maps)}
    missing = [name for name in expected if name not in index]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{directory}: Hugging Face tensor {missing[0]!r}{more} is missing from "
                         "the checkpoint")
    tied = getattr(config, "tie_embeddings", True)
    unexpected = [name for name in index if name not in expected and not _BUFFERS.search(name)
                  and not (tied and name == "lm_head.weight")]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{directory}: unexpected tensor {unexpected[0]!r}{more} in "
                         f"{index[unexpected[0]].path.name}: config.json implies no such "
                         "weight (is it the config of these weights?)")
    for name, m in expected.items():
        shape = index[name].shape(name)
        if shape != m.hf_shape:
            raise ValueError(f"{directory}: Hugging Face tensor {name!r} in "
                             f"{index[name].path.name} has shape {shape}, config.json implies "
                             f"{m.hf_shape}")


def _leaves(maps: Any) -> Iterator[TensorMap]:
    """The TensorMaps of `param_maps`, whose values are maps or (nested) lists of them."""
    for m in maps.values() if isinstance(maps, Mapping) else maps:
        if isinstance(m, TensorMap):
            yield m
        else:
            yield from _leaves(m)
