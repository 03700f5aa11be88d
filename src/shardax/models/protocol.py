"""The protocol every shardax language model implements, and its plain one-device forward.

A family subclasses `LanguageModel` and defines five things; `shardax.layout.forward` runs
any such model on any layout (every parallelism of `shardax.layout`) through them alone, as
torchtitan's ``parallelize_*`` applies parallelism from outside the model:

* ``embed_inputs(tokens, positions=None, segment_ids=None, *, lookup=None) -> (h, extras)``: the
  residual stream ``[b, s, dim]`` in the compute dtype, and ``extras``, a dict of arrays with
  the batch as leading dim that every block reads (RoPE tables, segment ids). ``lookup(table,
  tokens)`` replaces the token-embedding lookup (a layout that keeps the table split looks up
  its own shard).
* ``layers``: the layer stack (identical layers stacked on a leading 'layers' axis, or an
  ``nnx.List`` where they differ), and ``stacked``: which of the two. Whether a stack runs
  as a scan or a loop is the caller's (`run_blocks`'s ``scan``; a layout's ``scan_layers``).
* ``block(layer, h, extras, attend=attention) -> (h, aux)``: one layer; ``aux`` its
  auxiliary loss (a mixture of experts' load balancing; 0 otherwise), or a mixture of
  experts' `MoEStats` (the loss with the layer's expert load); ``attend`` the attention
  function (a layout may pass another, e.g. ring attention).
* ``head_params() -> tuple`` and ``head(h, *head_params) -> logits`` (float32): the final norm
  and vocabulary projection, from the parameters passed in (a pipeline's output stage receives
  them).
* ``has_aux`` / ``aux_weight``: whether blocks return an auxiliary loss, and its weight in the
  training objective.

Example::

    model = Llama(CONFIGS['llama-tiny'], nnx.Rngs(0))
    objective, ce = model.training_loss(tokens[:, :-1], tokens[:, 1:])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._layers import run_layers, split_stack
from shardax.models.attention import attention
from shardax.models.loss import chunked_cross_entropy

__all__ = ["LanguageModel", "MoEStats", "aux_loss", "run_blocks", "split_stack"]


class MoEStats(NamedTuple):
    """A mixture-of-experts layer's auxiliary outputs (a block's ``aux``), or, from
    `run_blocks` with ``stats=True``, those of the whole stack."""

    #: the load-balancing loss (the stack's: the mean over layers)
    loss: jax.Array
    #: float32 top-k assignments per expert, before any drop: [n_experts] (the stack's:
    #: [n_layers, n_experts])
    expert_tokens: jax.Array
    #: the fraction of assignments dropped (capacity routing; 0 dropless; the stack's: mean)
    dropped_fraction: jax.Array


def aux_loss(aux: Any) -> jax.Array:
    """The auxiliary loss of a block's ``aux`` (a scalar, or `MoEStats`)."""
    return aux.loss if isinstance(aux, MoEStats) else aux


class LanguageModel(nnx.Module):
    """Base of the model families: the plain forward on the protocol (see the module)."""

    config: Any
    layers: Any
    #: whether ``block`` returns an auxiliary loss to add to the objective
    has_aux: bool = False
    aux_weight: float = 0.0
    #: the parameter ``embed_inputs`` alone reads the token embeddings from (None when the
    #: head shares it): a layout that keeps it split looks tokens up in its shard instead
    lookup_table: str | None = None

    def embed_inputs(self, tokens: jax.Array, positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None, *, lookup: Callable | None = None
              ) -> tuple[jax.Array, dict[str, Any]]:
        raise NotImplementedError

    def block(self, layer: nnx.Module, h: jax.Array, extras: dict[str, Any],
              attend: Callable = attention) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def head_params(self) -> tuple:
        raise NotImplementedError

    def head(self, h: jax.Array, *head_params: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, return_aux: bool = False):
        """Logits ``[b, s, vocab]`` (float32); with ``return_aux``, ``(logits, aux)``, ``aux``
        the auxiliary loss averaged over layers (0 without one). ``segment_ids`` [b, s] (ints
        >= 0): packed documents; a token attends only within its segment."""
        x, aux = self.hidden(tokens, positions, segment_ids)
        logits = self.head(x, *self.head_params())
        return (logits, aux) if return_aux else logits

    @property
    def stacked(self) -> bool:
        """Whether the layers are one stack on a leading 'layers' axis (else an ``nnx.List``)."""
        return not isinstance(self.layers, nnx.List)

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(h, aux)``: the last layer's output (before the head) and the mean auxiliary
        loss, through a scan of stacked layers or a loop over listed ones (no remat: that is
        the layout's, `shardax.layout.forward`)."""
        x, extras = self.embed_inputs(tokens, positions, segment_ids)
        return run_blocks(self, x, extras, self.block)

    def training_loss(self, tokens: jax.Array, targets: jax.Array,
                      positions: jax.Array | None = None, *,
                      segment_ids: jax.Array | None = None,
                      cast: Callable[[jax.Array], jax.Array] = lambda logits: logits,
                      loss_weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(objective, cross-entropy)`` on one device: the mean token cross-entropy of
        ``targets`` under ``cast(logits)`` (each token times its ``loss_weights`` [b, s]) plus
        ``aux_weight`` times the auxiliary loss, and the cross-entropy alone. On a mesh,
        `shardax.layout.forward.training_loss` runs the same under a layout.

        Example::

            objective, ce = model.training_loss(tokens[:, :-1], tokens[:, 1:])
        """
        x, aux = self.hidden(tokens, positions, segment_ids)
        head = self.head_params()
        # In sequence chunks: the whole [b, s, vocab] logits never exist (models.loss).
        ce = chunked_cross_entropy(lambda h: cast(self.head(h, *head)), x, targets,
                                   weights=loss_weights)
        return (ce + self.aux_weight * aux if self.has_aux else ce), ce


def run_blocks(model: LanguageModel, x: jax.Array, extras: dict[str, Any], block: Callable,
               attend: Callable = attention, remat: str = "none", *, stats: bool = False,
               scan: bool = True) -> tuple[jax.Array, Any]:
    """``(h, aux)``: ``block(layer, h, extras, attend)`` through ``model.layers`` (a scan of
    a stack with ``scan``, else a loop) under the remat policy ``remat``
    (``shardax.models.remat``); ``aux`` the auxiliary losses' mean over layers (0 without
    them). ``stats``: ``aux`` is the stack's `MoEStats` instead (per-layer expert tokens
    [n_layers, n_experts]; zeros for a model without experts)."""
    c = model.config
    if not model.has_aux:
        x = run_layers(model.layers, x, lambda layer, h: block(layer, h, extras, attend)[0],
                       scan, remat)
        zero = jnp.zeros((), jnp.float32)
        return x, (MoEStats(zero, jnp.zeros((c.n_layers, 0), jnp.float32), zero) if stats
                   else zero)

    def call(layer, h):
        y, a = block(layer, h[0], extras, attend)
        s, i = h[1], h[2]
        if isinstance(a, MoEStats):
            s = MoEStats(s.loss + a.loss, s.expert_tokens.at[i].set(a.expert_tokens),
                         s.dropped_fraction + a.dropped_fraction)
        else:
            s = s._replace(loss=s.loss + a)
        return y, s, i + 1

    zero = jnp.zeros((), jnp.float32)
    start = MoEStats(zero, jnp.zeros((c.n_layers, getattr(c, "n_experts", 0)), jnp.float32),
                     zero)
    x, s, _ = run_layers(model.layers, (x, start, jnp.int32(0)), call, scan, remat)
    s = s._replace(loss=s.loss / c.n_layers, dropped_fraction=s.dropped_fraction / c.n_layers)
    return x, (s if stats else s.loss)
