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

import jax
import jax.numpy as jnp

from shardax.models._layers import cross_entropy, token_nll

__all__ = ["MAX_CHUNK_LOGITS", "chunked_cross_entropy", "num_chunks"]

# Logits per chunk (batch x chunk length x vocabulary) the default chunking stays under:
# 2**26 float32 values, 256 MiB (and as much again for their gradient).
MAX_CHUNK_LOGITS = 2**26


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
    logits_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    weights: jax.Array | None = None,
    gather: bool = True,
    chunk_len: int | None = None,
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

    Example::

        loss = chunked_cross_entropy(head, x, targets, chunk_len=512)
    """
    b, s = targets.shape
    if mask is not None and weights is not None:
        raise ValueError("give a mask or weights, not both")
    if x.shape[:2] != (b, s):
        raise ValueError(f"hidden states {x.shape} and targets {targets.shape} disagree on "
                         "[batch, seq]")
    if chunk_len is None:
        vocab = jax.eval_shape(logits_fn, x[:, :1]).shape[-1]
        chunk_len = max(1, MAX_CHUNK_LOGITS // max(b * vocab, 1))
    n = num_chunks(s, chunk_len)
    if weights is not None:
        if weights.shape != targets.shape:
            raise ValueError(f"weights {weights.shape} must match targets {targets.shape}")
        weights = weights.astype(jnp.float32)
        if n == 1:
            return jnp.mean(token_nll(logits_fn(x), targets, gather=gather) * weights)
        mask = weights
    elif n == 1:
        return cross_entropy(logits_fn(x), targets, mask, gather=gather)
    if mask is None:
        mask = jnp.ones((b, s), jnp.float32)
    if mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must match targets {targets.shape}")

    def strided(a: jax.Array) -> jax.Array:  # [b, s, ...] -> [n, b, s // n, ...]
        return jnp.moveaxis(a.reshape((b, s // n, n) + a.shape[2:]), 2, 0)

    @jax.checkpoint
    def chunk(args):
        xc, tc, mc = args
        return jnp.sum(token_nll(logits_fn(xc), tc, gather=gather) * mc)

    mask = mask.astype(jnp.float32)
    total = jax.lax.map(chunk, (strided(x), strided(targets), strided(mask))).sum()
    return total / (b * s if weights is not None else jnp.maximum(mask.sum(), 1.0))
