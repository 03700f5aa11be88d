"""The token cross-entropy computed in chunks of the sequence, so that neither the whole
``[batch, seq, vocab]`` float32 logits nor their gradient ever exist.

Each chunk's logits come from ``logits_fn`` (final norm + vocabulary projection) inside a
``jax.checkpoint``: the backward pass recomputes one chunk's logits at a time. The loss and
gradients equal ``cross_entropy(logits_fn(x), targets)`` up to float32 summation order.

Example::

    loss = chunked_cross_entropy(lambda h: model.head(h, *model.head_params()), x, targets)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shardax.models._layers import cross_entropy, token_nll

__all__ = ["MAX_CHUNK_LOGITS", "RowGroups", "chunked_cross_entropy", "num_chunks"]

# Logits per chunk (batch x chunk length x vocabulary) the default chunking stays under:
# 2**26 float32 values, 256 MiB (and as much again for their gradient).
MAX_CHUNK_LOGITS = 2**26


@dataclass(frozen=True)
class RowGroups:
    """How `chunked_cross_entropy` splits the batch into row blocks: ``count`` blocks,
    ``place(a)`` puts the leading (block) dim of ``a`` where the blocks live, and ``vmap(f)``
    maps ``f`` over the blocks (``jax.vmap``, or one that knows where the blocks live).

    Example::

        RowGroups(8, place=lambda a: a)   # eight blocks, placed by the compiler
    """

    count: int
    place: Callable[[jax.Array], jax.Array]
    vmap: Callable[[Callable], Callable] = jax.vmap


def num_chunks(seq: int, tokens_per_chunk: int) -> int:
    """The fewest chunks, dividing ``seq``, of at most ``tokens_per_chunk`` positions each.

    Example::

        num_chunks(8192, 1000)   # 16 (chunks of 512)
    """
    n = max(1, -(-seq // max(tokens_per_chunk, 1)))
    while seq % n:
        n += 1
    return n


def chunked_cross_entropy(
    logits_fn: Callable[..., jax.Array],
    x: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    weights: jax.Array | None = None,
    gather: bool = True,
    chunk_len: int | None = None,
    params: tuple[jax.Array, ...] = (),
    groups: RowGroups | None = None,
) -> jax.Array:
    """Mean token cross-entropy of ``targets`` [b, s] under ``logits_fn(x)`` (x: [b, s, ...];
    ``logits_fn`` maps [b, c, ...] to [b, c, vocab] logits), over positions where ``mask``
    is true, computed ``chunk_len`` positions at a time (default: chunks of at most
    ``MAX_CHUNK_LOGITS`` logits). One chunk gives exactly ``cross_entropy``.

    ``weights`` [b, s] (instead of a mask): the plain mean over all positions of each token's
    cross-entropy times its weight. Weights ``mask * (tokens / unmasked tokens)`` of a whole
    batch give its masked mean however the batch is split into equal parts whose means are
    averaged (data shards, microbatches): `shardax.data.packing.loss_weights`.

    The chunks are strided (chunk ``i`` holds positions ``i, i + n, ...``): a sequence axis
    sharded over the mesh splits each chunk the same way, so no chunk needs resharding.

    ``params``: arrays passed on as ``logits_fn(h, *params)`` (the head's weights). ``groups``
    (`RowGroups`): the batch is split into row blocks (the data shards), each with its own
    copy of ``params``. Under the partitioner a loop-invariant weight sharded over the batch's
    devices would otherwise be gathered, and its gradient all-reduced, once per chunk; per
    block, the gradient sums over the chunks on its own device and is reduced once, after the
    loop.

    Example::

        loss = chunked_cross_entropy(head, x, targets, chunk_len=512)
    """
    b, s = targets.shape
    if mask is not None and weights is not None:
        raise ValueError("give a mask or weights, not both")
    if x.shape[:2] != (b, s):
        raise ValueError(f"hidden states {x.shape} and targets {targets.shape} disagree on "
                         "[batch, seq]")

    def logits(h: jax.Array) -> jax.Array:
        return logits_fn(h, *params)

    if chunk_len is None:
        vocab = jax.eval_shape(logits, x[:, :1]).shape[-1]
        chunk_len = max(1, MAX_CHUNK_LOGITS // max(b * vocab, 1))
    n = num_chunks(s, chunk_len)
    if weights is not None:
        if weights.shape != targets.shape:
            raise ValueError(f"weights {weights.shape} must match targets {targets.shape}")
        weights = weights.astype(jnp.float32)
        if n == 1:
            return jnp.mean(token_nll(logits(x), targets, gather=gather) * weights)
        mask = weights
    elif n == 1:
        return cross_entropy(logits(x), targets, mask, gather=gather)
    if mask is None:
        mask = jnp.ones((b, s), jnp.float32)
    if mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must match targets {targets.shape}")
    rows = [x, targets, mask.astype(jnp.float32)]
    if groups is not None and groups.count > 1 and b % groups.count == 0:
        k, place = groups.count, groups.place  # [b, s, ...] -> [k, b // k, s, ...]
        rows = [place(a.reshape((k, b // k, *a.shape[1:]))) for a in rows]
        copies = tuple(place(jnp.broadcast_to(p, (k, *p.shape))) for p in params)

        def logits(h: jax.Array) -> jax.Array:  # each row block with its own params
            return place(groups.vmap(logits_fn)(h, *copies))

    axis = rows[1].ndim - 1  # the sequence axis

    def strided(a: jax.Array) -> jax.Array:  # [..., s, ...] -> [n, ..., s // n, ...]
        lead, rest = a.shape[:axis], a.shape[axis + 1:]
        return jnp.moveaxis(a.reshape((*lead, s // n, n, *rest)), axis + 1, 0)

    @jax.checkpoint
    def chunk(args):
        xc, tc, mc = args
        return jnp.sum(token_nll(logits(xc), tc, gather=gather) * mc)

    total = jax.lax.map(chunk, tuple(map(strided, rows))).sum()
    return total / (b * s if weights is not None else jnp.maximum(mask.sum(), 1.0))
