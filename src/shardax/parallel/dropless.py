"""Dropless expert parallelism: each device sends its routed (token, expert) pairs to the
devices that own those experts over ``axis``, runs its experts' grouped matmuls on what it
received, and sends the rows back to be combined; no token is dropped.

The devices first all-gather each one's count of pairs per expert (`pair_counts`: ``[ep,
experts]`` int32, the same everywhere). The rows then move with `exchange`: each ordered pair
of devices ``(i, j)`` moves its ``c[i, j]`` rows in ``ceil(c[i, j] / chunk)`` steps of
`jax.lax.ppermute` inside one ``while_loop`` whose trip count comes from that matrix (the
steps that all pairs ``(i, i + s)`` of a shift ``s`` have in common move together; the rows
a device routes to its own experts stay): the routed rows plus at most ``chunk - 1`` rows of
rounding per pair, where an all-to-all of buffers padded to their static bound would move
``ep * min(top_k, local experts) / top_k`` times the routed rows. A ragged all-to-all would do
the same in one collective; XLA:CPU has none (``UNIMPLEMENTED`` in JAX 0.10), and this runs
on every backend. The loop is not reverse-differentiable, so `exchange` has a custom VJP:
the exchange is linear and its transpose is the same exchange the other way. Inside an
expert the hidden units may be split over ``tensor_axis`` (Megatron column / row): the rows
sent back are summed over it.

Routing stays outside (the model routes every token, so its statistics are the one-device
ones); this function takes each token's ``weights`` and ``experts``.

Example::

    y = dropless_moe(tokens, weights, experts, expert_mlp, w_gate, w_up, w_down,
                     batch_axes=("fsdp",), tensor_axis="tp")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardax import _compat
from shardax.parallel.axes import axis_size, manual_axes
from shardax.parallel.grouped_kernel import combine, routed_experts, sort_by_expert, tile_rows

Array = jax.Array

__all__ = ["chunk_rows", "dropless_moe", "exchange", "pair_counts", "send_bound"]


def send_bound(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows of the buffer a device sends to each other device: ``tokens * min(top_k,
    local_experts)``, the most pairs that can route to one device's experts.

    >>> send_bound(256, top_k=2, local_experts=1)
    256
    """
    return tokens * min(top_k, local_experts)


def chunk_rows(pairs: int, ep: int) -> int:
    """Rows each loop step of the exchange moves: as the CPU grouped matmul's tile
    (`tile_rows`), the power of two nearest a quarter of the mean rows one device sends
    another (``pairs / ep``), within [8, 256]. A pair's rows are rounded up to whole chunks
    (about an eighth of a mean pair on average); larger chunks mean fewer loop steps.

    >>> chunk_rows(512, 8)
    16
    """
    return tile_rows(pairs, ep, backend="cpu")


def pair_counts(experts: Array, n_experts: int, axis: str) -> Array:
    """``[ep, n_experts]`` int32, the same on every device of ``axis``: row ``i`` the pairs
    device ``i`` routes to each expert (an all-gather of each device's ``bincount``).

    Example (inside ``shard_map`` over 'ep')::

        counts = pair_counts(experts, 8, "ep")
    """
    counts = jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.int32)
    return jax.lax.all_gather(counts, axis, to="invarying")


def _trips(rows: Array, chunk: int) -> Array:
    return (rows + chunk - 1) // chunk


def _exchange_loop(x: Array, pairs: Array, axis: str, chunk: int) -> Array:
    """`exchange` as one ``while_loop`` of steps, each one ``ppermute`` (static pairs)
    picked by a ``switch``: first, per shift ``s``, the chunks that every pair ``(i, i + s)``
    has (all ``ep`` pairs at once), then each ordered pair's remaining chunks alone."""
    ep = pairs.shape[0]
    if x.shape[0] % (ep * chunk):
        raise ValueError(f"exchange: {x.shape[0]} rows are not {ep} blocks of "
                         f"whole chunks of {chunk} rows")
    block = x.shape[0] // ep
    me = jax.lax.axis_index(axis)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    # The rows a device keeps for its own experts move no further.
    y = jnp.where(((rows // block == me) & (rows % block < pairs[me, me]))[:, None], x, 0)
    steps = _trips(pairs, chunk)
    # Every device runs the loop as often (XLA:CPU's collectives wait for all the devices of
    # the program): the most steps over the other axes the counts vary over (batch, pipeline).
    others = tuple(sorted(_compat.varying_axes(steps)))
    steps = jax.lax.pmax(steps, others) if others else steps
    shifts = np.arange(1, ep)
    src, dst = (np.array(a) for a in zip(*[(i, j) for i in range(ep) for j in range(ep)
                                           if i != j]))
    ring = (np.arange(ep)[None, :] + shifts[:, None]) % ep
    common = jnp.min(steps[np.arange(ep)[None, :], ring], axis=1)  # [ep - 1], per shift
    pair_shift = (dst - src) % ep - 1
    # Task k: a shift (k < ep - 1), else a pair; its steps and its first chunk.
    task_steps = jnp.concatenate([common, steps[src, dst] - common[pair_shift]])
    first = jnp.concatenate([jnp.zeros_like(common), common[pair_shift]])
    none, unused = np.zeros_like(shifts), np.zeros_like(src)
    shift = jnp.asarray(np.concatenate([shifts, unused]))
    a, b = (jnp.asarray(np.concatenate([none, v])) for v in (src, dst))
    ends = jnp.cumsum(task_steps)
    moves = ([partial(jax.lax.ppermute, axis_name=axis, perm=[(i, (i + s) % ep)
                                                               for i in range(ep)])
              for s in shifts] +
             [partial(jax.lax.ppermute, axis_name=axis, perm=[(int(i), int(j))])
              for i, j in zip(src, dst)])
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def body(carry):
        i, y = carry
        k = jnp.sum(ends <= i, dtype=jnp.int32)
        c = (first[k] + i - ends[k] + task_steps[k]) * chunk
        by_shift = k < ep - 1
        to = jnp.where(by_shift, (me + shift[k]) % ep, b[k])
        frm = jnp.where(by_shift, (me - shift[k]) % ep, a[k])
        got = jax.lax.switch(k, moves, jax.lax.dynamic_slice_in_dim(x, to * block + c, chunk))
        count = jnp.where(by_shift | (me == b[k]), pairs[frm, me], 0)
        keep = (c + offsets < count)[:, None]
        old = jax.lax.dynamic_slice_in_dim(y, frm * block + c, chunk)
        return i + 1, jax.lax.dynamic_update_slice_in_dim(y, jnp.where(keep, got, old),
                                                          frm * block + c, 0)

    return jax.lax.while_loop(lambda carry: carry[0] < ends[-1], body, (0, y))[1]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def exchange(x: Array, pairs: Array, axis: str, chunk: int) -> Array:
    """Rows from every device to every device over ``axis``, moving only the rows sent:
    block ``j`` (of ``ep`` equal blocks) of device ``i``'s ``x [ep * block, d]`` holds, first,
    the ``pairs[i, j]`` rows it sends device ``j``; block ``i`` of device ``j``'s result holds
    them (the rest of each block is zeros). ``pairs [ep, ep]`` (int32) is the same on every
    device. Each ordered pair ``(i, j)``'s rows move ``chunk`` at a time with
    `jax.lax.ppermute` from ``i`` to ``j``, ``ceil(pairs[i, j] / chunk)`` steps of one
    ``while_loop`` (the steps that every pair ``(i, i + s)`` of a shift ``s`` has move in one
    ``ppermute`` of all of them); the rows a device sends itself stay.
    Linear in ``x``: its transpose (the backward pass) is the exchange with ``pairs.T``.
    ``block`` must be a whole number of chunks, each ``pairs[i, j] <= block``.

    Example (inside ``shard_map`` over 'ep')::

        y = exchange(x, pairs, "ep", chunk=16)
    """
    return _exchange_loop(x, pairs, axis, chunk)


def _exchange_fwd(x, pairs, axis, chunk):
    return _exchange_loop(x, pairs, axis, chunk), pairs


def _exchange_bwd(axis, chunk, pairs, g):
    return (_exchange_loop(g, pairs.T, axis, chunk),
            jnp.zeros(pairs.shape, jax.dtypes.float0))


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _exchange(tokens: Array, weights: Array, experts: Array, mlp: Callable[..., Array],
              params: Sequence[Array], axis: str, tensor_axis: str | None) -> Array:
    """One device's part: its ``tokens [t, d]`` to their experts' devices over ``axis``,
    ``mlp`` on the rows its local experts received, and back, combined per token."""
    t, k = experts.shape
    local, ep = params[0].shape[0], axis_size(axis)
    chunk = chunk_rows(t * k, ep)
    # Each destination's block: the most pairs one device can route there, whole chunks.
    block = _trips(send_bound(t, k, local), chunk) * chunk
    counts = pair_counts(experts, local * ep, axis)
    pairs = counts.reshape(ep, ep, local).sum(-1)
    # Pairs sorted by expert (so by destination), each at its destination's block.
    flat = experts.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    dest = flat[order] // local
    me = jax.lax.axis_index(axis)
    start = jnp.cumsum(pairs[me]) - pairs[me]
    pos = dest * block + jnp.arange(t * k, dtype=jnp.int32) - start[dest]
    slots = jnp.zeros((t * k,), jnp.int32).at[order].set(pos, unique_indices=True)
    rows = jnp.zeros((ep * block,), jnp.int32).at[pos].set(order // k, unique_indices=True)
    x = exchange(jnp.take(tokens, rows, axis=0), pairs, axis, chunk)
    # The expert of each row received: source i's block holds its pairs for this device's
    # experts in expert order (`local`, no expert, past them).
    mine = jax.lax.dynamic_slice_in_dim(counts, me * local, local, 1)
    got = jnp.arange(ep * block, dtype=jnp.int32)
    ends = jnp.cumsum(mine, axis=1)[got // block]
    got_expert = jnp.sum(got[:, None] % block >= ends, axis=1, dtype=jnp.int32)
    lay = sort_by_expert(got_expert[:, None], local, tile_rows(t * k, local))
    ys = mlp(jnp.take(x, lay.rows, axis=0), lay.groups, *params)
    back = jnp.take(ys, lay.slots[:, 0], axis=0, mode="fill", fill_value=0)
    if tensor_axis is not None:
        back = jax.lax.psum(back, tensor_axis)
    return combine(exchange(back, pairs.T, axis, chunk), slots.reshape(t, k), weights)


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
