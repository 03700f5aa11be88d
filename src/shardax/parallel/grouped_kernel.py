"""The grouped matmul of a dropless mixture of experts: (token, expert) pairs laid out as rows
grouped by expert, and each group multiplied by its expert's weights, doing only the routed
work on every backend.

Where the backend has a grouped-matmul kernel (TPU: `jax.lax.ragged_dot`) the rows are the
pairs sorted by expert, unpadded. XLA:GPU (JAX 0.11) and XLA:CPU lower ``ragged_dot`` to one
dense matmul of a ``[rows, experts * d]`` masked copy of the input against every expert's
weights (``experts`` times the work and a ``rows x experts x d`` temporary). So on a GPU the
same unpadded rows go through `bucketed_matmul`: one batched matmul over ``[experts,
capacity, d]`` with the smallest of a few static capacities that holds every expert's rows
(``ragged_dot`` past the largest), which moves no token and drops none. On CPU each expert's
group is padded to whole tiles of `tile_rows` rows (megablox's layout: at most ``pairs +
experts * (tile - 1)`` rows, a static bound) and a scan over the tiles multiplies each by its
own expert's weights. `tile_rows` picks the layout; `grouped_matmul` the product.

Example::

    layout = sort_by_expert(experts, n_experts=8, tile=tile_rows(experts.size, 8))
    xs = tokens[layout.rows]                       # [buffer rows, d]
    hs = grouped_matmul(xs, w, layout.groups)      # [buffer rows, f]
    y = combine(hs, layout.slots, weights)         # [tokens, f], back per token
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardax import _compat

Array = jax.Array

__all__ = ["ExpertRows", "Groups", "bucketed_matmul", "buffer_rows", "combine", "grouped_matmul",
           "routed_experts", "row_experts", "sort_by_expert", "tile_rows"]

# CPU tile sizes tried by `tile_rows`: larger tiles mean fewer scan steps, smaller less padding.
_MIN_TILE, _MAX_TILE = 8, 256
# GPU capacities of `bucketed_matmul`, in an expert's mean rows: the first that holds the
# largest group runs; past the last, `jax.lax.ragged_dot` (dense over the experts).
_CAPACITIES = (1.25, 2.0)


def _backend() -> str:
    return jax.default_backend()


def tile_rows(pairs: int, n_experts: int, backend: str | None = None) -> int:
    """Rows per tile of the grouped-matmul buffer: 1 (no padding, `jax.lax.ragged_dot`) where
    ``backend`` (default: JAX's) has a grouped-matmul kernel, else the power of two nearest a
    quarter of an expert's mean rows, within [8, 256] (padding at most about a quarter of the
    rows when the load is balanced).

    >>> tile_rows(4096, 8, backend="cpu"), tile_rows(4096, 8, backend="gpu")
    (128, 1)
    """
    if (backend or _backend()) != "cpu":
        return 1
    want = max(pairs / n_experts / 4, 1)
    tile = 1 << round(want).bit_length() - 1
    if want / tile > 1.5:
        tile *= 2
    return min(max(tile, _MIN_TILE), _MAX_TILE)


def buffer_rows(pairs: int, n_experts: int, tile: int) -> int:
    """Static rows of the buffer: every expert's rows padded to whole tiles fit in
    ``pairs + n_experts * (tile - 1)``, rounded down to whole tiles.

    >>> buffer_rows(4096, 8, 128)
    4992
    """
    return (pairs + n_experts * (tile - 1)) // tile * tile


class Groups(NamedTuple):
    """How the buffer's rows group by expert: ``sizes [E]`` (int32) its rows per expert
    (padded to whole tiles), ``tile_expert [rows / tile]`` (int32) each tile's expert (the
    last expert for the unused tiles at the end, whose rows are never read); None for an
    untiled buffer (one row a tile: `jax.lax.ragged_dot`)."""

    sizes: Array
    tile_expert: Array | None


class ExpertRows(NamedTuple):
    """Where the (token, expert) pairs sit in the grouped buffer: ``rows [R]`` the token of
    each buffer row (0 for a padding row: its output is never read, so its gradient is 0),
    ``slots [t, k]`` the buffer row of each pair, ``groups`` the `Groups`."""

    rows: Array
    slots: Array
    groups: Groups


def sort_by_expert(experts: Array, n_experts: int, tile: int = 1) -> ExpertRows:
    """The `ExpertRows` of ``experts [t, k]`` (each token's k experts; ``n_experts`` marks an
    unused pair, given no row): pairs sorted by expert (stable: a token's rows keep token
    order within an expert), each expert's rows starting on a whole tile of ``tile`` rows.
    An unused pair's slot is past the buffer's end (a gather with ``mode='fill'`` reads 0).

    >>> lay = sort_by_expert(jnp.array([[1, 0], [1, 2]]), 3)
    >>> lay.rows.tolist(), lay.slots.tolist(), lay.groups.sizes.tolist()
    ([0, 0, 1, 1], [[1, 0], [2, 3]], [1, 2, 1])
    """
    t, k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    padded = (sizes + tile - 1) // tile * tile
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    n = buffer_rows(t * k, n_experts, tile)
    e = jnp.minimum(flat[order], n_experts - 1)
    row = jnp.where(flat[order] < n_experts,
                    pstart[e] + jnp.arange(t * k, dtype=jnp.int32) - start[e], n)
    slots = jnp.zeros((t * k,), jnp.int32).at[order].set(row, unique_indices=True)
    rows = jnp.zeros((n,), jnp.int32).at[row].set(order // k, mode="drop")
    if tile == 1:  # ragged_dot reads the sizes alone
        return ExpertRows(rows, slots.reshape(t, k), Groups(padded, None))
    first = jnp.arange(n // tile, dtype=jnp.int32) * tile
    # The experts ending at or before each tile's first row (jnp.searchsorted fails inside
    # nested shard_maps in JAX 0.10: its vma check asserts).
    ends = jnp.cumsum(padded)
    tile_expert = jnp.minimum(jnp.sum(ends[None, :] <= first[:, None], axis=1, dtype=jnp.int32),
                              n_experts - 1)
    return ExpertRows(rows, slots.reshape(t, k), Groups(padded, tile_expert))


def row_experts(groups: Groups, rows: int) -> Array:
    """The expert of each of the buffer's ``rows`` rows ([rows] int32; a padding row's is any
    expert's: its output is never read).

    >>> row_experts(Groups(jnp.array([1, 2]), None), 4).tolist()
    [0, 1, 1, 1]
    """
    if groups.tile_expert is None:
        n = groups.sizes.shape[0]
        return jnp.repeat(jnp.arange(n, dtype=jnp.int32), groups.sizes, total_repeat_length=rows)
    return jnp.repeat(groups.tile_expert, rows // groups.tile_expert.shape[0])


def combine(ys: Array, slots: Array, weights: Array) -> Array:
    """Each token's ``sum_k weights[t, k] * ys[slots[t, k]]`` in float32: ``[t, d]`` from
    the buffer's rows ``ys [R, d]`` (a slot past the end reads 0).

    >>> combine(jnp.ones((4, 2)), jnp.array([[0, 1], [2, 9]]), jnp.full((2, 2), 0.5)).tolist()
    [[1.0, 1.0], [0.5, 0.5]]
    """
    picked = jnp.take(ys, slots, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", picked, weights.astype(jnp.float32))


def routed_experts(tokens: Array, weights: Array, experts: Array, mlp: Callable[..., Array],
                   *params: Array) -> Array:
    """The dropless experts on one device: ``tokens [t, d]`` with their routing (``weights``
    and ``experts [t, k]``) through ``mlp(rows, groups, *params)`` (the experts' MLP on rows
    grouped by expert; ``params`` lead with the expert axis), combined per token in float32.

    >>> mlp = lambda xs, groups, w: grouped_matmul(xs, w, groups)
    >>> routed_experts(jnp.ones((3, 2)), jnp.full((3, 1), 0.5), jnp.zeros((3, 1), int), mlp,
    ...                jnp.ones((2, 2, 2))).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    n_experts = params[0].shape[0]
    lay = sort_by_expert(experts, n_experts, tile_rows(experts.size, n_experts))
    ys = mlp(jnp.take(tokens, lay.rows, axis=0), lay.groups, *params)
    return combine(ys, lay.slots, weights)


def grouped_matmul(x: Array, w: Array, groups: Groups) -> Array:
    """``x [R, d]`` rows grouped by expert (`sort_by_expert`) times their expert's ``w [E, d,
    f]``: ``[R, f]``. One `jax.lax.ragged_dot` when the buffer is untiled (a tile of 1 row;
    on a GPU `bucketed_matmul`), else a scan of ``[tile, d] @ [d, f]`` products, one per
    tile, with its expert's weights.

    >>> g = Groups(jnp.array([2, 2]), jnp.array([0, 1]))
    >>> grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), g).shape
    (4, 5)
    """
    if groups.tile_expert is None:
        if _backend() == "gpu":
            return bucketed_matmul(x, w, groups.sizes)
        return jax.lax.ragged_dot(x, w, groups.sizes)
    tiles = groups.tile_expert.shape[0]
    used = jnp.sum(groups.sizes) // (x.shape[0] // tiles)
    return _tiled_matmul(x, w, groups.tile_expert, used.astype(jnp.int32))


def bucketed_matmul(x: Array, w: Array, sizes: Array) -> Array:
    """``x [R, d]`` rows sorted by expert, ``sizes [E]`` of them each (rows past their sum
    give zeros), times their expert's ``w [E, d, f]``: `jax.lax.ragged_dot`'s product as one
    batched ``[E, C, d] @ [E, d, f]`` matmul, ``C`` the smallest capacity of `_CAPACITIES`
    (times ``R / E``) that holds the largest group, else ``ragged_dot`` itself. Each branch
    is a static shape (a `jax.lax.switch`); the backward pass keeps only ``x`` and ``w``.

    >>> bucketed_matmul(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.array([1, 3])).shape
    (4, 5)
    """
    return _bucketed(x, w, sizes, _capacities(x.shape[0], w.shape[0]))


def _capacities(rows: int, n_experts: int) -> tuple[int, ...]:
    """Each bucket's rows per expert: `_CAPACITIES` times the mean, rounded up to 8 rows, at
    most ``rows``.

    >>> _capacities(64, 4), _capacities(64, 1)
    ((24, 32), (64,))
    """
    return tuple(sorted({min(-(-int(rows / n_experts * f) // 8) * 8, rows)
                         for f in _CAPACITIES}))


def _slots(sizes: Array, capacity: int, rows: int) -> tuple[Array, Array]:
    """``[E, capacity]`` the row of each expert's slot (``rows``: an empty slot) and ``[rows]``
    the slot of each row in the flattened ``[E * capacity]`` (past it for the rows past the
    groups)."""
    start = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(capacity, dtype=jnp.int32)
    gather = jnp.where(slot < sizes[:, None], start[:, None] + slot, rows)
    expert = row_experts(Groups(sizes, None), rows)
    row = jnp.arange(rows, dtype=jnp.int32)
    scatter = jnp.where(row < jnp.sum(sizes), expert * capacity + row - start[expert],
                        sizes.shape[0] * capacity)
    return gather, scatter


def _bucket_index(sizes: Array, capacities: tuple[int, ...]) -> Array:
    return jnp.sum(jnp.max(sizes) > jnp.asarray(capacities, sizes.dtype))


def _bucketed_forward(x: Array, w: Array, sizes: Array, capacities: tuple[int, ...]) -> Array:
    def batched(capacity):
        def product(x, w, sizes):
            gather, scatter = _slots(sizes, capacity, x.shape[0])
            xs = jnp.take(x, gather, axis=0, mode="fill", fill_value=0)
            ys = jnp.einsum("ecd,edf->ecf", xs, w).reshape(-1, w.shape[-1])
            return jnp.take(ys, scatter, axis=0, mode="fill", fill_value=0)
        return product

    branches = [batched(c) for c in capacities] + [jax.lax.ragged_dot]
    return jax.lax.switch(_bucket_index(sizes, capacities), branches, x, w, sizes)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bucketed(x: Array, w: Array, sizes: Array, capacities: tuple[int, ...]) -> Array:
    return _bucketed_forward(x, w, sizes, capacities)


def _bucketed_fwd(x, w, sizes, capacities):
    return _bucketed_forward(x, w, sizes, capacities), (x, w, sizes)


def _bucketed_bwd(capacities, res, g):
    x, w, sizes = res
    dx = _bucketed_forward(g, jnp.swapaxes(w, 1, 2), sizes, capacities)

    def batched(capacity):
        def product(x, g, sizes):
            gather, _ = _slots(sizes, capacity, x.shape[0])
            xs, gs = (jnp.take(a, gather, axis=0, mode="fill", fill_value=0) for a in (x, g))
            return jnp.einsum("ecd,ecf->edf", xs, gs)
        return product

    def ragged(x, g, sizes):
        return jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes), w)[1](g)[0]

    branches = [batched(c) for c in capacities] + [ragged]
    dw = jax.lax.switch(_bucket_index(sizes, capacities), branches, x, g, sizes)
    return (_sum_to(dx, x).astype(x.dtype), _sum_to(dw, w).astype(w.dtype),
            jnp.zeros(sizes.shape, jax.dtypes.float0))


_bucketed.defvjp(_bucketed_fwd, _bucketed_bwd)


def _zeros(shape: tuple[int, ...], *operands: Array) -> Array:
    """Zeros typed as a product of ``operands`` (inside ``shard_map``: varying over the manual
    axes any of them varies over, as ``cond``'s branches must agree)."""
    axes = frozenset().union(*(_compat.varying_axes(a) for a in operands))
    zeros = jnp.zeros(shape, jnp.result_type(*operands))
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _tiles(a: Array, tiles: int) -> Array:
    return a.reshape(tiles, a.shape[0] // tiles, a.shape[1])


def _tiled_forward(x: Array, w: Array, tile_expert: Array, used: Array) -> Array:
    """Each of the first ``used`` tiles of ``x`` times its expert's ``w`` (a scan over the
    tiles); the unused tiles at the end give zeros."""
    def product(i, xe):
        xi, e = xe
        yi = jax.lax.cond(i < used,
                          lambda: xi @ jax.lax.dynamic_index_in_dim(w, e, keepdims=False),
                          lambda: _zeros((xi.shape[0], w.shape[-1]), xi, w))
        return i + 1, yi

    _, y = jax.lax.scan(product, 0, (_tiles(x, tile_expert.shape[0]), tile_expert))
    return y.reshape(x.shape[0], w.shape[-1])


# A custom VJP: autodiff of the scan would keep every tile's slice of the weights for the
# backward pass and scatter its gradient through them; here the weights' gradient is summed
# into its expert in place, tile by tile, and nothing but x and w is kept.
@jax.custom_vjp
def _tiled_matmul(x: Array, w: Array, tile_expert: Array, used: Array) -> Array:
    return _tiled_forward(x, w, tile_expert, used)


def _tiled_fwd(x, w, tile_expert, used):
    return _tiled_forward(x, w, tile_expert, used), (x, w, tile_expert, used)


def _tiled_bwd(res, g):
    x, w, tile_expert, used = res
    dx = _tiled_forward(g, jnp.swapaxes(w, 1, 2), tile_expert, used)

    def accumulate(carry, xge):
        i, dw = carry
        xi, gi, e = xge
        part = jax.lax.cond(i < used, lambda: xi.T @ gi, lambda: _zeros(dw.shape[1:], xi, gi))
        dw = jax.lax.dynamic_update_index_in_dim(
            dw, jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + part, e, 0)
        return (i + 1, dw), None

    tiles = tile_expert.shape[0]
    (_, dw), _ = jax.lax.scan(accumulate, (0, _zeros(w.shape, x, g)),
                              (_tiles(x, tiles), _tiles(g, tiles), tile_expert))
    zeros = (jnp.zeros(tile_expert.shape, jax.dtypes.float0),
             jnp.zeros(used.shape, jax.dtypes.float0))
    return (_sum_to(dx, x).astype(x.dtype), _sum_to(dw, w).astype(w.dtype), *zeros)


def _sum_to(ct: Array, primal: Array) -> Array:
    """``ct`` summed over the manual axes it varies over and ``primal`` does not: a cotangent
    typed as its primal (what autodiff's transpose of the implicit broadcast does)."""
    axes = _compat.varying_axes(ct) - _compat.varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(axes))) if axes else ct


_tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)
