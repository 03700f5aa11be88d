"""Expert parallelism: a mixture-of-experts MLP whose experts are sharded over a mesh axis.

Tokens are routed to their top-k experts (GShard/Switch style, with a fixed capacity per expert
and group), sent to the device that owns the expert with one ``all_to_all``, run through the
expert MLP there, and sent back with a second ``all_to_all``. Without a mesh (or when the ``ep``
axis has size 1) the same function runs on one device, so the sharded program can be checked
number for number against it.

Example::

    params = init_moe_params(jax.random.key(0), d_model=16, d_hidden=32, num_experts=8)
    y, aux = moe_mlp(x, **params, top_k=2, num_groups=8)      # one device, 8 routing groups
    with jax.set_mesh(jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))):
        y, aux = jax.jit(lambda x, p: moe_mlp(x, **p, top_k=2))(x, params)  # same numbers

Routing semantics (identical on every mesh for a given ``num_groups``):

* Tokens (all leading dims of ``x`` flattened, row-major) are split into ``num_groups``
  contiguous groups of equal size. Each group routes on its own, like GShard's groups: its
  tokens compete for ``capacity = ceil(capacity_factor * group_tokens * top_k / num_experts)``
  slots per expert. Under expert parallelism ``num_groups`` defaults to the number of token
  shards (``ep`` size, times the ``batch_axes`` sizes), so each device's local tokens form one
  group and routing needs no communication.
* Within a group, slots are handed out first to every token's 1st choice in token order, then
  to 2nd choices, and so on; an assignment that finds its expert full is dropped (it adds
  nothing to the output: add the residual outside).
* Gates are the softmax probabilities of the chosen experts, renormalised to sum to 1 over the
  top-k when ``top_k > 1`` (top-1 keeps the raw probability so the router still learns).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardax.parallel.axes import axis_size, manual_axes, mesh_or_context
from shardax.parallel.moe_kernel import expert_capacity, finish_aux, moe_groups

Array = jax.Array

__all__ = ["expert_capacity", "init_moe_params", "moe_mlp", "moe_param_specs"]


def init_moe_params(
    key: Array,
    d_model: int,
    d_hidden: int,
    num_experts: int,
    *,
    gated: bool = True,
    dtype=jnp.float32,
) -> dict[str, Array]:
    """Parameters for :func:`moe_mlp`, keyed by its argument names (``moe_mlp(x, **params)``).

    Shapes: ``router_w [d, E]``, ``w_in`` / ``w_gate [E, d, h]``, ``w_out [E, h, d]``.
    Drawn with global shapes, so the same key gives the same numbers on any mesh.

    >>> p = init_moe_params(jax.random.key(0), 16, 32, num_experts=4)
    >>> p["w_in"].shape
    (4, 16, 32)
    """
    k_r, k_in, k_gate, k_out = jax.random.split(key, 4)
    normal = jax.nn.initializers.normal
    params = {
        "router_w": normal(d_model**-0.5)(k_r, (d_model, num_experts), dtype),
        "w_in": normal(d_model**-0.5)(k_in, (num_experts, d_model, d_hidden), dtype),
        "w_out": normal(d_hidden**-0.5)(k_out, (num_experts, d_hidden, d_model), dtype),
    }
    if gated:
        params["w_gate"] = normal(d_model**-0.5)(k_gate, (num_experts, d_model, d_hidden), dtype)
    return params


def moe_param_specs(params: dict[str, Array], axis: str = "ep") -> dict[str, P]:
    """PartitionSpecs for :func:`init_moe_params` output: experts over ``axis``, router replicated.

    >>> moe_param_specs({"router_w": 0, "w_in": 0, "w_out": 0})["w_in"]
    P('ep',)
    """
    return {k: P() if k == "router_w" else P(axis) for k in params}


def _token_shards(mesh, axis: str, batch_axes: tuple[str, ...]) -> tuple[int, int, bool]:
    """(ep size, token shards, whether ``axis`` and ``batch_axes`` are already manual) from the
    explicit or context mesh; ep is 1 without `axis`."""
    ep = axis_size(axis, mesh)
    if ep == 1:
        return 1, 1, False
    manual = manual_axes(mesh) & {axis, *batch_axes}
    if manual and manual != {axis, *batch_axes}:
        raise ValueError(
            f"moe_mlp: mesh axes {sorted(manual)} are already manual (called inside a shard_map "
            f"over them) but {sorted({axis, *batch_axes} - manual)} are not; call moe_mlp "
            "outside shard_map (it adds its own) or inside one manual over all of them."
        )
    m = mesh_or_context(mesh)
    bad = [a for a in batch_axes if a == axis or a not in m.axis_names]
    if bad:
        raise ValueError(
            f"moe_mlp: batch_axes {bad} must be mesh axes other than {axis!r}; mesh axes "
            f"{dict(m.shape)}"
        )
    return ep, ep * math.prod(axis_size(a, mesh) for a in batch_axes), bool(manual)


def _check(x, router_w, w_in, w_gate, w_out, top_k, capacity_factor, where, ep, shards, num_groups,
           expert_shards=1):
    shapes = (
        f"x {tuple(x.shape)}, router_w {tuple(router_w.shape)}, w_in {tuple(w_in.shape)}, "
        f"w_out {tuple(w_out.shape)}"
        + ("" if w_gate is None else f", w_gate {tuple(w_gate.shape)}")
    )
    if x.ndim < 2 or router_w.ndim != 2 or w_in.ndim != 3 or w_out.ndim != 3:
        raise ValueError(
            f"moe_mlp expects x [..., d], router_w [d, E], w_in [E, d, h], w_out [E, h, d]; "
            f"got {shapes}"
        )
    d, num_experts = router_w.shape
    _, _, h = w_in.shape
    local = num_experts // expert_shards  # inside a region manual over `axis`: its experts
    ok = (
        x.shape[-1] == d
        and local * expert_shards == num_experts
        and w_in.shape == (local, d, h)
        and w_out.shape == (local, h, d)
        and (w_gate is None or w_gate.shape == w_in.shape)
    )
    if not ok:
        raise ValueError(f"moe_mlp: inconsistent shapes (d={d}, E={num_experts}): {shapes}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_mlp: top_k={top_k} must be in [1, num_experts={num_experts}]")
    if not capacity_factor > 0:
        raise ValueError(f"moe_mlp: capacity_factor={capacity_factor} must be > 0")
    if num_experts % ep:
        raise ValueError(
            f"moe_mlp: num_experts={num_experts} is not divisible by {where}; {shapes}"
        )
    num_tokens = math.prod(x.shape[:-1])
    if num_groups % shards:
        raise ValueError(f"moe_mlp: num_groups={num_groups} is not divisible by {where}")
    if num_tokens % num_groups:
        raise ValueError(
            f"moe_mlp: {num_tokens} tokens (x {tuple(x.shape)}) are not divisible into "
            f"num_groups={num_groups} ({where})"
        )


def moe_mlp(
    x: Array,
    router_w: Array,
    w_in: Array,
    w_out: Array,
    w_gate: Array | None = None,
    *,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    num_groups: int | None = None,
    axis: str = "ep",
    batch_axes: Sequence[str] = (),
    activation: Callable[[Array], Array] = jax.nn.silu,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Mixture-of-experts MLP, expert-parallel over mesh axis ``axis`` when the mesh has one.

    Args:
      x: tokens ``[..., d]`` (e.g. ``[batch, seq, d]``); flattened row-major inside.
      router_w: ``[d, E]``, replicated. The router runs in float32.
      w_in, w_gate: ``[E, d, h]``; expert ``e`` computes
        ``(activation(x @ w_gate[e]) * (x @ w_in[e])) @ w_out[e]``, or
        ``activation(x @ w_in[e]) @ w_out[e]`` when ``w_gate`` is None.
      w_out: ``[E, h, d]``.
      top_k: experts per token. capacity_factor: see :func:`expert_capacity`.
      num_groups: routing groups (see module docstring). Default: the number of token shards
        (``axis`` size times the ``batch_axes`` sizes; 1 without a mesh). Must be a multiple
        of it; give the same value to get the same function on any mesh.
      axis: mesh axis the experts are sharded over. Taken from ``mesh`` or the context mesh
        (``jax.set_mesh``). Tokens are split over it for the exchange.
      batch_axes: further mesh axes (data parallel / FSDP) that tokens are split over, with
        ``axis`` major: each device then routes only its own tokens and exchanges them within
        its ``axis`` group, and expert weights are gathered over these axes like FSDP does.
        Mesh axes not named here or in ``axis`` are left to XLA, which may replicate the
        token work over them (the shard_map is manual over ``axis`` and ``batch_axes`` only).
        Called inside a ``shard_map`` already manual over ``axis`` and ``batch_axes`` (explicit
        FSDP's region), the body runs directly: ``x`` is this device's tokens, ``num_groups``
        (default: 1) counts its groups, ``w_in``/``w_gate``/``w_out`` hold its experts
        (``E / ep`` of them) and ``router_w`` all ``E``.

    Returns:
      ``(y, aux)``: ``y`` like ``x`` (dropped assignments contribute zero), and ``aux`` with
      scalars ``load_balancing_loss`` (``E * sum_e f_e * P_e``, 1 when balanced, ``f_e`` the
      fraction of the ``tokens * top_k`` assignments choosing ``e`` before dropping, ``P_e`` the
      mean router probability), ``router_z_loss`` (mean ``logsumexp(logits)**2``),
      ``dropped_fraction``, and ``expert_fraction`` (``f``, shape ``[E]``). All are global over
      every token. Weighting the losses is up to the caller.

    >>> p = init_moe_params(jax.random.key(0), 8, 16, num_experts=4)
    >>> y, aux = moe_mlp(jnp.ones((2, 4, 8)), **p, top_k=2)
    >>> y.shape
    (2, 4, 8)
    """
    batch_axes = tuple(batch_axes)
    ep, shards, inside = _token_shards(mesh, axis, batch_axes)
    if inside:  # x is this device's tokens, its groups its own, w_* its experts
        num_groups = 1 if num_groups is None else num_groups
        where = f"manual mesh axis {axis!r} of size {ep} (called inside a shard_map over it)"
        token_shards, expert_shards = 1, ep
    else:
        num_groups = shards if num_groups is None else num_groups
        where = f"mesh axis {axis!r} of size {ep}" + (
            f" x batch_axes {batch_axes} ({shards} token shards)" if shards != ep else ""
        )
        token_shards, expert_shards = shards, 1
    _check(x, router_w, w_in, w_gate, w_out, top_k, capacity_factor, where, ep, token_shards,
           num_groups, expert_shards)
    if inside:
        num_groups *= shards  # the groups of all devices' tokens, as outside
    d = x.shape[-1]
    num_tokens = math.prod(x.shape[:-1]) * (shards if inside else 1)
    group_tokens = num_tokens // num_groups
    capacity = expert_capacity(group_tokens, router_w.shape[1], top_k, capacity_factor)
    moe = partial(moe_groups, top_k=top_k, capacity=capacity, activation=activation)
    tokens = x.reshape(-1, d)

    if ep == 1:
        y, stats = moe(
            tokens.reshape(num_groups, group_tokens, d),
            router_w,
            w_in,
            w_gate,
            w_out,
            exchange=(lambda a: a, lambda a: a),
        )
        return y.reshape(x.shape), finish_aux(stats, num_tokens, top_k)

    # [E, g*C, d] -> [E/ep, ep*g*C, d]: expert blocks go to their owner and the received slots
    # are concatenated in source order. Expert rows are independent, so which slots meet on a
    # device changes nothing numerically; the way back restores each group's own buffer.
    to_owner = partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=1, tiled=True)
    from_owner = partial(
        jax.lax.all_to_all, axis_name=axis, split_axis=1, concat_axis=0, tiled=True
    )
    manual = (axis, *batch_axes)

    def local(tokens, router_w, w_in, w_out, *w_gate):
        y, stats = moe(
            tokens.reshape(num_groups // shards, group_tokens, d),
            router_w,
            w_in,
            w_gate[0] if w_gate else None,
            w_out,
            exchange=(to_owner, from_owner),
        )
        return y.reshape(-1, d), jax.tree.map(lambda s: jax.lax.psum(s, manual), stats)

    args = (tokens, router_w, w_in, w_out) + (() if w_gate is None else (w_gate,))
    if inside:
        y, stats = local(*args)
        return y.reshape(x.shape), finish_aux(stats, num_tokens, top_k)
    specs = (P(manual), P(), P(axis), P(axis)) + (() if w_gate is None else (P(axis),))
    y, stats = jax.shard_map(
        local, mesh=mesh, in_specs=specs, out_specs=(P(manual), P()), axis_names=set(manual)
    )(*args)
    return y.reshape(x.shape), finish_aux(stats, num_tokens, top_k)
