"""Dropless expert parallelism: each device sends its routed (token, expert) pairs to the
devices that own those experts with an all-to-all over ``axis``, runs its experts' grouped
matmuls on what it received, and sends the rows back to be combined; no token is dropped.

The exchange is an all-to-all of one buffer per destination device, each padded to its
static bound: ``tokens * min(top_k, local experts)`` rows (a token's top-k experts are
distinct, so no device can send more than that to one destination). XLA:CPU has no
``ragged-all-to-all`` (``UNIMPLEMENTED`` in JAX 0.10), so the buffers move whole: ``ep *
min(top_k, local experts) / top_k`` times the bytes of the routed rows. Inside an expert the
hidden units may be split over ``tensor_axis`` (Megatron column / row): the rows sent back are
summed over it.

Routing stays outside (the model routes every token, so its statistics are the one-device
ones); this function takes each token's ``weights`` and ``experts``.

Example::

    y = dropless_moe(tokens, weights, experts, expert_mlp, w_gate, w_up, w_down,
                     batch_axes=("fsdp",), tensor_axis="tp")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardax.parallel.axes import axis_size, manual_axes
from shardax.parallel.grouped_kernel import combine, routed_experts, sort_by_expert, tile_rows

Array = jax.Array

__all__ = ["dropless_moe", "send_bound"]


def send_bound(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows of the buffer a device sends to each other device: ``tokens * min(top_k,
    local_experts)``, the most pairs that can route to one device's experts.

    >>> send_bound(256, top_k=2, local_experts=1)
    256
    """
    return tokens * min(top_k, local_experts)


def _exchange(tokens: Array, weights: Array, experts: Array, mlp: Callable[..., Array],
              params: Sequence[Array], axis: str, tensor_axis: str | None) -> Array:
    """One device's part: its ``tokens [t, d]`` to their experts' devices over ``axis``,
    ``mlp`` on the rows its local experts received, and back, combined per token."""
    t, k = experts.shape
    local, ep = params[0].shape[0], axis_size(axis)
    bound = send_bound(t, k, local)
    # Buffer position of each pair: its destination's block, in the pairs' order there.
    flat = experts.reshape(-1).astype(jnp.int32)
    dest = flat // local
    order = jnp.argsort(dest, stable=True)
    sizes = jnp.bincount(dest, length=ep)
    start = jnp.cumsum(sizes) - sizes
    to = dest[order]
    pos = to * bound + jnp.arange(t * k, dtype=jnp.int32) - start[to]
    slots = jnp.zeros((t * k,), jnp.int32).at[order].set(pos, unique_indices=True)
    rows = jnp.zeros((ep * bound,), jnp.int32).at[pos].set(order // k, unique_indices=True)
    # A padding row carries expert `local`: the receiver gives it no row.
    sent_expert = jnp.full((ep * bound,), local, jnp.int32).at[pos].set(flat[order] % local)
    a2a = dict(axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
    x = jax.lax.all_to_all(jnp.take(tokens, rows, axis=0), **a2a)
    got_expert = jax.lax.all_to_all(sent_expert, **a2a)
    lay = sort_by_expert(got_expert[:, None], local, tile_rows(t * k, local))
    ys = mlp(jnp.take(x, lay.rows, axis=0), lay.groups, *params)
    back = jnp.take(ys, lay.slots[:, 0], axis=0, mode="fill", fill_value=0)
    if tensor_axis is not None:
        back = jax.lax.psum(back, tensor_axis)
    return combine(jax.lax.all_to_all(back, **a2a), slots.reshape(t, k), weights)


def dropless_moe(tokens: Array, weights: Array, experts: Array, mlp: Callable[..., Array],
                 *params: Array, axis: str = "ep", batch_axes: Sequence[str] = (),
                 tensor_axis: str | None = None, hidden_dims: Sequence[int] = (2, 2, 1, 1, 1),
                 mesh: jax.sharding.Mesh | None = None) -> Array:
    """The routed experts of a dropless MoE, expert-parallel over mesh axis ``axis``.

    Args:
      tokens: ``[t, d]``, split over ``axis`` and ``batch_axes`` (``axis`` major).
      weights, experts: ``[t, k]``, each token's routing weights and expert ids.
      mlp: ``mlp(rows, groups, *params) -> [rows, d]``, the experts' MLP on rows grouped by
        expert (`shardax.parallel.grouped_kernel.grouped_matmul`).
      params: the experts' weights, expert axis first, split over ``axis``; gathered over
        ``batch_axes`` (as FSDP's all-gather).
      tensor_axis: a mesh axis splitting each expert's hidden units (axis ``hidden_dims[i]``
        of ``params[i]``: the default fits ``w_gate, w_up, w_down`` and the gate and up
        biases); the experts' output rows are summed over it. None: not split.
      mesh: default the context mesh. Without ``axis`` (or of size 1): the one-device math.

    Returns:
      ``[t, d]`` float32: ``sum_k weights[t, k] * mlp_e(tokens[t])``, equal to one device.
    """
    ep = axis_size(axis, mesh)
    if ep == 1:
        return routed_experts(tokens, weights, experts, mlp, *params)
    n_experts = params[0].shape[0]
    tensor = tensor_axis if tensor_axis and axis_size(tensor_axis, mesh) > 1 else None
    token_axes = (axis, *batch_axes)
    manual = set(token_axes) | ({tensor} if tensor else set())
    already = manual_axes(mesh) & manual
    if already:
        raise ValueError(f"dropless_moe: mesh axes {sorted(already)} are already manual (a "
                         "shard_map over them encloses the call); it adds its own shard_map")
    if n_experts % ep:
        raise ValueError(f"dropless_moe: {n_experts} experts are not divisible by mesh axis "
                         f"{axis!r} of size {ep}")

    def param_spec(ndim: int, hidden: int) -> P:
        spec = [axis] + [None] * (ndim - 1)
        if tensor:
            spec[hidden] = tensor
        return P(*spec)

    specs = (P(token_axes),) * 3 + tuple(param_spec(p.ndim, h)
                                          for p, h in zip(params, hidden_dims))
    def body(tokens, weights, experts, *params):
        return _exchange(tokens, weights, experts, mlp, params, axis, tensor)

    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(token_axes),
                         axis_names=manual)(tokens, weights, experts, *params)
