"""The one-device math of a capacity-based mixture of experts: top-k routing into fixed expert
slots, the experts' MLPs, and the load-balancing statistics. `shardax.parallel.expert.moe_mlp`
runs it expert-parallel over a mesh axis; `capacity_moe` is the plain one-device call that
models use (the layout swaps in ``moe_mlp``).

>>> import jax.numpy as jnp
>>> y, aux = capacity_moe(jnp.ones((2, 4, 8)), jnp.zeros((8, 4)), jnp.ones((4, 8, 16)),
...                       jnp.ones((4, 16, 8)), top_k=2)
>>> y.shape
(2, 4, 8)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["capacity_moe", "expert_capacity", "experts", "finish_aux", "moe_groups", "route"]


def expert_capacity(
    tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float
) -> int:
    """Slots per expert and group: ``ceil(capacity_factor * tokens_per_group * top_k / E)``.

    >>> expert_capacity(64, num_experts=8, top_k=2, capacity_factor=1.25)
    20
    """
    return max(1, math.ceil(capacity_factor * tokens_per_group * top_k / num_experts))


def route(logits: Array, top_k: int, capacity: int):
    """Top-k routing of one group. logits [S, E] -> dispatch/combine [S, E, C] and statistics."""
    num_tokens, num_experts = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)  # [S, K]
    if top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    # Choice-major order: every token's 1st choice claims a slot before any 2nd choice does.
    choice = jax.nn.one_hot(experts.T, num_experts, dtype=jnp.int32)  # [K, S, E]
    position = jnp.cumsum(choice.reshape(top_k * num_tokens, num_experts), axis=0)
    position = position.reshape(top_k, num_tokens, num_experts) - 1
    kept = choice * (position < capacity)
    # Index `capacity` is out of range for one_hot, so dropped or unchosen entries become zero.
    slot = jax.nn.one_hot(jnp.where(kept > 0, position, capacity), capacity, dtype=logits.dtype)
    dispatch = jnp.sum(slot, axis=0)  # [S, E, C]
    combine = jnp.einsum("ksec,ks->sec", slot, gates.T)
    stats = {
        "assigned": jnp.sum(choice, axis=(0, 1)),  # [E] before dropping
        "prob": jnp.sum(probs, axis=0),  # [E]
        "kept": jnp.sum(kept),
        "z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
    }
    return dispatch, combine, stats


def experts(xe: Array, w_in: Array, w_gate: Array | None, w_out: Array, activation) -> Array:
    """Per-expert MLP on xe [E, N, d] (SwiGLU-style when w_gate is given)."""
    h = jnp.einsum("end,edh->enh", xe, w_in)
    if w_gate is None:
        h = activation(h)
    else:
        h = activation(jnp.einsum("end,edh->enh", xe, w_gate)) * h
    return jnp.einsum("enh,ehd->end", h, w_out)


def moe_groups(xg, router_w, w_in, w_gate, w_out, *, top_k, capacity, activation, exchange):
    """MoE on local groups xg [g, S, d]; `exchange` moves expert buffers to and from owners."""
    num_groups, _, d = xg.shape
    num_experts = router_w.shape[1]
    logits = jnp.einsum("gsd,de->gse", xg.astype(jnp.float32), router_w.astype(jnp.float32))
    dispatch, combine, stats = jax.vmap(partial(route, top_k=top_k, capacity=capacity))(logits)
    xe = jnp.einsum("gsec,gsd->egcd", dispatch.astype(xg.dtype), xg)
    xe = xe.reshape(num_experts, num_groups * capacity, d)  # [E, g*C, d], group-major slots
    out = exchange[1](experts(exchange[0](xe), w_in, w_gate, w_out, activation))
    out = out.reshape(num_experts, num_groups, capacity, d)
    y = jnp.einsum("gsec,egcd->gsd", combine.astype(out.dtype), out)
    return y, jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)


def finish_aux(stats, num_tokens: int, top_k: int) -> dict[str, Array]:
    num_experts = stats["assigned"].shape[0]
    fraction = stats["assigned"].astype(jnp.float32) / (num_tokens * top_k)
    mean_prob = stats["prob"] / num_tokens
    return {
        "load_balancing_loss": num_experts * jnp.sum(fraction * mean_prob),
        "router_z_loss": stats["z"] / num_tokens,
        "dropped_fraction": 1.0 - stats["kept"].astype(jnp.float32) / (num_tokens * top_k),
        "expert_fraction": fraction,
    }


def capacity_moe(x: Array, router_w: Array, w_in: Array, w_out: Array,
                 w_gate: Array | None = None, *, top_k: int = 2, capacity_factor: float = 1.25,
                 num_groups: int = 1, activation: Callable[[Array], Array] = jax.nn.silu
                 ) -> tuple[Array, dict[str, Array]]:
    """``moe_mlp`` on one device (`shardax.parallel.expert.moe_mlp` without an expert axis):
    ``(y, aux)`` for tokens ``x [..., d]`` routed in ``num_groups`` groups."""
    d = x.shape[-1]
    num_tokens = math.prod(x.shape[:-1])
    if num_tokens % num_groups:
        raise ValueError(f"capacity_moe: {num_tokens} tokens (x {tuple(x.shape)}) are not "
                         f"divisible into num_groups={num_groups}")
    group_tokens = num_tokens // num_groups
    capacity = expert_capacity(group_tokens, router_w.shape[1], top_k, capacity_factor)
    y, stats = moe_groups(x.reshape(num_groups, group_tokens, d), router_w, w_in, w_gate, w_out,
                          top_k=top_k, capacity=capacity, activation=activation,
                          exchange=(lambda a: a, lambda a: a))
    return y.reshape(x.shape), finish_aux(stats, num_tokens, top_k)
