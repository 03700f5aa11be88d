"""Explicit ZeRO-3 FSDP: each layer's parameters are gathered right before use and its gradient
is reduce-scattered as soon as it exists, inside one ``jax.shard_map`` over the data axes.

XLA's partitioner, given FSDP shardings, is free to gather every parameter up front and to form
gradients full-size before reducing them; on CPU it never emits a reduce-scatter. Here the
communication is written out, so peak memory and bytes moved follow ZeRO-3 on any backend:

* the loss runs manual over ``axis`` (``'fsdp'``) and ``batch_axes`` (``'dp'``: parameters are
  replicated over it, HSDP); every other mesh axis stays with XLA (Auto), so tensor
  parallelism from sharding rules composes. ``shard_map`` blocks over another axis inside
  ``loss_fn`` (explicit TP/SP, ring attention) do not lower in JAX 0.10: Shardy rejects the
  residuals of a differentiated manual computation nested in this one;
* :meth:`Gather.__call__` all-gathers a subtree (cast to the compute ``dtype`` first, so bf16
  compute moves bf16). Its backward is one ``psum_scatter`` over ``axis`` in ``reduce_dtype``
  (then a ``psum`` over ``batch_axes``); replicated leaves get one ``psum``;
* :func:`scan_layers` (:func:`loop_layers` for a list of layers) runs the layers, gathering
  layer ``i`` inside a ``jax.checkpoint``: the gathered copy is not kept for the backward
  pass, which gathers it again, and layer ``i``'s gradient is reduce-scattered before layer
  ``i-1``'s backward runs;
* a subtree gathered once and used twice (a tied embedding) has one gradient reduction;
* with ``grad_accum > 1`` the microbatches' gradients are summed unreduced (full size, in
  ``reduce_dtype``) and reduce-scattered once per step: fewer bytes moved, more memory.

Example::

    def loss_fn(gather, params, tokens, targets):
        x = gather(params["embed"])[tokens]
        x = scan_layers(gather, lambda p, h: block(p, h), params["layers"], x)
        return xent(x @ gather(params["head"]), targets)

    with jax.set_mesh(mesh):  # axes e.g. ('fsdp', 'tp')
        loss, grads = jax.jit(lambda p, b: value_and_grad(loss_fn, p, specs, *b))(params, batch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax.parallel._stages import to_microbatches
from shardax.parallel.axes import axis_size, manual_axes, mesh_or_context
from shardax.parallel.remat import checkpoint_in_order

__all__ = ["Gather", "fsdp_dim", "loop_layers", "scan_layers", "value_and_grad"]

PyTree = Any


def fsdp_dim(spec: P | None, axis: str = "fsdp") -> int | None:
    """The dimension a ``PartitionSpec`` shards over ``axis`` (``None``: replicated over it).

    >>> fsdp_dim(P(None, "fsdp")), fsdp_dim(P("tp"))
    (1, None)
    """
    for d, entry in enumerate(() if spec is None else spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return d
    return None


@jax.tree_util.register_pytree_node_class
class _Leaf:
    """A parameter inside the region: its shard, the full-size gradient sink (accumulation
    only) and, as static data, the sharded dim counted from the end (so it survives slicing
    off a leading layer axis)."""

    def __init__(self, shard, sink, dim):
        self.shard, self.sink, self.dim = shard, sink, dim

    def tree_flatten(self):
        return (self.shard, self.sink), self.dim

    @classmethod
    def tree_unflatten(cls, dim, children):
        return cls(*children, dim)


def _is_leaf(x) -> bool:
    return isinstance(x, _Leaf)


class Gather:
    """Turns the parameters a loss receives inside :func:`value_and_grad` into full arrays.

    ``gather(subtree)`` returns the subtree with every parameter all-gathered over ``axis``
    (in ``dtype``); its gradient is reduced in ``reduce_dtype``, once per call.
    """

    def __init__(self, axis: str | None, batch_axes: tuple[str, ...], dtype, reduce_dtype):
        self.axis, self.batch_axes = axis, batch_axes
        self.dtype, self.reduce_dtype = dtype, reduce_dtype

    def __call__(self, tree: PyTree) -> PyTree:
        return jax.tree.map(self._one, tree, is_leaf=_is_leaf)

    def local(self, tree: PyTree) -> PyTree:
        """This device's shards of ``tree``'s parameters, as they are (no communication)."""
        return jax.tree.map(lambda x: x.shard if _is_leaf(x) else x, tree, is_leaf=_is_leaf)

    def _one(self, leaf):
        if not _is_leaf(leaf):  # no FSDP axis: a plain array, only cast
            return leaf.astype(self.dtype) if self.dtype and _is_float(leaf) else leaf
        dim = None if leaf.dim is None else leaf.shard.ndim + leaf.dim
        if leaf.sink is None:
            return _gather_rs(self, dim, leaf.shard)
        return _gather_acc(self, dim, leaf.shard, leaf.sink)

    def all_gather(self, shard, dim):
        """Forward: cast, all-gather over ``axis``, vary over the batch axes."""
        x = shard.astype(self.dtype) if self.dtype and _is_float(shard) else shard
        manual = (self.axis, *self.batch_axes)
        if dim is not None:
            x = lax.all_gather(x, self.axis, axis=dim, tiled=True)
            return lax.pcast(x, self.batch_axes, to="varying") if self.batch_axes else x
        return lax.pcast(x, manual, to="varying")

    def reduce(self, g, dim, dtype):
        """Backward: the gradient of the full array summed over devices, this device's shard."""
        g = g.astype(self.reduce_dtype or g.dtype)
        if dim is not None:
            g = lax.psum_scatter(g, self.axis, scatter_dimension=dim, tiled=True)
            if self.batch_axes:
                g = lax.psum(g, self.batch_axes)
        else:
            g = lax.psum(g, (self.axis, *self.batch_axes))
        return g.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_rs(g: Gather, dim, shard):
    return g.all_gather(shard, dim)


def _gather_rs_fwd(g, dim, shard):
    return g.all_gather(shard, dim), jnp.zeros((), shard.dtype)


def _gather_rs_bwd(g, dim, like, ct):
    return (g.reduce(ct, dim, like.dtype),)


_gather_rs.defvjp(_gather_rs_fwd, _gather_rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_acc(g: Gather, dim, shard, sink):
    return g.all_gather(shard, dim)


def _gather_acc_fwd(g, dim, shard, sink):
    return g.all_gather(shard, dim), (jnp.zeros((), shard.dtype), jnp.zeros((), sink.dtype))


def _gather_acc_bwd(g, dim, like, ct):
    # The unreduced gradient goes to the sink (summed over microbatches, reduced once).
    shard_like, sink_like = like
    del shard_like
    return None, ct.astype(sink_like.dtype)


_gather_acc.defvjp(_gather_acc_fwd, _gather_acc_bwd)


def scan_layers(
    gather: Gather,
    layer_fn: Callable[[PyTree, PyTree], PyTree],
    params: PyTree,
    x: PyTree,
    *,
    policy: Callable[..., bool] | None = None,
) -> PyTree:
    """``x = layer_fn(gather(params[i]), x)`` for each of the stacked layers ``params[i]``.

    The gather sits inside ``jax.checkpoint`` (with ``policy``, default: save only the layer's
    input), so no gathered layer outlives its use: the backward pass gathers it again.

    Example::

        h = scan_layers(gather, block, params["layers"], h)
    """

    def one(p, h):
        return layer_fn(gather(p), h)

    one = jax.checkpoint(one, policy=policy)
    return lax.scan(lambda h, p: (one(p, h), None), x, params)[0]


def loop_layers(
    gather: Gather,
    layer_fn: Callable[[PyTree, PyTree], PyTree],
    params: Sequence[PyTree],
    x: PyTree,
    *,
    policy: Callable[..., bool] | None = None,
) -> PyTree:
    """:func:`scan_layers` for a list of (unstacked) layers: a Python loop, one gather each.

    Example::

        h = loop_layers(gather, block, [params["layers"][i] for i in range(n)], h)
    """

    def one(p, h):
        return layer_fn(gather(p), h)

    # Unrolled, plain jax.checkpoint would be merged back into the forward by XLA (every
    # gathered layer kept): tie each recomputation to its layer's backward.
    one = checkpoint_in_order(one, policy=policy, tie_params=True)
    for p in params:
        x = one(p, x)
    return x


def value_and_grad(
    loss_fn: Callable[..., jax.Array],
    params: PyTree,
    specs: PyTree,
    *batch: jax.Array,
    axis: str = "fsdp",
    batch_axes: Sequence[str] = ("dp",),
    grad_accum: int = 1,
    dtype: Any = None,
    reduce_dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[jax.Array, PyTree]:
    """``(loss, grads)`` of ``loss_fn(gather, params, *batch)`` under explicit ZeRO-3 FSDP.

    Args:
      loss_fn: the mean loss over the rows of ``batch`` it is given; it calls ``gather`` (a
        :class:`Gather`) on each subtree of ``params`` right before use, e.g. through
        :func:`scan_layers` for stacked layers. It runs manual over ``axis`` and
        ``batch_axes`` (it sees its own rows of ``batch``); other axes stay with XLA.
      params: the parameters, global arrays sharded over ``axis`` as ``specs`` says.
      specs: a ``PartitionSpec`` per leaf of ``params``; only where it places ``axis``
        matters (:func:`fsdp_dim`), the other axes are left to XLA.
      batch: arrays with a leading batch dim, split over ``(*batch_axes, axis)``.
      grad_accum: microbatches per step; their gradients are summed full-size and reduced
        once (one reduce-scatter per leaf per step).
      dtype: compute dtype the parameters are gathered in (default: their own).
      reduce_dtype: dtype of the gradient reductions (default float32; ``None``: the
        gradient's own).
      mesh: explicit mesh, else the ``jax.set_mesh`` context mesh.

    Returns:
      the mean loss over the whole batch (replicated) and gradients sharded like ``params``.
      Without ``axis`` in the mesh this is ``jax.value_and_grad`` of the plain loss.

    Example::

        loss, grads = value_and_grad(loss_fn, params, specs, tokens, targets, dtype=jnp.bfloat16)
    """
    if grad_accum < 1:
        raise ValueError(f"fsdp value_and_grad: grad_accum={grad_accum} must be >= 1")
    if axis_size(axis, mesh) == 1 and manual_axes(mesh) == frozenset():
        return _unsharded(loss_fn, params, batch, grad_accum, dtype)
    if manual_axes(mesh) & {axis, *batch_axes}:
        raise ValueError(
            f"fsdp value_and_grad: mesh axes {sorted(manual_axes(mesh) & {axis, *batch_axes})} "
            "are already manual (called inside a shard_map over them)"
        )
    m = mesh_or_context(mesh)
    batch_axes = tuple(a for a in batch_axes if a in m.axis_names and a != axis)
    data = (*batch_axes, axis)
    shards = _data_shards(batch, data, grad_accum, mesh)
    dims = jax.tree.map(  # one spec per leaf (specs may stop at framework boxes)
        lambda s, sub: jax.tree.map(lambda _: fsdp_dim(s, axis), sub), specs, params,
        is_leaf=_is_spec,
    )
    _check_dims(params, dims, axis, axis_size(axis, mesh))
    param_specs = jax.tree.map(
        lambda a, d: P() if d is None else P(*(axis if i == d else None for i in range(a.ndim))),
        params, dims,
    )
    gather = Gather(axis, batch_axes, dtype, reduce_dtype)

    def body(params, *batch):
        wrap = functools.partial(_wrap, params, dims)
        if grad_accum == 1:
            def local(params):
                return loss_fn(gather, wrap(params, None), *batch) / shards

            loss, grads = jax.value_and_grad(local)(params)
        else:
            loss, grads = _accumulate(loss_fn, gather, params, dims, batch, grad_accum, shards,
                                      wrap, reduce_dtype)
        return lax.psum(loss, data), grads

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, *(P(data) for _ in batch)),
        out_specs=(P(), param_specs),
        axis_names=set(data),
    )(params, *batch)


def _accumulate(loss_fn, gather, params, dims, batch, k, shards, wrap, reduce_dtype):
    """Sum of the microbatches' unreduced gradients (the sinks'), reduced once at the end."""
    def full(a, d):
        shape = list(a.shape)
        if d is not None:
            shape[d] *= axis_size(gather.axis)
        z = jnp.zeros(shape, reduce_dtype or a.dtype)
        return lax.pcast(z, (gather.axis, *gather.batch_axes), to="varying")

    sinks = jax.tree.map(full, params, dims)
    micro = jax.tree.map(lambda a: to_microbatches(a, k), batch)

    def step(carry, mb):
        loss_sum, acc = carry

        def local(sinks):
            return loss_fn(gather, wrap(params, sinks), *mb) / (shards * k)

        loss, g = jax.value_and_grad(local)(sinks)
        return (loss_sum + loss, jax.tree.map(jnp.add, acc, g)), None

    zero = lax.pcast(jnp.zeros((), jnp.float32), (gather.axis, *gather.batch_axes), to="varying")
    (loss, acc), _ = lax.scan(step, (zero, sinks), micro)
    grads = jax.tree.map(lambda g, a, d: gather.reduce(g, d, a.dtype), acc, params, dims)
    return loss, grads


def _wrap(params, dims, values, sinks):
    """The parameters as ``loss_fn`` sees them: ``_Leaf`` nodes (``values`` replace the shards;
    ``sinks`` are the accumulation buffers or ``None``)."""
    sinks = jax.tree.map(lambda _: None, params) if sinks is None else sinks
    return jax.tree.map(
        lambda a, s, d: _Leaf(a, s, None if d is None else d - a.ndim),
        values, sinks, dims, is_leaf=lambda x: x is None,
    )


def _unsharded(loss_fn, params, batch, k, dtype):
    """No ``axis`` in the mesh: the plain value and gradient (``gather`` only casts)."""
    gather = Gather(None, (), dtype, None)

    def one(params, *mb):
        return loss_fn(gather, params, *mb)

    if k == 1:
        return jax.value_and_grad(one)(params, *batch)

    def step(carry, mb):
        loss, g = jax.value_and_grad(one)(params, *mb)
        return jax.tree.map(jnp.add, carry, (loss, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = lax.scan(step, zeros, [to_microbatches(a, k) for a in batch])
    return loss / k, jax.tree.map(lambda g: g / k, grads)


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.floating)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def _data_shards(batch, data, k, mesh) -> int:
    n = 1
    for a in data:
        n *= axis_size(a, mesh)
    for i, b in enumerate(batch):
        if b.ndim == 0 or b.shape[0] % (n * k):
            raise ValueError(
                f"fsdp value_and_grad: batch argument {i} of shape {tuple(b.shape)} needs a "
                f"leading dim divisible by the data axes {data} ({n} shards) x grad_accum {k}"
            )
    return n


def _check_dims(params, dims, axis, n):
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_d = jax.tree.leaves(dims, is_leaf=lambda x: x is None)
    if len(flat_p) != len(flat_d):
        raise ValueError(
            f"fsdp value_and_grad: specs has {len(flat_d)} leaves, params {len(flat_p)}"
        )
    for (path, a), d in zip(flat_p, flat_d):
        if d is not None and (d >= a.ndim or a.shape[d] % n):
            raise ValueError(
                f"fsdp value_and_grad: params leaf {jax.tree_util.keystr(path)} of shape "
                f"{tuple(a.shape)} cannot be split on dim {d} over mesh axis {axis!r} of size {n}"
            )
