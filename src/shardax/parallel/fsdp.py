"""Explicit ZeRO-3 FSDP: each layer's parameters are gathered right before use and its gradient
is reduce-scattered as soon as it exists, inside one ``jax.shard_map`` over the data axes.

XLA's partitioner, given FSDP shardings, is free to gather every parameter up front and to form
gradients full-size before reducing them; on CPU it never emits a reduce-scatter. Here the
communication is written out, so peak memory and bytes moved follow ZeRO-3 on any backend:

* the loss runs manual over ``axis`` (``'fsdp'``) and ``batch_axes`` (``'dp'``: parameters are
  replicated over it, HSDP); every other mesh axis stays with XLA (Auto), so tensor
  parallelism from sharding rules composes. ``shard_map`` blocks over another axis inside
  ``loss_fn`` (explicit TP/SP) do not lower in JAX 0.10: Shardy rejects the residuals of a
  differentiated manual computation nested in this one
  (https://github.com/jax-ml/jax/pull/26588). So an axis that parallel code inside
  communicates over is made manual here too: ``seq_axes`` (``'cp'``) split the batch's
  sequence dim, and ring attention, finding 'cp' already manual, runs its body directly;
* :meth:`Gather.__call__` all-gathers a subtree (cast to the compute ``dtype`` first, so bf16
  compute moves bf16) in one ``all_gather`` of its shards flattened into one buffer, as FSDP2
  gathers a module. Its backward is one ``psum_scatter`` over ``axis`` in ``reduce_dtype``
  (then a ``psum`` over ``batch_axes``); replicated leaves get one ``psum`` each;
* :func:`scan_layers` (:func:`loop_layers` for a list of layers) runs the layers, gathering
  layer ``i`` inside a ``jax.checkpoint``: the gathered copy is not kept for the backward
  pass, which gathers it again, and layer ``i``'s gradient is reduce-scattered before layer
  ``i-1``'s backward runs; :func:`loop_layers` with ``prefetch=True`` (full remat) gathers
  layer ``i+1`` before layer ``i`` computes, re-gathers layer ``i-1`` before layer ``i``'s
  backward (one more gathered layer live);
* a subtree gathered once and used twice (a tied embedding) has one gradient reduction;
* with ``grad_accum > 1`` each microbatch's gradient is reduce-scattered as it is formed and
  summed into a float32 accumulator sharded like the parameters (no full-size buffer);
* a leaf's spec over the other mesh axes (e.g. 'tp' from sharding rules) is kept through its
  gather and its reduction: a tensor-parallel shard is all-gathered over ``axis`` alone.

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
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax.parallel._stages import to_microbatches
from shardax.parallel.axes import axis_size, manual_axes, mesh_or_context
from shardax.parallel.remat import checkpoint_in_order, tie, zero_of

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
    """A parameter inside the region: its shard and, as static data, the sharded dim counted
    from the end (so it survives slicing off a leading layer axis) and the spec entries of the
    other, non-manual mesh axes (one per dim, also read from the end; None: no such axis) and
    ``owned``, the other manual axes it is split over (experts over 'ep': each device holds
    its own, so they are neither cast to varying nor summed over them)."""

    def __init__(self, shard, dim, auto=None, owned=()):
        self.shard, self.dim, self.auto, self.owned = shard, dim, auto, owned

    def tree_flatten(self):
        return (self.shard,), (self.dim, self.auto, self.owned)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, *static)


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
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_leaf)
        return treedef.unflatten(self._by_bucket(
            leaves, lambda i: self._one(leaves[i]),
            lambda dims, owned, idx: _gather_bucket(self, dims, owned,
                                                    tuple(leaves[i].shard for i in idx))))

    def _by_bucket(self, leaves: list, one: Callable[[int], Any],
                   bucket: Callable[[tuple, tuple, list[int]], Sequence[Any]]) -> list:
        """``one(i)`` for each leaf ``i`` gathered on its own, and the results of
        ``bucket(dims, owned, indices)`` (in ``indices``' order) for the leaves gathered
        together (`_gather_bucket`): one bucket per ``owned`` axes and gathered dtype."""
        buckets: dict[tuple, list[int]] = {}
        for i, x in enumerate(leaves):
            if _bucketed(x):
                buckets.setdefault((x.owned, self._dtype(x.shard)), []).append(i)
        out = [None if _bucketed(x) else one(i) for i, x in enumerate(leaves)]
        for (owned, _), idx in buckets.items():
            dims = tuple(_placement(leaves[i])[0] for i in idx)
            for i, y in zip(idx, bucket(dims, owned, idx)):
                out[i] = y
        return out

    def _dtype(self, x) -> Any:
        """The dtype ``x`` is gathered in: the compute dtype for floats (if there is one)."""
        return jnp.dtype(self.dtype) if self.dtype and _is_float(x) else x.dtype

    def _cast(self, x):
        """``x`` in the dtype it is gathered in (`_dtype`; unchanged if it already is)."""
        dtype = self._dtype(x)
        return x if dtype == x.dtype else x.astype(dtype)

    def _replicas(self, owned: tuple[str, ...]) -> tuple[str, ...]:
        """The batch axes a parameter is replicated over (not split over, unlike ``owned``)."""
        return tuple(a for a in self.batch_axes if a not in owned)

    def local(self, tree: PyTree) -> PyTree:
        """This device's shards of ``tree``'s parameters, as they are (no communication)."""
        return jax.tree.map(lambda x: x.shard if _is_leaf(x) else x, tree, is_leaf=_is_leaf)

    def _one(self, leaf):
        if not _is_leaf(leaf):  # no FSDP axis: a plain array, only cast
            return self._cast(leaf)
        return _gather_rs(self, *_placement(leaf), leaf.shard)

    def all_gather(self, shard, dim, auto=None, owned=()):
        """Forward: cast, all-gather over ``axis``, vary over the batch axes. ``auto``: the
        spec over the other (non-manual) axes, which the gathered array keeps: a
        tensor-parallel shard is gathered over ``axis`` alone, never over 'tp'. ``owned``:
        manual axes the shard is split over besides ``axis`` (it already varies over them)."""
        x = _keep(self._cast(shard), auto)
        replicas = self._replicas(owned)
        if dim is not None:
            x = (lax.all_gather(x, self.axis, axis=dim, tiled=True) if auto is None
                 else _ring_all_gather(x, self.axis, dim, auto))
            return lax.pcast(x, replicas, to="varying") if replicas else x
        return lax.pcast(x, (self.axis, *replicas), to="varying")

    def reduce(self, g, dim, dtype, auto=None, owned=()):
        """Backward: the gradient of the full array summed over devices, this device's shard
        (kept on ``auto``, as in `all_gather`; not summed over the ``owned`` axes)."""
        g = _keep(g.astype(self.reduce_dtype or g.dtype), auto)
        replicas = self._replicas(owned)
        if dim is not None:
            g = (lax.psum_scatter(g, self.axis, scatter_dimension=dim, tiled=True)
                 if auto is None else _ring_reduce_scatter(g, self.axis, dim, auto))
            if replicas:
                g = lax.psum(g, replicas)
        else:
            g = lax.psum(g, (self.axis, *replicas))
        return g.astype(dtype)


def _placement(leaf: _Leaf) -> tuple[int | None, P | None, tuple[str, ...]]:
    """``(dim, auto, owned)`` of a parameter's shard as it is now (a stacked layer's slice or
    not): the dimension split over the FSDP axis, the spec over the other axes and the other
    manual axes the shard is split over."""
    dim = None if leaf.dim is None else leaf.shard.ndim + leaf.dim
    auto = None if leaf.auto is None else leaf.auto[len(leaf.auto) - leaf.shard.ndim:]
    # A slice of stacked layers drops the layer dim's entry ('pp'): nothing may be left.
    auto = P(*auto) if auto is not None and any(e is not None for e in auto) else None
    return dim, auto, leaf.owned


def _keep(x, auto):
    """``x`` constrained to ``auto`` (the spec over the non-manual axes), if there is one."""
    return x if auto is None else lax.with_sharding_constraint(x, auto)


# XLA's Shardy partitioner replicates the non-manual axes around an all-gather or a
# reduce-scatter inside a partially manual region (see shardax.parallel.tensor): a 'tp' shard
# would be gathered over 'tp' first. A ring of ppermutes is left alone and moves the same
# bytes as the ring algorithm of those collectives (n - 1 shard-sized hops).

def _ring_all_gather(x, axis, dim, auto):
    """``all_gather(x, axis, axis=dim, tiled=True)`` as n - 1 ppermute hops, on ``auto``."""
    n, i = axis_size(axis), lax.axis_index(axis)
    size = x.shape[dim]
    shape = list(x.shape)
    shape[dim] *= n
    out = _keep(lax.dynamic_update_slice_in_dim(
        _keep(jnp.zeros(shape, x.dtype), auto), x, i * size, dim), auto)
    right = [(j, (j + 1) % n) for j in range(n)]
    for t in range(1, n):
        x = _keep(lax.ppermute(x, axis, right), auto)  # the shard of device i - t
        out = _keep(lax.dynamic_update_slice_in_dim(out, x, ((i - t) % n) * size, dim), auto)
    return out


def _ring_reduce_scatter(g, axis, dim, auto):
    """``psum_scatter(g, axis, scatter_dimension=dim, tiled=True)`` as n - 1 ppermute hops:
    device i's partial sum of chunk ``i - 1 - t`` travels right, gaining each device's term,
    and after n - 1 hops device i holds the sum of its own chunk i."""
    n, i = axis_size(axis), lax.axis_index(axis)
    size = g.shape[dim] // n

    def chunk(c):
        return _keep(lax.dynamic_slice_in_dim(g, (c % n) * size, size, dim), auto)

    acc = chunk(i - 1)
    right = [(j, (j + 1) % n) for j in range(n)]
    for t in range(1, n):
        acc = _keep(lax.ppermute(acc, axis, right), auto) + chunk(i - 1 - t)
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather_rs(g: Gather, dim, auto, owned, shard):
    return g.all_gather(shard, dim, auto, owned)


def _gather_rs_fwd(g, dim, auto, owned, shard):
    return g.all_gather(shard, dim, auto, owned), jnp.zeros((), shard.dtype)


def _gather_rs_bwd(g, dim, auto, owned, like, ct):
    return (g.reduce(ct, dim, like.dtype, auto, owned),)


_gather_rs.defvjp(_gather_rs_fwd, _gather_rs_bwd)


def _bucketed(x) -> bool:
    """Gathered with the other such leaves of its call in one all-gather (and reduced in one
    reduce-scatter): split over the FSDP axis, on no other non-manual axis."""
    return _is_leaf(x) and x.dim is not None and _placement(x)[1] is None


# One all-gather and one reduce-scatter per ``gather(tree)`` call (a layer), over the leaves'
# shards flattened into one buffer, as FSDP2 gathers a module's parameters (its copy-in /
# copy-out). A collective per leaf synchronises every device once per leaf, which costs more
# than the copies where devices share cores: llama-small's CLI step on fsdp=8 with full remat
# (8 CPU devices on 2 cores) ran at 0.946x the tokens/s of the partitioner's program with
# 7 reduce-scatters a layer, 1.013x with one (40 paired rounds); llama-8b's plan moves the same
# bytes with the same peak (87.0 GiB on fsdp=8 at sequence 8192).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gather_bucket(g: Gather, dims, owned, shards):
    return _gather_bucket_fwd(g, dims, owned, shards)[0]


def _gather_bucket_fwd(g, dims, owned, shards):
    n = lax.axis_size(g.axis)
    flat = jnp.concatenate([g._cast(s).reshape(-1) for s in shards])
    whole = lax.all_gather(flat, g.axis, axis=0, tiled=False)  # [n, sum of shard sizes]
    replicas = g._replicas(owned)
    if replicas:
        whole = lax.pcast(whole, replicas, to="varying")
    out, start = [], 0
    for s, dim in zip(shards, dims):
        part = whole[:, start:start + s.size].reshape(n, *s.shape)
        start += s.size
        full = s.shape[:dim] + (n * s.shape[dim],) + s.shape[dim + 1:]
        out.append(jnp.moveaxis(part, 0, dim).reshape(full))
    return tuple(out), tuple(jnp.zeros((), s.dtype) for s in shards)


def _gather_bucket_bwd(g, dims, owned, likes, cts):
    n = lax.axis_size(g.axis)
    parts = []
    for ct, dim in zip(cts, dims):
        ct = ct.astype(g.reduce_dtype or ct.dtype)
        split = ct.shape[:dim] + (n, ct.shape[dim] // n) + ct.shape[dim + 1:]
        parts.append(jnp.moveaxis(ct.reshape(split), dim, 0).reshape(n, -1))
    summed = lax.psum_scatter(jnp.concatenate(parts, axis=1), g.axis, scatter_dimension=0,
                              tiled=False)  # this device's row: [sum of shard sizes]
    replicas = g._replicas(owned)
    if replicas:
        summed = lax.psum(summed, replicas)
    out, start = [], 0
    for ct, like, dim in zip(cts, likes, dims):
        shape = ct.shape[:dim] + (ct.shape[dim] // n,) + ct.shape[dim + 1:]
        size = math.prod(shape)
        out.append(summed[start:start + size].reshape(shape).astype(like.dtype))
        start += size
    return (tuple(out),)


_gather_bucket.defvjp(_gather_bucket_fwd, _gather_bucket_bwd)




def scan_layers(
    gather: Gather,
    layer_fn: Callable[[PyTree, PyTree], PyTree],
    params: PyTree,
    x: PyTree,
    *,
    policy: Callable[..., bool] | None = None,
    reshard_after_forward: bool = True,
) -> PyTree:
    """``x = layer_fn(gather(params[i]), x)`` for each of the stacked layers ``params[i]``.

    The gather sits inside ``jax.checkpoint`` (with ``policy``, default: save only the layer's
    input), so no gathered layer outlives its use: the backward pass gathers it again and
    recomputes the layer. ``reshard_after_forward=False`` (FSDP2's name): no checkpoint, the
    gathered layers and activations are kept for the backward pass (no second gather, no
    recomputed forward; the whole model's gathered parameters live at once).

    Example::

        h = scan_layers(gather, block, params["layers"], h)
    """
    one = _layer(gather, layer_fn, policy, reshard_after_forward)
    return lax.scan(lambda h, p: (one(p, h), None), x, params)[0]


def _layer(gather, layer_fn, policy, reshard_after_forward, unrolled=False):
    """One layer, gathering its parameters first; checkpointed when it reshards. Unrolled in
    a Python loop, plain ``jax.checkpoint`` would be merged back into the forward by XLA (and
    every layer's gather hoisted): each recomputation and gather is tied to its layer."""

    def one(p, h):
        return layer_fn(gather(p), h)

    if not reshard_after_forward:
        return one
    if unrolled:
        return checkpoint_in_order(one, policy=policy, tie_params=True)
    return jax.checkpoint(one, policy=policy)


def loop_layers(
    gather: Gather,
    layer_fn: Callable[[PyTree, PyTree], PyTree],
    params: Sequence[PyTree],
    x: PyTree,
    *,
    policy: Callable[..., bool] | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = False,
) -> PyTree:
    """:func:`scan_layers` for a list of (unstacked) layers: a Python loop, one gather each.

    With ``prefetch``, resharding with the default ``policy`` (save only each layer's input),
    the gathers are prefetched: layer ``i + 1`` is gathered before layer ``i`` computes, and in
    the backward pass layer ``i - 1`` is re-gathered before layer ``i``'s backward, so one more
    gathered layer is live than without prefetch (two in all). Off by default: its one
    ``custom_vjp`` over the loop held 1.4x the temporaries of the per-layer path on llama-8b at
    32k tokens (XLA schedules the recomputations' working sets less tightly).

    Example::

        h = loop_layers(gather, block, [params["layers"][i] for i in range(n)], h)
    """
    params = list(params)
    if prefetch and reshard_after_forward and policy is None and len(params) > 1:
        return _prefetched(gather, layer_fn, params, x)
    one = _layer(gather, layer_fn, policy, reshard_after_forward, unrolled=True)
    for p in params:
        x = one(p, x)
    return x


def _gathered_after(gather, p, zero):
    """``gather(p)``, issued once ``zero`` exists: only the leaves that are really gathered
    (split over the FSDP axis) wait; a replicated leaf's "gather" moves nothing."""
    waits = jax.tree.map(lambda leaf: _is_leaf(leaf) and leaf.dim is not None, p,
                         is_leaf=_is_leaf)
    return gather(jax.tree.map(lambda leaf, w: tie(leaf, zero) if w else leaf, p, waits,
                               is_leaf=_is_leaf))


def _reduced(gather, p, dg):
    """The gradient of ``p``'s shards from ``dg``, the gradient of ``gather(p)``: what the
    gather's own backward computes (one reduce-scatter per bucket)."""
    leaves, treedef = jax.tree.flatten(p, is_leaf=_is_leaf)
    cts = treedef.flatten_up_to(dg)

    def one(leaf, g):
        if not _is_leaf(leaf):  # no FSDP axis: the gather only cast
            return g.astype(leaf.dtype) if _is_float(leaf) else g
        dim, auto, owned = _placement(leaf)
        return gather.reduce(g, dim, leaf.shard.dtype, auto, owned)

    out = gather._by_bucket(
        leaves, lambda i: one(leaves[i], cts[i]),
        lambda dims, owned, idx: _gather_bucket_bwd(
            gather, dims, owned, tuple(leaves[i].shard for i in idx),
            tuple(cts[i] for i in idx))[0])
    return treedef.unflatten([
        _Leaf(g, x.dim, x.auto, x.owned) if _is_leaf(x) else g for x, g in zip(leaves, out)])


def _prefetched(gather, layer_fn, params, x):
    """``loop_layers`` with full remat and prefetched gathers: one ``jax.custom_vjp`` over the
    whole loop, which saves each layer's input only. The order is data, not a hint:
    layer ``i + 1``'s gather waits for layer ``i``'s input and layer ``i``'s compute waits
    for that gather (backward: layer ``i - 1``'s re-gather waits for layer ``i``'s incoming
    cotangent, layer ``i``'s recomputation for that re-gather, and layer ``i - 1``'s
    backward for layer ``i``'s reduce-scatters)."""
    # layer_fn may close over traced values (positions, segment ids): hoisted into arguments,
    # once per distinct layer signature (identical layers share one conversion).
    converted, kinds = {}, []
    for p in params:
        key = (jax.tree.structure(p), tuple((a.shape, a.dtype) for a in jax.tree.leaves(p)))
        if key not in converted:
            converted[key] = jax.closure_convert(layer_fn, gather(p), x)
        kinds.append(list(converted).index(key))
    fns = [f for f, _ in converted.values()]
    consts = [c for _, c in converted.values()]
    n = len(params)

    def closed(i, g, x, consts):
        return fns[kinds[i]](g, x, *consts[kinds[i]])

    def run(params, x, consts):
        inputs = []
        g = _gathered_after(gather, params[0], zero_of(x))
        for i in range(n):
            inputs.append(x)
            if i + 1 < n:
                g_next = _gathered_after(gather, params[i + 1], zero_of(x))
                x = tie(x, zero_of(g_next))  # layer i runs after layer i + 1's gather
            x = closed(i, g, x, consts)
            g = g_next if i + 1 < n else None
        return x, inputs

    @jax.custom_vjp
    def stack(params, x, consts):
        return run(params, x, consts)[0]

    def forward(params, x, consts):
        out, inputs = run(params, x, consts)
        return out, (params, inputs, consts)

    def backward(saved, ct):
        params, inputs, consts = saved
        grads = [None] * n
        g = _gathered_after(gather, params[n - 1], zero_of(ct))
        dconsts = None
        for i in reversed(range(n)):
            zero = zero_of(ct)
            x = tie(inputs[i], zero)  # the recomputation waits for the cotangent
            if i > 0:
                g_prev = _gathered_after(gather, params[i - 1], zero)
                x = tie(x, zero_of(g_prev))  # and for layer i - 1's re-gather
            _, pullback = jax.vjp(functools.partial(closed, i), g, x, consts)
            dg, ct, dc = pullback(ct)
            grads[i] = _reduced(gather, params[i], dg)
            dconsts = dc if dconsts is None else jax.tree.map(_add, dconsts, dc)
            # layer i's gradients are reduce-scattered before layer i - 1's backward starts
            ct = tie(ct, zero_of(grads[i]))
            g = g_prev if i > 0 else None
        return grads, ct, dconsts

    stack.defvjp(forward, backward)
    return stack(params, x, consts)


def _add(a, b):
    """``a + b`` for cotangents (an integer input's cotangent, float0, has no sum)."""
    return a if a.dtype == jax.dtypes.float0 else a + b


def value_and_grad(
    loss_fn: Callable[..., jax.Array],
    params: PyTree,
    specs: PyTree,
    *batch: jax.Array,
    axis: str = "fsdp",
    batch_axes: Sequence[str] = ("dp",),
    seq_axes: Sequence[str] = (),
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
      seq_axes: mesh axes (e.g. ``('cp',)``) that split the batch arrays' second (sequence)
        dim; the region is manual over them too, so code inside that communicates over them
        (ring attention) runs its body directly. Parameters are replicated over them and
        their gradients summed over them, like a batch axis.
      grad_accum: microbatches per step; each one's gradients are reduce-scattered and
        summed into a sharded float32 accumulator.
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
    if manual_axes(mesh) & {axis, *batch_axes, *seq_axes}:
        raise ValueError(
            "fsdp value_and_grad: mesh axes "
            f"{sorted(manual_axes(mesh) & {axis, *batch_axes, *seq_axes})} "
            "are already manual (called inside a shard_map over them)"
        )
    m = mesh_or_context(mesh)
    batch_axes = tuple(a for a in batch_axes if a in m.axis_names and a != axis)
    seq_axes = tuple(a for a in seq_axes if a in m.axis_names and a not in (axis, *batch_axes))
    data = (*batch_axes, axis)
    manual = (*data, *seq_axes)
    shards = _data_shards(batch, data, grad_accum, mesh, seq_axes)
    dims = jax.tree.map(  # one spec per leaf (specs may stop at framework boxes)
        lambda s, sub: jax.tree.map(lambda _: fsdp_dim(s, axis), sub), specs, params,
        is_leaf=_is_spec,
    )
    _check_dims(params, dims, axis, axis_size(axis, mesh))
    owned = jax.tree.map(  # the other manual axes a leaf is split over ('ep' for experts)
        lambda s, sub: jax.tree.map(lambda a: _owned(s, a.ndim, manual, axis), sub), specs,
        params, is_leaf=_is_spec,
    )
    param_specs = jax.tree.map(
        lambda a, d, own: P(*((axis if i == d else own[i]) for i in range(a.ndim))),
        params, dims, owned, is_leaf=lambda x: x is None,
    )
    autos = jax.tree.map(  # the other axes' spec entries, kept through gathers
        lambda s, sub: jax.tree.map(lambda a: _auto(s, a.ndim, manual, m), sub), specs, params,
        is_leaf=_is_spec,
    )
    # Parameters are replicated over the sequence axes: their gradients sum over them too.
    gather = Gather(axis, (*batch_axes, *seq_axes), dtype, reduce_dtype)

    def body(params, *batch):
        def local(params, *mb):
            return (loss_fn(gather, _wrap(params, dims, autos, owned), *mb)
                    / (shards * grad_accum))

        if grad_accum == 1:
            loss, grads = jax.value_and_grad(local)(params, *batch)
        else:
            loss, grads = _accumulate(local, params, batch, grad_accum,
                                      (gather.axis, *gather.batch_axes))
        return lax.psum(loss, manual), grads

    rows = P(data, seq_axes) if seq_axes else P(data)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, *(rows for _ in batch)),
        out_specs=(P(), param_specs),
        axis_names=set(manual),
    )(params, *batch)


def _accumulate(local, params, batch, k, manual):
    """The microbatches' gradients, each reduce-scattered as it is formed (by the gathers'
    backward) and summed into a float32 accumulator sharded like ``params``: no full-size
    gradient buffer outlives a layer's backward."""
    micro = jax.tree.map(lambda a: to_microbatches(a, k), batch)

    def step(carry, mb):
        loss_sum, acc = carry
        loss, g = jax.value_and_grad(local)(params, *mb)
        return (loss_sum + loss, jax.tree.map(lambda s, x: s + x.astype(s.dtype), acc, g)), None

    zero = lax.pcast(jnp.zeros((), jnp.float32), manual, to="varying")
    acc = jax.tree.map(lambda a: jnp.zeros_like(a, _acc_dtype(a)), params)  # same vma
    (loss, acc), _ = lax.scan(step, (zero, acc), micro)
    return loss, jax.tree.map(lambda g, a: g.astype(a.dtype), acc, params)


def _acc_dtype(a):
    return jnp.float32 if _is_float(a) else a.dtype


def _wrap(values, dims, autos, owned):
    """The parameters as ``loss_fn`` sees them: ``_Leaf`` nodes of this device's shards."""
    return jax.tree.map(
        lambda a, d, auto, own: _Leaf(a, None if d is None else d - a.ndim, auto,
                                      tuple(x for x in own if x is not None)),
        values, dims, autos, owned, is_leaf=lambda x: x is None,
    )


def _owned(spec, ndim, manual, axis):
    """Per dim of a leaf, the one manual axis other than ``axis`` its ``spec`` splits it over
    (None where there is none); ValueError for a dim split over several."""
    entries = []
    for d in range(ndim):
        e = spec[d] if spec is not None and d < len(spec) else None
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        own = tuple(a for a in axes if a in manual and a != axis)
        if len(own) > 1 or (own and axis in axes):
            raise ValueError(f"fsdp value_and_grad: a parameter spec {spec} splits dim {d} "
                             f"over several manual axes {axes}")
        entries.append(own[0] if own else None)
    return tuple(entries)


def _auto(spec, ndim, manual, mesh):
    """Per dim of a leaf, its ``spec`` entry over the mesh's other axes of size > 1 (the ones
    XLA keeps); None where there are none."""
    entries = []
    for d in range(ndim):
        e = spec[d] if spec is not None and d < len(spec) else None
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        axes = tuple(a for a in axes if a not in manual and axis_size(a, mesh) > 1)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(entries) if any(e is not None for e in entries) else None


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


def _data_shards(batch, data, k, mesh, seq_axes=()) -> int:
    """How many pieces the batch is split into (rows over ``data`` times the sequence over
    ``seq_axes``); ValueError naming the argument whose shape does not split."""
    n = math.prod(axis_size(a, mesh) for a in data)
    s = math.prod(axis_size(a, mesh) for a in seq_axes)
    for i, b in enumerate(batch):
        if b.ndim == 0 or b.shape[0] % (n * k):
            raise ValueError(
                f"fsdp value_and_grad: batch argument {i} of shape {tuple(b.shape)} needs a "
                f"leading dim divisible by the data axes {data} ({n} shards) x grad_accum {k}"
            )
        if seq_axes and (b.ndim < 2 or b.shape[1] % s):
            raise ValueError(
                f"fsdp value_and_grad: batch argument {i} of shape {tuple(b.shape)} needs a "
                f"second dim divisible by the sequence axes {seq_axes} ({s} shards)"
            )
    return n * s


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
