"""Mixture-of-experts balance after each train step: DeepSeek-V3's auxiliary-loss-free bias
update and the expert load metrics.

The bias update (DeepSeek-V3, section 2.1.2) runs outside the gradient, after the optimizer
step: each layer's router bias moves by ``rate * sign(mean_load - load_e)``, ``load_e`` the
top-k assignments of the step's batch (all microbatches) to expert ``e`` in that layer, and
the mean over its experts. The bias only picks experts (`shardax.models.moe.route`), so an
overloaded expert is picked less often without any loss term.

Example::

    rest = update_router_bias(graphdef, state.params, rest, load.expert_tokens, config)
    metrics |= load_metrics(load, config)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models.lora import trainable
from shardax.models.protocol import MoEStats

__all__ = ["bias_step", "load_metrics", "load_record", "update_router_bias"]


def bias_step(expert_tokens: jax.Array, rate: float) -> jax.Array:
    """The bias change ``rate * sign(mean - load)`` for each layer's load [layers, experts].

    >>> bias_step(jnp.array([[1.0, 3.0, 2.0, 2.0]]), 0.001).tolist()
    [[0.0010000000474974513, -0.0010000000474974513, 0.0, 0.0]]
    """
    mean = jnp.mean(expert_tokens, axis=-1, keepdims=True)
    return (rate * jnp.sign(mean - expert_tokens)).astype(jnp.float32)


def update_router_bias(graphdef: Any, params: Any, rest: Any, expert_tokens: jax.Array,
                       config: Any) -> Any:
    """``rest`` (the model's non-trained state) with every layer's `RouterBias` moved by
    `bias_step` of its row of ``expert_tokens`` [n_layers, n_experts] at
    ``config.router_bias_update``; ``rest`` itself when that rate is 0."""
    if not getattr(config, "router_bias_update", 0):
        return rest
    model = nnx.merge(graphdef, params, rest)
    step = bias_step(expert_tokens, config.router_bias_update)
    if model.stacked:
        bias = model.layers.mlp.router_bias
        bias[...] = bias[...] + step
    else:
        for i, layer in enumerate(model.layers):
            if not config.is_dense(i):  # first_k_dense layers have no router
                layer.mlp.router_bias[...] = layer.mlp.router_bias[...] + step[i]
    return nnx.split(model, trainable(config), ...)[2]


def load_metrics(load: MoEStats | None, config: Any) -> dict[str, jax.Array]:
    """The step's expert load metrics of a mixture of experts (empty without one or without
    ``load``): ``moe/expert_tokens`` [n_experts], the top-k assignments summed over layers;
    ``moe/load_max_over_mean``, each layer's busiest expert's load over the mean, averaged
    over layers (1 when balanced); and with capacity routing ``moe/dropped_fraction``."""
    if load is None or not getattr(config, "n_experts", 0):
        return {}
    tokens = load.expert_tokens
    ratio = jnp.max(tokens, axis=-1) / jnp.maximum(jnp.mean(tokens, axis=-1), 1e-9)
    out = {"moe/expert_tokens": jnp.sum(tokens, axis=0),
           "moe/load_max_over_mean": jnp.mean(ratio)}
    if config.moe_impl == "capacity":
        out["moe/dropped_fraction"] = load.dropped_fraction
    return out


def load_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``moe/...`` entries of a step's metrics as JSON values for ``metrics.jsonl``
    (``moe/expert_tokens`` a list of ints, the others floats)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key.startswith("moe/"):
            value = jax.device_get(value)
            out[key] = ([int(v) for v in value.tolist()] if getattr(value, "ndim", 0)
                        else float(value))
    return out
