"""Packed documents: the segment ids, per-document positions and loss mask of token rows.

A training row is a window of the token stream, in which documents follow each other, each
ending with the tokenizer's end-of-text id (`shardax.data.tokenizer.Tokenizer.end`). With
``--pack documents`` a new segment starts after every end-of-text token: a token attends only
within its segment, its RoPE position counts from the segment's first token, and the target
after an end-of-text token (the next document's first token) is left out of the loss. They
are computed from the input rows on device, inside the step, so the batch at step k stays a
function of (seed, k) and the data pipeline is unchanged. `loss_weights` turns the mask into
weights whose plain mean is the masked mean of the whole batch, however the step splits it
(data shards, microbatches, pipeline microbatches).

>>> import jax.numpy as jnp
>>> docs = documents(jnp.array([[5, 6, 0, 7, 8, 0, 9]]), end_id=0)
>>> docs.segment_ids.tolist(), docs.positions.tolist(), docs.loss_mask.tolist()
([[0, 0, 0, 1, 1, 1, 2]], [[0, 1, 2, 0, 1, 2, 0]], [[True, True, False, True, True, False, True]])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PACK_MODES", "Documents", "documents", "loss_weights", "segment_positions"]

PACK_MODES = ("documents", "concat")


class Documents(NamedTuple):
    """Per-token document structure of input rows, each [b, s]."""

    segment_ids: jax.Array  # int32, 0 for the row's first (possibly partial) document
    positions: jax.Array  # int32, position within the document
    loss_mask: jax.Array  # bool, false where the target starts the next document


def documents(inputs: jax.Array, end_id: int) -> Documents:
    """The `Documents` of input rows ``inputs`` [b, s] whose documents end with ``end_id``
    (the end-of-text token belongs to the document it ends)."""
    is_end = inputs == end_id
    ends_before = jnp.cumsum(is_end, axis=1, dtype=jnp.int32)
    segment_ids = ends_before - is_end.astype(jnp.int32)  # ends strictly before each token
    index = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    starts = jnp.pad(is_end[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return Documents(segment_ids, index - first, ~is_end)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its segment, for rows [b, s] of non-decreasing segment
    ids (packed conversations, `shardax.data.chat_data`).

    >>> segment_positions(jnp.array([[0, 0, 1, 1, 1, 2]])).tolist()
    [[0, 1, 0, 1, 2, 0]]
    """
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32),
                             segment_ids.shape)
    starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)),
                     constant_values=True)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def loss_weights(mask: jax.Array) -> jax.Array:
    """Float32 weights ``mask * (tokens / unmasked tokens)`` of a whole batch's loss mask: the
    mean over any equal split of the batch of each part's mean of ``nll * weights`` is the
    batch's mean cross-entropy over its unmasked targets.

    >>> loss_weights(jnp.array([[True, False], [True, True]])).tolist()
    [[1.3333333730697632, 0.0], [1.3333333730697632, 1.3333333730697632]]
    """
    mask = mask.astype(jnp.float32)
    return mask * (mask.size / jnp.maximum(mask.sum(), 1.0))
