"""Hugging Face model directory -> shardax NNX model, created directly in its sharded layout.

Every parameter is built with ``jax.make_array_from_callback``: for each device of this process
the callback reads just that device's slice from the safetensors files (``files.py``), once
per distinct slice, so a process reads only what its devices own, host memory stays near one
tensor's slices, and nothing is gathered on one device.

Example::

    mesh = MeshShardingHelper.from_string('fsdp=4,tp=2')
    model = load_model('Llama-3.2-1B', mesh)           # rules: the fsdp_tp preset
    logits = jax.jit(lambda m, t: m(t))(model, tokens)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardax import layout, models
from shardax._compat import make_mesh
from shardax.hf.checks import check_tensors, read_config_json
from shardax.hf.configs import config_from_hf
from shardax.hf.files import ReadLog, SafetensorsFile, tensor_index
from shardax.hf.mapping import TensorMap, iter_maps, param_maps, read_block, stack_depth
from shardax.models.configs import GPT2Config, LlamaConfig, check_overrides
from shardax.rules import LogicalAxisRules, match_specs
from shardax.utils import tree_path_to_string

__all__ = ["default_rules", "load_config", "load_model", "load_params"]


def load_config(directory: str | os.PathLike, *, weights: bool = True,
                **overrides: Any) -> LlamaConfig | GPT2Config:
    """The shardax config of the model in ``directory`` (its ``config.json``), checked against
    the tensors its safetensors headers hold (`shardax.hf.checks`) before anything is built;
    ``weights=False``: from ``config.json`` alone (shapes for planning; no weights needed).

    Example::

        cfg = load_config('Llama-3.2-1B', dtype=jnp.bfloat16)
    """
    check_overrides("load_config", overrides)
    hf = read_config_json(directory)  # sizes, types and the file itself checked
    try:
        config = config_from_hf(hf, **overrides)
    except KeyError as e:
        raise ValueError(f"{Path(directory) / 'config.json'}: missing key {e}") from None
    except (TypeError, ArithmeticError) as e:
        raise ValueError(f"{Path(directory) / 'config.json'}: a value of the wrong type or "
                         f"size ({e})") from None
    if weights:
        check_tensors(config, tensor_index(directory), directory)
    return config


def default_rules(config: LlamaConfig | GPT2Config, mesh: jax.sharding.Mesh) -> LogicalAxisRules:
    """The ``fsdp_tp`` preset fitted to ``mesh`` and the model's head counts."""
    heads = config.n_heads
    kv = getattr(config, "n_kv_heads", heads)
    return LogicalAxisRules(layout.presets.resolve(layout.PRESETS["fsdp_tp"], dict(mesh.shape),
                                                   heads=heads, kv_heads=kv))


def _as_mesh(mesh: Any) -> jax.sharding.Mesh:
    if mesh is None:
        return make_mesh(np.array(jax.devices()[:1]), ("dp",))
    return getattr(mesh, "mesh", mesh)


def _key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def load_params(directory: str | os.PathLike, config: LlamaConfig | GPT2Config, mesh: Any = None,
                rules: Any = None, *, read_log: ReadLog | None = None) -> tuple[Any, Any]:
    """``(graphdef, state)`` of ``models.create(config)`` with every
    parameter read from ``directory`` straight into its sharding under ``rules`` on ``mesh``
    (default: one device). Raises ``ValueError`` naming the tensor that is missing or
    mis-shaped.

    Example::

        graphdef, state = load_params('llama', load_config('llama'), mesh, rules)
        model = nnx.merge(graphdef, state)
    """
    mesh = _as_mesh(mesh)
    rules = default_rules(config, mesh) if rules is None else rules
    if not isinstance(rules, LogicalAxisRules) and not hasattr(rules, "apply"):
        rules = LogicalAxisRules(rules)
    abstract = nnx.eval_shape(lambda: models.create(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    specs = jax.tree.leaves(match_specs(rules, state, mesh),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    maps = param_maps(config)
    index = tensor_index(directory, read_log)
    out = []
    for (path, leaf), spec in zip(leaves, specs):
        name = tree_path_to_string(path, sep="/").removesuffix("/value")
        if name not in maps:
            raise ValueError(f"shardax parameter {name!r} has no Hugging Face tensor")
        out.append(_build(name, maps[name], leaf, NamedSharding(mesh, spec), index))
    return graphdef, jax.tree_util.tree_unflatten(treedef, out)


def load_model(directory: str | os.PathLike, mesh: Any = None, rules: Any = None, *,
               read_log: ReadLog | None = None, **overrides: Any) -> nnx.Module:
    """The model in ``directory``, sharded on ``mesh`` by ``rules`` (see :func:`load_params`);
    ``overrides`` replace config fields (``dtype=jnp.bfloat16``, ...).

    Example::

        model = load_model('gpt2', mesh)
    """
    config = load_config(directory, **overrides)
    graphdef, state = load_params(directory, config, mesh, rules, read_log=read_log)
    return nnx.merge(graphdef, state)


def _check(m: TensorMap, index: dict[str, SafetensorsFile], want: tuple[int, ...]) -> None:
    f = index.get(m.name)
    if f is None:
        raise ValueError(f"Hugging Face tensor {m.name!r} is missing from the checkpoint")
    shape = f.shape(m.name)
    if shape != m.hf_shape:
        raise ValueError(f"Hugging Face tensor {m.name!r} in {f.path.name} has shape {shape}, "
                         f"config.json implies {m.hf_shape}")
    if m.shape() != want:
        raise ValueError(f"Hugging Face tensor {m.name!r} maps to {m.shape()}, shardax "
                         f"expects {want}")


def _build(name: str, m: TensorMap | list, leaf: Any, sharding: NamedSharding,
           index: dict[str, SafetensorsFile]) -> jax.Array:
    shape, dtype = tuple(leaf.shape), leaf.dtype
    depth = stack_depth(m)  # leading axes stacked from several HF tensors (layers, experts)
    for _, one in iter_maps(m):
        _check(one, index, shape[depth:])
    cache: dict[tuple, np.ndarray] = {}  # replicated slices are read once

    def read(m: TensorMap | list, sl: tuple) -> np.ndarray:
        if isinstance(m, TensorMap):
            f = index[m.name]
            return read_block(m, sl, lambda ranges: f.read(m.name, ranges)).astype(dtype)
        return np.stack([read(m[i], sl[1:]) for i in range(*sl[0].indices(len(m))[:2])])

    def callback(idx: tuple) -> np.ndarray:
        key = _key(idx, shape)
        if key not in cache:
            cache[key] = read(m, idx)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, callback)
