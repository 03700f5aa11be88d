"""Tensor parallelism (Megatron) as plain functions of ``(x, w[, b])``.

Weights always live in their *global logical layout* ``w[in, out]``; the functions shard them
over one mesh axis (default ``'tp'``) with a partial-manual ``jax.shard_map``, leaving every
other mesh axis (``dp``, ``fsdp``, ...) to XLA. So the same code and the same parameter tree run

* on one device (no mesh, or no ``tp`` axis, or ``tp`` of size 1): plain ``x @ w + b``;
* ``mode='sync'``: Megatron TP (column = no communication, row = all-reduce);
* ``sequence_parallel=True``: Megatron-SP (column starts with an all-gather over the sequence,
  row ends with a reduce-scatter over the sequence);
* ``mode='async'`` / ``'async_bidi'``: the SP collectives become ``ppermute`` rings interleaved
  with per-chunk matmuls (collective matmul), uni- or bidirectional.

Example::

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w1, w2: tp_mlp(x, w1, w2, mode="async"))(x, w1, w2)

Attention with heads split over ``tp``: ``q, k, v = column_parallel(x, wq), ...`` with
``wq[d_model, heads * head_dim]`` (heads major, ``heads % tp == 0``), reshape to
``[..., heads, head_dim]``, attend, reshape back and ``row_parallel(o, wo)``.

Every block takes ``mesh=`` (default: the ``jax.set_mesh`` context mesh), as the other
``shardax.parallel`` blocks do.

``batch_axes=('dp',)`` makes the mesh axes that shard ``x``'s leading (batch) dim manual as
well. Only sync sequence parallelism needs it: XLA's Shardy partitioner replicates auto axes
around an all-gather / reduce-scatter inside a partially manual region, so a dp-sharded batch
would be gathered over ``dp`` first. ppermute and all-reduce (the other modes) do not do that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax.parallel.axes import axis_size, manual_axes

__all__ = ["Mode", "column_parallel", "row_parallel", "tp_mlp"]

Mode = Literal["sync", "async", "async_bidi"]
_MODES = ("sync", "async", "async_bidi")


def column_parallel(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    axis: str = "tp",
    mode: Mode = "sync",
    sequence_parallel: bool | None = None,
    seq_dim: int = -2,
    batch_axes: str | Sequence[str] = (),
    mesh: jax.sharding.Mesh | None = None,
) -> jax.Array:
    """Column-parallel dense ``x @ w + b`` with ``w[in, out]`` sharded on ``out`` over ``axis``.

    Input ``x[..., in]`` is replicated over ``axis`` (or, with sequence parallelism, sharded on
    ``seq_dim``); the output ``[..., out]`` is sharded on its last dim over ``axis``.
    ``sequence_parallel`` defaults to ``mode != 'sync'`` (async modes need it). ``batch_axes``:
    mesh axes that shard ``x``'s leading dim, made manual too (see module notes).

    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> x, w_in = jnp.ones((2, 8, 16)), jnp.ones((16, 32))  # x: [batch, seq, d]  w_in: [d, ffn]
    >>> with jax.set_mesh(mesh):
    ...     h = jax.jit(lambda x, w: column_parallel(x, w, mode="async"))(x, w_in)
    >>> bool(jnp.allclose(h, x @ w_in))
    True
    """
    sp, n = _setup("column_parallel", x, w, b, axis, mode, sequence_parallel, mesh)
    if n == 1:
        return _dense(x, w, b)
    sd = _seq_dim("column_parallel", x, seq_dim) if sp else None
    _divisible("column_parallel", "w", w.shape, 1, "out", axis, n)
    if sp:
        _divisible("column_parallel", "x", x.shape, sd, "sequence", axis, n)

    def body(x, w, *b):
        if mode == "sync":
            if sp:
                x = lax.all_gather(x, axis, axis=sd, tiled=True)
            y = x @ w
        else:
            y = _all_gather_matmul(x, w, axis, n, sd, mode == "async_bidi")
        return y + b[0] if b else y

    return _tp_map(
        "column_parallel",
        body,
        x,
        w,
        b,
        axis,
        batch_axes,
        mesh,
        x_dim=sd,
        w_spec=P(None, axis),
        b_spec=P(axis),
        out_dim=x.ndim - 1,
    )


def row_parallel(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    axis: str = "tp",
    mode: Mode = "sync",
    sequence_parallel: bool | None = None,
    seq_dim: int = -2,
    batch_axes: str | Sequence[str] = (),
    mesh: jax.sharding.Mesh | None = None,
) -> jax.Array:
    """Row-parallel dense ``x @ w + b`` with ``w[in, out]`` sharded on ``in`` over ``axis``.

    Input ``x[..., in]`` is sharded on its last dim over ``axis`` (the output of
    :func:`column_parallel`); the partial products are all-reduced (``sync``), reduce-scattered
    over ``seq_dim`` (sequence parallelism), or reduced along a ``ppermute`` ring (async).
    ``b`` is replicated and added once, after the reduction.

    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> h, w_out = jnp.ones((2, 8, 32)), jnp.ones((32, 16))  # h: [batch, seq, ffn]  w_out: [ffn, d]
    >>> with jax.set_mesh(mesh):
    ...     y = jax.jit(lambda h, w: row_parallel(h, w, mode="async"))(h, w_out)
    >>> bool(jnp.allclose(y, h @ w_out))
    True
    """
    sp, n = _setup("row_parallel", x, w, b, axis, mode, sequence_parallel, mesh)
    if n == 1:
        return _dense(x, w, b)
    sd = _seq_dim("row_parallel", x, seq_dim) if sp else None
    _divisible("row_parallel", "w", w.shape, 0, "in", axis, n)
    if sp:
        _divisible("row_parallel", "x", x.shape, sd, "sequence", axis, n)

    def body(x, w, *b):
        if mode == "sync":
            y = x @ w
            if sp:
                y = lax.psum_scatter(y, axis, scatter_dimension=sd, tiled=True)
            else:
                y = lax.psum(y, axis)
        else:
            y = _matmul_reduce_scatter(x, w, axis, n, sd, mode == "async_bidi")
        return y + b[0] if b else y

    return _tp_map(
        "row_parallel",
        body,
        x,
        w,
        b,
        axis,
        batch_axes,
        mesh,
        x_dim=x.ndim - 1,
        w_spec=P(axis, None),
        b_spec=P(),
        out_dim=sd,
    )


def tp_mlp(
    x: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    b_in: jax.Array | None = None,
    b_out: jax.Array | None = None,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    axis: str = "tp",
    mode: Mode = "sync",
    sequence_parallel: bool | None = None,
    seq_dim: int = -2,
    batch_axes: str | Sequence[str] = (),
    mesh: jax.sharding.Mesh | None = None,
) -> jax.Array:
    """Megatron MLP block: ``row_parallel(activation(column_parallel(x, w_in)), w_out)``.

    One all-reduce forward in ``sync`` mode; all-gather + reduce-scatter with sequence
    parallelism; only ``ppermute`` rings in the async modes. Output layout equals input layout.

    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> x = jnp.ones((2, 8, 16))                       # [batch, seq, d]
    >>> w_in, w_out = jnp.ones((16, 32)) / 16, jnp.ones((32, 16)) / 32
    >>> with jax.set_mesh(mesh):
    ...     y = jax.jit(lambda *a: tp_mlp(*a, mode="async_bidi"))(x, w_in, w_out)
    >>> bool(jnp.allclose(y, jax.nn.gelu(x @ w_in) @ w_out))
    True
    """
    kw = dict(
        axis=axis,
        mode=mode,
        sequence_parallel=sequence_parallel,
        seq_dim=seq_dim,
        batch_axes=batch_axes,
        mesh=mesh,
    )
    return row_parallel(activation(column_parallel(x, w_in, b_in, **kw)), w_out, b_out, **kw)


# --- collective matmuls --------------------------------------------------------------------


def _shift(x: jax.Array, axis: str, n: int, step: int) -> jax.Array:
    """Send ``x`` from tp rank ``i`` to rank ``i + step`` (mod ``n``)."""
    return lax.ppermute(x, axis, [(i, (i + step) % n) for i in range(n)])


def _ring_hops(n: int, bidirectional: bool) -> tuple[int, int]:
    """Hops (forward, backward) so that ``forward + backward == n - 1`` chunks are visited."""
    return (n // 2, (n - 1) // 2) if bidirectional else (n - 1, 0)


def _all_gather_matmul(x, w, axis, n, sd, bidirectional):
    """``all_gather(x, sd) @ w`` as ``n`` chunk matmuls; chunks travel a ppermute ring.

    Forward ring: after ``k`` hops rank ``r`` holds chunk ``r - k``; backward: ``r + k``.
    Each matmul only needs the chunk already here, so it overlaps the next hop.
    """
    fwd, bwd = _ring_hops(n, bidirectional)
    r = lax.axis_index(axis)
    c = x.shape[sd]
    shape = x.shape[:sd] + (c * n,) + x.shape[sd + 1 : -1] + (w.shape[1],)
    y = jnp.zeros(shape, jnp.result_type(x.dtype, w.dtype))

    def put(y, chunk, src):
        return lax.dynamic_update_slice_in_dim(y, chunk @ w, (src % n) * c, axis=sd)

    # next_f / next_b are in flight while the chunk already here is multiplied
    next_f = _shift(x, axis, n, +1) if fwd else None
    next_b = _shift(x, axis, n, -1) if bwd else None
    y = put(y, x, r)
    for k in range(1, fwd + 1):
        xf, next_f = next_f, (_shift(next_f, axis, n, +1) if k < fwd else None)
        y = put(y, xf, r - k)
        if k <= bwd:
            xb, next_b = next_b, (_shift(next_b, axis, n, -1) if k < bwd else None)
            y = put(y, xb, r + k)
    return y


def _matmul_reduce_scatter(x, w, axis, n, sd, bidirectional):
    """``psum_scatter(x @ w, sd)`` as ``n`` chunk matmuls added into ring-travelling sums.

    The forward accumulator held by rank ``r`` after ``k`` hops collects chunk ``r + fwd - k``
    and ends (``k = fwd``) at its owner; the backward one collects chunk ``r - bwd + k``.
    """
    fwd, bwd = _ring_hops(n, bidirectional)
    r = lax.axis_index(axis)
    c = x.shape[sd] // n

    def part(t):
        return lax.dynamic_slice_in_dim(x, (t % n) * c, c, axis=sd) @ w

    acc_f = part(r + fwd)
    acc_b = part(r - bwd) if bwd else None
    for k in range(1, fwd + 1):
        acc_f = _shift(acc_f, axis, n, +1) + part(r + fwd - k)
        if k < bwd:
            acc_b = _shift(acc_b, axis, n, -1) + part(r - bwd + k)
    if bwd:
        acc_f = acc_f + _shift(acc_b, axis, n, -1)
    return acc_f


# --- checks and small helpers --------------------------------------------------------------


def _dense(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _spec(ndim: int, dim: int | None, axis: str, batch: tuple[str, ...] = ()) -> P:
    entries = [axis if i == dim else None for i in range(ndim)]
    if batch:
        entries[0] = batch if len(batch) > 1 else batch[0]
    return P(*entries)


def _tp_map(name, body, x, w, b, axis, batch_axes, mesh, *, x_dim, w_spec, b_spec, out_dim):
    """``shard_map(body)`` manual over ``axis`` (+ ``batch_axes`` on x's leading dim) only."""
    batch = _batch_axes(name, x, axis, batch_axes, (x_dim, out_dim), mesh)
    in_specs = (_spec(x.ndim, x_dim, axis, batch), w_spec) + ((b_spec,) if b is not None else ())
    args = (x, w) + ((b,) if b is not None else ())
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=_spec(x.ndim, out_dim, axis, batch),
        axis_names={axis, *batch},
    )(*args)


def _batch_axes(name, x, axis, batch_axes, tp_dims, mesh) -> tuple[str, ...]:
    """The ``batch_axes`` of the mesh with size > 1 that are not manual already (inside an
    enclosing ``shard_map`` x holds just its own rows of them); others are dropped, as for tp."""
    if isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    manual = manual_axes(mesh)
    batch = tuple(a for a in batch_axes if axis_size(a, mesh) > 1 and a not in manual)
    if not batch:
        return ()
    if axis in batch or 0 in tp_dims:
        raise ValueError(
            f"{name}: batch_axes={tuple(batch_axes)} shard x's leading dim, which must be a "
            f"batch dim distinct from the {axis!r}-sharded dims of x.shape={x.shape}"
        )
    size = math.prod(axis_size(a, mesh) for a in batch)
    if x.shape[0] % size:
        sizes = {a: axis_size(a, mesh) for a in batch}
        raise ValueError(
            f"{name}: x dimension 0 (batch) of size {x.shape[0]} in shape {x.shape} is not "
            f"divisible by batch_axes {sizes} (product {size})"
        )
    return batch


def _setup(name, x, w, b, axis, mode, sequence_parallel, mesh) -> tuple[bool, int]:
    """Validate mode/shapes; return (sequence_parallel, size of ``axis``)."""
    if mode not in _MODES:
        raise ValueError(f"{name}: mode must be one of {_MODES}, got {mode!r}")
    if mode != "sync" and sequence_parallel is False:
        raise ValueError(
            f"{name}: mode={mode!r} overlaps the sequence all-gather/reduce-scatter with the "
            f"matmul, so it needs sequence-parallel activations (sequence_parallel=True or None)"
        )
    sp = mode != "sync" if sequence_parallel is None else bool(sequence_parallel)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{name}: expected x[..., in] and w[in, out], got x.shape={x.shape}, w.shape={w.shape}"
        )
    if b is not None and b.shape != (w.shape[1],):
        raise ValueError(f"{name}: expected b of shape {(w.shape[1],)}, got {b.shape}")
    if axis in manual_axes(mesh):
        raise ValueError(
            f"{name}: mesh axis {axis!r} is already manual (called inside a shard_map over "
            f"{axis!r}); call it from jit-level code with global arrays instead"
        )
    return sp, axis_size(axis, mesh)


def _seq_dim(name: str, x: jax.Array, seq_dim: int) -> int:
    if not -x.ndim <= seq_dim < x.ndim or seq_dim % x.ndim == x.ndim - 1:
        raise ValueError(
            f"{name}: seq_dim={seq_dim} is not a sequence (non-feature) dimension of "
            f"x.shape={x.shape}"
        )
    return seq_dim % x.ndim


def _divisible(name, arg, shape, dim, what, axis, n):
    if shape[dim] % n:
        raise ValueError(
            f"{name}: {arg} dimension {dim} ({what}) of size {shape[dim]} in shape {tuple(shape)} "
            f"is not divisible by mesh axis {axis!r} of size {n}"
        )
