"""The token-embedding lookup on a sharded table, moving activations, never the table.

``jnp.take`` on a table sharded over ``'vocab'`` rows and ``'embed'`` columns makes the
partitioner gather the table whole every step. `lookup` runs one ``jax.shard_map`` instead
(MaxText's and Levanter's trade: the tokens and the looked-up rows move, the table stays):

* a mesh axis splitting the table's columns (``'embed'``, e.g. fully sharded data parallelism)
  all-gathers the tokens over it (ints, tiny), looks up its own columns of every gathered token,
  and sends each device its tokens' columns back with one all-to-all (where that axis does not
  split the tokens, the rows leave split over it on their features, for the partitioner to
  gather);
* a mesh axis splitting the table's rows (``'vocab'``, e.g. TP) looks up the tokens whose rows
  it holds (zeros for the others) and sums over the axis (a reduce-scatter where the axis also
  splits the tokens).

The gradient is the transpose of the same collectives: it reaches each table shard without a
full-size table ever existing. Without rules, a mesh, or a table axis of size > 1 (one device,
or inside a ``shard_map`` that made those axes manual) it is ``jnp.take``.

Example::

    x = lookup(table, tokens)  # [b, s, dim]; the table [vocab, dim] stays sharded
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax import _compat
from shardax.logical import current_logical_rules

__all__ = ["lookup", "lookup_manual"]

TABLE_NAMES = ("vocab", "embed")
TOKEN_NAMES = ("batch", "length")


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``jnp.take(table, tokens, axis=0)`` with the table left where its logical names
    ``('vocab', 'embed')`` put it (see the module docstring).

    >>> lookup(jnp.eye(4), jnp.array([[1, 3]])).shape
    (1, 2, 4)
    """
    rules, mesh = current_logical_rules(), _compat.abstract_mesh()
    if rules is None or mesh is None or mesh.empty or tokens.ndim != 2:
        return jnp.take(table, tokens, axis=0)
    sizes = dict(mesh.shape)
    if set(mesh.manual_axes):  # nested manual regions do not differentiate in JAX 0.10
        return jnp.take(table, tokens, axis=0)
    rows, cols = _fit(rules.spec_for(TABLE_NAMES), table.shape, sizes)
    if not rows and not cols:
        return jnp.take(table, tokens, axis=0)
    # The tokens enter split as the looked-up activations leave (a sequence-parallel 'length'
    # split included: a slice of replicated tokens, no communication), so the rows come out
    # where the layers want them, with no resharding after the lookup.
    out = (*tokens.shape, table.shape[1])
    tok = _fit(rules.spec_for((*TOKEN_NAMES, "embed")), out, sizes)[:2]
    where = {a: k for k, d in enumerate(tok) for a in d}  # axis -> the token dim it splits
    manual = set(rows) | set(cols) | set(where)

    def local(table, tokens):
        return _local_lookup(table, tokens, rows, cols, where, sizes)

    # A column axis that does not split the tokens leaves the rows split over it on their
    # features: the partitioner gathers those activations where the layers need them (an
    # all-gather inside would be typed as varying over the axis).
    features = tuple(a for a in cols if a not in where)
    return jax.shard_map(
        local,
        in_specs=(_spec((rows, cols)), _spec(tok)),
        out_specs=_spec((*tok, features)),
        axis_names=manual,
    )(table, tokens)


def lookup_manual(table: jax.Array, tokens: jax.Array, axis: str, dim: int | None
                  ) -> jax.Array:
    """`lookup` inside a ``shard_map`` that made ``axis`` manual: ``table`` is this device's
    shard, split over ``axis`` along ``dim`` (0: rows, 1: columns, None: whole), ``tokens``
    this device's rows of a batch split over ``axis`` (and other manual axes). The layout's
    ZeRO-3 region (`shardax.layout.forward.fsdp_value_and_grad`) looks up its embedding so,
    without gathering the table.

    Example::

        x = lookup_manual(gather.local(params["embed"]), tokens, axis, 1)   # columns split
    """
    if dim is None:
        return jnp.take(table, tokens, axis=0)
    mesh = _compat.abstract_mesh()
    sizes = dict(mesh.shape)
    rows, cols = ((axis,), ()) if dim == 0 else ((), (axis,))
    return _local_lookup(table, tokens, rows, cols, {axis: 0}, sizes)


def _local_lookup(table, tokens, rows, cols, where, sizes):
    """The lookup on this device's blocks: ``rows`` / ``cols`` the axes splitting the table's
    rows / columns, ``where[a]`` the token dim axis ``a`` splits (if it does)."""
    # Gather the tokens over every table axis that splits them (undone in reverse below).
    for a in (*rows, *cols):
        if a in where:
            tokens = lax.all_gather(tokens, a, axis=where[a], tiled=True)
    start = _linear_index(rows, sizes) * table.shape[0]
    idx = tokens - start
    x = jnp.take(table, jnp.clip(idx, 0, table.shape[0] - 1), axis=0)
    if rows:  # zeros for the tokens whose rows another device holds
        hit = (idx >= 0) & (idx < table.shape[0])
        x = jnp.where(hit[..., None], x, jnp.zeros((), x.dtype))
    for a in reversed((*rows, *cols)):
        if a in rows:
            x = (lax.psum_scatter(x, a, scatter_dimension=where[a], tiled=True)
                 if a in where else lax.psum(x, a))
        elif a in where:
            x = lax.all_to_all(x, a, where[a], 2, tiled=True)
        # else: the output stays split over 'a' on its features (see `lookup`'s out_specs)
    return x


def _fit(spec: P, shape: Sequence[int], sizes: dict[str, int]) -> tuple[tuple[str, ...], ...]:
    """Per dim, the mesh axes of ``spec`` that exist, are larger than 1 and divide it."""
    out = []
    for dim, n in enumerate(shape):
        entry = spec[dim] if dim < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
        out.append(axes if n % math.prod(sizes[a] for a in axes) == 0 else ())
    return tuple(out)


def _spec(dims: Sequence[tuple[str, ...]]) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _linear_index(axes: Sequence[str], sizes: dict[str, int]) -> jax.Array:
    """This device's block index along ``axes`` (major to minor), as a spec splits a dim."""
    index = jnp.int32(0)
    for a in axes:
        index = index * sizes[a] + lax.axis_index(a)
    return index
