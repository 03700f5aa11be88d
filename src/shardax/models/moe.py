"""The dropless mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): every token reaches
its top-k experts, none is dropped.

Each token's ``top_k`` (token, expert) pairs are sorted by expert and every expert's rows run
as one grouped matmul (`shardax.parallel.grouped_kernel`: ``jax.lax.ragged_dot`` on TPU, a
batched matmul over a capacity bucket that holds every expert's rows on GPU, tiles of one
expert's rows on CPU) in `expert_mlp`, the one function every path calls: the work is that of
the tokens routed, with no dropping and no [tokens, experts, capacity] dispatch tensor (the
capacity-based ``llama_moe.MoE`` drops what overflows and dispatches in O(tokens²)).
Routing is per token, so the output never depends on the batch, the mesh or the other tokens.

Router: softmax over all experts in float32, top-k, optionally renormalised over the k
(``moe_norm_topk``: Mixtral, Qwen3-MoE; not Qwen2-MoE); or DeepSeek-V3's sigmoid scores
(``router_score='sigmoid'``) with a `RouterBias` that picks the top-k but does not weigh them
(auxiliary-loss-free balancing: training moves it, `shardax.train.balance`), the weights
times ``routed_scaling_factor``, optionally limited to the experts of the best groups
(``n_group`` / ``topk_group``). ``shared_expert_dim > 0`` adds
Qwen2-MoE's shared SwiGLU expert, scaled by ``sigmoid(x @ shared_router)``. gpt-oss
(``router_score='topk_softmax'``, ``moe_bias``, ``swiglu_limit``): a router with a bias, the
top-k logits softmaxed, biases on every expert's projections and a clamped SwiGLU
(`expert_glu`). Expert weights carry the logical name 'expert' first, so a rule on 'expert'
splits them over the devices; the layout then runs the routed experts through
`DroplessMoE.run` with its expert-parallel dispatch (`shardax.parallel.dropless`: the rows
travel to their experts with an all-to-all).

The load-balancing loss is transformers' ``load_balancing_loss_func`` for one layer:
``n_experts * sum_e(f_e * p_e)`` with ``f_e`` the top-k assignments to expert ``e`` per token
and ``p_e`` its mean router probability (``top_k`` when perfectly balanced).

Example::

    cfg = LlamaConfig(n_experts=4, top_k=2, moe_impl='dropless', mlp_dim=32)
    y, stats = DroplessMoE(cfg, nnx.Rngs(0))(x)    # x [b, s, dim]; stats: MoEStats
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._annotate import constrain
from shardax.models._layers import param
from shardax.models.llama_moe import init_experts
from shardax.models.protocol import MoEStats
from shardax.models.remat import checkpoint_name
from shardax.parallel.grouped_kernel import Groups, grouped_matmul, routed_experts, row_experts

if TYPE_CHECKING:
    from shardax.models.configs import LlamaConfig

__all__ = ["DroplessMoE", "RouterBias", "expert_glu", "expert_mlp", "route"]

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros


def route(logits: jax.Array, top_k: int, normalize: bool, *, score: str = "softmax",
          bias: jax.Array | None = None, scale: float = 1.0, n_group: int = 1,
          topk_group: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights [t, k], experts [t, k], aux)`` from router logits [t, n_experts]: scores in
    float32 (``score`` 'softmax' over the experts, or 'sigmoid' per expert as DeepSeek-V3),
    top-k of ``scores + bias`` (the auxiliary-loss-free balancing bias: it picks the experts
    only), weights the unbiased scores of those k, renormalised over the k when
    ``normalize``, times ``scale`` (DeepSeek's ``routed_scaling_factor``); ``aux`` the
    load-balancing loss (sigmoid scores normalised per token for it).

    ``n_group > 1``: group-limited routing as transformers' ``DeepseekV3TopkRouter``: the
    experts split into ``n_group`` contiguous groups, each scored by the sum of its 2 best
    ``scores + bias``; the top-k is taken among the experts of the ``topk_group`` best groups.

    Example::

        w, e, aux = route(x @ router, top_k=2, normalize=True)
        w, e, aux = route(logits, 8, True, score="sigmoid", bias=b, n_group=8, topk_group=4)
    """
    logits = logits.astype(jnp.float32)
    if score == "topk_softmax":  # gpt-oss: top-k of the logits, softmax over those k
        top, experts = jax.lax.top_k(logits, top_k)
        weights = jax.nn.softmax(top, axis=-1)
        return weights, experts, _balance_loss(logits, experts, jax.nn.softmax(logits, -1))
    if score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    if bias is None and n_group == 1:
        weights, experts = jax.lax.top_k(scores, top_k)
    else:
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        if n_group > 1:
            choice = _limit_to_groups(choice, n_group, topk_group)
        experts = jax.lax.top_k(choice, top_k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:
        weights = weights * scale
    return weights, experts, _balance_loss(logits, experts, probs)


def _balance_loss(logits: jax.Array, experts: jax.Array, probs: jax.Array) -> jax.Array:
    """``n_experts * sum_e(f_e * p_e)`` (see the module docstring)."""
    n = logits.shape[-1]
    counts = jnp.zeros((n,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    return n * jnp.sum(counts / logits.shape[0] * jnp.mean(probs, axis=0))


def expert_glu(c: LlamaConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' gated activation: ``silu(gate) * up``, or with ``swiglu_limit`` gpt-oss's
    clamped ``(up + 1) * gate * sigmoid(alpha * gate)`` (gate clamped above, up both sides).

    Example::

        h = expert_glu(cfg, x @ w_gate, x @ w_up)
    """
    if c.swiglu_limit is None:
        return jax.nn.silu(gate) * up
    limit = c.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * c.swiglu_alpha)


def expert_mlp(c: LlamaConfig, xs: jax.Array, groups: Groups, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, b_gate: jax.Array | None = None,
               b_up: jax.Array | None = None) -> jax.Array:
    """The experts' gated MLP on rows grouped by expert (`sort_by_expert`): three grouped
    matmuls, ``expert_glu(xs @ w_gate[e] + b_gate[e], xs @ w_up[e] + b_up[e]) @ w_down[e]``
    per row of expert ``e`` (no biases unless given; the down bias is added per token by
    `DroplessMoE.run`). Its weights may hold a slice of the hidden units (the output is then
    a partial sum).

    Example::

        ys = expert_mlp(cfg, xs, layout.groups, w_gate, w_up, w_down)   # [rows, dim]
    """
    gate, up = grouped_matmul(xs, w_gate, groups), grouped_matmul(xs, w_up, groups)
    if b_gate is not None:
        row_expert = row_experts(groups, xs.shape[0])
        gate = gate + jnp.take(b_gate, row_expert, axis=0)
        up = up + jnp.take(b_up, row_expert, axis=0)
    h = checkpoint_name(expert_glu(c, gate, up), "mlp_hidden")
    return grouped_matmul(h, w_down, groups)


def _limit_to_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """``choice`` [t, n] with -inf outside each token's ``topk_group`` best groups (a group's
    score: the sum of its 2 best)."""
    t, n = choice.shape
    grouped = choice.reshape(t, n_group, n // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    kept = jax.lax.top_k(group_scores, topk_group)[1]
    keep = jnp.any(kept[:, :, None] == jnp.arange(n_group), axis=1)  # [t, n_group]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, n)


class RouterBias(nnx.Variable):
    """The auxiliary-loss-free balancing bias of one MoE layer's router ([n_experts],
    float32): not a parameter (no gradient, no optimizer state); training moves it after each
    step (`shardax.train.balance`) and checkpoints save it with the model's other state."""


class DroplessMoE(nnx.Module):
    """``moe(x [b, s, dim]) -> (y, stats)``; ``y`` excludes the residual, ``stats`` a
    `MoEStats` (load-balancing loss, tokens per expert, nothing dropped). A sigmoid router or
    ``router_bias_update > 0`` gives it a `RouterBias` (zeros) that picks the experts."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        self.config = c
        init_experts(self, c, rngs)
        if c.moe_bias:  # gpt-oss: router and expert biases
            e, m, pd = c.n_experts, c.mlp_dim, c.param_dtype
            self.router_b = param(rngs.params(), _zeros, (e,), (None,), pd)
            self.b_gate = param(rngs.params(), _zeros, (e, m), ("expert", "mlp"), pd)
            self.b_up = param(rngs.params(), _zeros, (e, m), ("expert", "mlp"), pd)
            self.b_down = param(rngs.params(), _zeros, (e, c.dim), ("expert", "embed"), pd)
        if c.router_bias:
            self.router_bias = RouterBias(jnp.zeros((c.n_experts,), jnp.float32),
                                          out_sharding=(None,), eager_sharding=False)
        if c.shared_expert_dim:
            std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
            f, pd = c.shared_expert_dim, c.param_dtype
            self.shared_gate = param(rngs.params(), _normal(std), (c.dim, f), ("embed", "mlp"),
                                     pd)
            self.shared_up = param(rngs.params(), _normal(std), (c.dim, f), ("embed", "mlp"), pd)
            self.shared_down = param(rngs.params(), _normal(out_std), (f, c.dim),
                                     ("mlp", "embed"), pd)
            if c.shared_expert_gate:
                self.shared_router = param(rngs.params(), _normal(std), (c.dim, 1),
                                           ("embed", None), pd)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        return self.run(x)

    def run(self, x: jax.Array, experts_fn: Callable = routed_experts, **kwargs
            ) -> tuple[jax.Array, MoEStats]:
        """``(y, stats)`` with the routed experts run by ``experts_fn(tokens, weights,
        experts, mlp, *expert weights, **kwargs)`` (``routed_experts`` on one
        device; the layout swaps in its expert-parallel dispatch). Routing and statistics
        stay here, on every token, so they are the one-device numbers on any layout."""
        c, dt = self.config, self.config.dtype
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        logits = tokens @ self.router[...].astype(dt)
        if c.moe_bias:
            logits = logits + self.router_b[...].astype(dt)
        bias = self.router_bias[...] if c.router_bias else None
        weights, experts, aux = route(logits, c.top_k, c.moe_norm_topk, score=c.router_score,
                                      bias=bias, scale=c.routed_scaling_factor,
                                      n_group=c.n_group, topk_group=c.topk_group)
        sizes = jnp.bincount(experts.reshape(-1), length=c.n_experts)
        params = [self.w_gate, self.w_up, self.w_down]
        if c.moe_bias:  # gpt-oss: the gate and up biases split with the hidden units
            params += [self.b_gate, self.b_up]
        y = experts_fn(tokens, weights, experts, partial(expert_mlp, c),
                       *(w[...].astype(dt) for w in params), **kwargs)
        if c.moe_bias:  # the down bias per (token, expert), weighted as the expert's output
            down = jnp.take(self.b_down[...].astype(dt), experts, axis=0).astype(jnp.float32)
            y = y + jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), down)
        y = y.astype(dt)
        if c.shared_expert_dim:
            hs = jax.nn.silu(tokens @ self.shared_gate[...].astype(dt)) * (
                tokens @ self.shared_up[...].astype(dt))
            shared = hs @ self.shared_down[...].astype(dt)
            if c.shared_expert_gate:
                shared = jax.nn.sigmoid(tokens @ self.shared_router[...].astype(dt)) * shared
            y = y + shared
        y = constrain(y.reshape(b, s, d), ("batch", "length", "embed"))
        stats = MoEStats(aux, sizes.astype(jnp.float32), jnp.zeros((), jnp.float32))
        return checkpoint_name(y, "mlp_out"), stats
