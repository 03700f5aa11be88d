"""Shared building blocks: annotated parameters, layer stacks (stacked, or a list where the
layers differ; run by scan or loop), remat policies and the token cross-entropy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._annotate import constrain
from shardax.models.attention import attention
from shardax.models.remat import checkpoint_name, remat_policy
from shardax.parallel.remat import checkpoint_in_order

__all__ = ["LAYERS", "cross_entropy", "make_layers", "param", "remat_policy", "run_layers",
           "layer_list", "split_stack", "stack_states", "token_nll", "unstack"]

LAYERS = "layers"


def param(
    key: jax.Array,
    init: Callable[..., jax.Array],
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype: Any = jnp.float32,
) -> nnx.Param:
    """An ``nnx.Param`` carrying logical axis names as ``out_sharding`` metadata.

    Eager sharding is off: logical names are not mesh axes, so shardax turns them into
    shardings at the ``jit`` boundary instead of at creation (the model needs no mesh to build).

    Example::

        w = param(rngs.params(), nnx.initializers.normal(0.02), (64, 256), ('embed', 'mlp'))
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    init = nnx.with_partitioning(init, tuple(names), eager_sharding=False)
    return nnx.Param(init(key, tuple(shape), dtype))


def make_layers(
    make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs, stacked: bool = True
) -> nnx.Module | nnx.List:
    """Build ``n`` layers, stacked on a leading ``'layers'`` axis, or as a list (``stacked=
    False``: layers that differ in structure or static settings).

    Layer ``i`` is always built from the ``i``-th of ``n`` keys split from ``rngs.params()``,
    so both layouts hold the same numbers: ``stacked[i] == listed[i]``.
    """
    keys = jax.random.split(rngs.params(), n)
    if not stacked:
        return nnx.List([make(nnx.Rngs(params=k)) for k in keys])

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(key):
        return make(nnx.Rngs(params=key))

    return build(keys)


def run_layers(
    layers: nnx.Module | nnx.List,
    x: jax.Array,
    call: Callable[[nnx.Module, jax.Array], jax.Array],
    scan: bool,
    remat: str,
) -> jax.Array:
    """Apply ``call(layer, x)`` through every layer, under the remat policy ``remat``: a scan
    over stacked layers with ``scan`` (the body is traced once, so compile time does not grow
    with depth), else a loop (over the stack's slices, or the list).
    """
    policy = remat_policy(remat)
    if not scan or isinstance(layers, nnx.List):
        for layer in layer_list(layers):
            x = call(layer, x) if remat == "none" else _remat_layer(call, layer, x, policy)
        return x
    # A jax.lax.scan over the stack's state, each step one layer merged from its slice (as
    # `split_stack` gives the loop): unlike nnx.scan it takes a model of any trace level (one
    # closed over by jax.jit, as a plain function of arrays would be).
    graphdef, state = nnx.split(layers)

    def body(one, h):
        return call(nnx.merge(graphdef, one), h)

    if remat != "none":
        # Inside scan the loop already keeps XLA from CSE-ing the recomputation away.
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(lambda h, one: (body(one, h), None), x, state)[0]


def split_stack(stack: Any) -> list[Any]:
    """The per-layer trees of a tree of arrays stacked on a leading axis (slices by
    ``jnp.split``, whose gradient is one concatenate rather than a padded copy per layer).

    Example::

        first, second = split_stack({"w": jnp.zeros((2, 3))})    # {"w": [3]} each
    """
    leaves, treedef = jax.tree.flatten(stack)
    parts = [jnp.split(a, a.shape[0]) for a in leaves]
    return [jax.tree.unflatten(treedef, [p[i][0] for p in parts])
            for i in range(leaves[0].shape[0])]


def layer_list(layers: nnx.Module | nnx.List) -> list[nnx.Module]:
    """The layers one module each: a list's items, or a stack's slices (`unstack`)."""
    return list(layers) if isinstance(layers, nnx.List) else unstack(layers)


def unstack(layers: nnx.Module) -> list[nnx.Module]:
    """The layers of a stacked module, one module each (`split_stack` of its state).

    Example::

        first = unstack(model.layers)[0]
    """
    graphdef, state = nnx.split(layers)
    return [nnx.merge(graphdef, one) for one in split_stack(state)]


def _remat_layer(call, layer, x, policy):
    """``call(layer, x)`` under ``policy``, its recomputation tied to the backward pass
    (:func:`shardax.parallel.remat.checkpoint_in_order`: an unrolled loop of plain
    ``jax.checkpoint`` layers is merged back into the forward by XLA)."""
    graphdef, state = nnx.split(layer)
    return checkpoint_in_order(lambda s, h: call(nnx.merge(graphdef, s), h), policy)(state, x)


def stack_states(states: Sequence[Any]) -> dict[str, Any]:
    """Stack per-layer states (list layout) into arrays with the scan layout's leading axis.

    Returns a pure dict of arrays, ready for ``nnx.replace_by_pure_dict`` on a scanned model.

    Example::

        stacked = stack_states([nnx.state(layer) for layer in listed.layers])
        nnx.replace_by_pure_dict(scan_state, stacked)   # scan_state = nnx.state(scanned.layers)
    """
    pure = [nnx.to_pure_dict(s) if isinstance(s, nnx.State) else s for s in states]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *pure)


def cross_entropy(
    logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *, gather: bool = True
) -> jax.Array:
    """Mean token cross-entropy in float32, over positions where ``mask`` is true.

    ``logits``: [..., vocab]; ``targets``: integer [...]; ``mask``: [...] (bool or 0/1).
    ``gather=False`` picks the target logits with a masked sum instead of a gather: XLA 0.10
    cannot partition that gather inside a pipeline stage's manual region when the vocabulary
    is sharded, but the masked sum costs one more logits-sized buffer in the backward.

    Example::

        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree on leading dims"
        )
    nll = token_nll(logits, targets, gather=gather)
    if mask is None:
        return nll.mean()
    if mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must match targets {targets.shape}")
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def token_nll(logits: jax.Array, targets: jax.Array, *, gather: bool = True) -> jax.Array:
    """Per-token negative log-likelihood in float32 (``gather``: see :func:`cross_entropy`).

    Example::

        nll = token_nll(logits, targets)   # [b, s]
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    targets = targets.astype(jnp.int32)
    if gather:
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    else:
        vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return logz - picked


class AttentionLayer(nnx.Module):
    """What every attention layer does with its parts: ``qkv`` projects, ``rope`` rotates,
    ``attend`` attends (through the layout's ``attend``) and ``out`` projects back; the
    activations are annotated with their logical axes on the way. Subclasses (Llama's
    grouped-query attention, DeepSeek's latent attention) define the four parts."""

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 segment_ids: jax.Array | None = None, attend: Callable = attention
                 ) -> jax.Array:
        q, k, v = self.qkv(x)
        q, k = self.rope(q, k, cos, sin)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        out = self.attend(q, k, v, attend, segment_ids=segment_ids)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return checkpoint_name(self.out(out), "attn_proj")
