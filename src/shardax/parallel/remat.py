"""``jax.checkpoint`` for layers run in a Python loop, with the recomputation tied to the
backward pass so the compiler can neither merge it with the forward nor run it early.

Why: a checkpointed layer's backward recomputes its forward from the saved inputs. In a
``lax.scan`` the loop keeps that recomputation inside the layer's backward step. In an
unrolled Python loop nothing does: XLA's CPU compiler drops ``jax.checkpoint``'s optimization
barriers and common-subexpression elimination merges the recomputation back into the forward,
so ``remat='full'`` holds every layer's activations, exactly like no remat (the compiled
``memory_analysis()`` of a list-layer Llama shows the same temporaries for both); explicit
FSDP's per-layer gathers are all hoisted to the start. Here each layer is a
``jax.custom_vjp`` whose values are tied with ``v + 0 * max(other[:2])`` (bit-identical for
finite values; a NaN or inf in the tying elements spreads, as it would through the gradient
anyway; the max is a reduction, which XLA materializes: one element read directly would be
fused into every consumer with the chain of layers that computed it, quadratic in depth):
its inputs to each other in the forward (parameter gathers wait for the layer's input), its
saved residuals to the incoming cotangent in the backward (the recomputation runs only once
that cotangent exists, and never equals a forward value), and its gradients to each other
(a layer's parameter gradients are finished before the layer below starts).

Example::

    layer = checkpoint_in_order(block, policy=jax.checkpoint_policies.nothing_saveable)
    for p in layer_params:
        x = layer(p, x)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shardax import _compat

__all__ = ["checkpoint_in_order", "tie", "zero_of"]


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _first(x: jax.Array) -> jax.Array:
    """One float32 value read from ``x``, through a reduction so that XLA materializes it
    (a plain element would be fused into every consumer, recomputing the chain of layers
    that produced it)."""
    return jnp.max(x.ravel()[:2]).astype(jnp.float32)


def _zero_from(cotangent: Any) -> jax.Array | None:
    """A float32 zero computed from one element of the cotangent (None if it has no floats)."""
    leaves = [g for g in jax.tree.leaves(cotangent) if _floating(g) and g.size]
    if not leaves:
        return None
    return _first(leaves[0]) * 0


def zero_of(tree: Any) -> jax.Array | None:
    """A float32 zero computed from two elements of every floating leaf of ``tree`` (None if
    it has none): adding it to a value makes that value wait for all of ``tree``.

    >>> float(zero_of({"w": jnp.ones((2, 3))}))
    0.0
    """
    firsts = [_first(g) for g in jax.tree.leaves(tree)
              if _floating(g) and g.size]
    return sum(firsts) * 0 if firsts else None


def tie(tree: Any, zero: jax.Array | None) -> Any:
    """Every floating leaf of ``tree`` plus ``zero`` (now depending on it; bit-identical for
    finite values). Inside ``shard_map`` a leaf that varies over fewer manual axes than
    ``zero`` gets it summed over the others first (a scalar psum), so no leaf changes its
    type.

    >>> x = jnp.arange(3.0)
    >>> bool((tie(x, zero_of(x)) == x).all())
    True
    """
    if zero is None:
        return tree
    zeros: dict[frozenset, jax.Array] = {}

    def one(x):
        if not _floating(x):
            return x
        extra = _compat.varying_axes(zero) - _compat.varying_axes(x)
        if extra not in zeros:
            zeros[extra] = lax.psum(zero, tuple(sorted(extra))) if extra else zero
        return x + zeros[extra].astype(x.dtype)

    return jax.tree.map(one, tree)


def checkpoint_in_order(
    fn: Callable[..., Any],
    policy: Callable[..., bool] | None = None,
    *,
    tie_params: bool = False,
) -> Callable[..., Any]:
    """``jax.checkpoint(fn, policy=policy)`` whose recomputation waits for its cotangent.

    ``fn(*params, x)``: its last argument is the layer's input activation. Same values and
    gradients as ``jax.checkpoint``; use it for layers unrolled in Python (inside
    ``lax.scan`` plain ``jax.checkpoint`` already keeps its place). ``fn`` may close over
    traced values (segment ids, positions): they are hoisted into arguments.
    ``tie_params``: the parameters are tied too (each forward use waits for ``x``, each
    backward recomputation for the cotangent): for parameters that are gathered inside the
    layer (explicit FSDP), where the gathers would otherwise be hoisted or merged. It costs a
    pass over the (sharded) parameters; without it the backward only ties ``x`` and the
    saved activations.

    Example::

        y = checkpoint_in_order(lambda p, x: jnp.tanh(x @ p), policy=None)(w, x)
    """

    def run(*args: Any) -> Any:
        closed, consts = jax.closure_convert(fn, *args)
        remat = jax.checkpoint(closed, policy=policy)
        n = len(args)
        tie_mask: list[bool] = []  # per residual leaf, set when the forward is traced

        @jax.custom_vjp
        def layer(*inputs: Any) -> Any:
            return closed(*inputs)

        def forward(*inputs: Any) -> tuple[Any, Any]:
            params, x = inputs[: n - 1], inputs[n - 1]
            if tie_params:  # the layer's parameter gathers wait for its input
                params = tie(params, zero_of(x))
            used = (*params, x, *inputs[n:])
            out, pullback = jax.vjp(remat, *used)
            # The pullback keeps the untied inputs (the same values), not copies of them.
            kinds = {}
            for i, (u, v) in enumerate(zip(used, inputs)):
                for tu, tv in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
                    kinds[id(tu)] = (tv, i == n - 1 or (tie_params and i < n - 1))
            residuals, tree = jax.tree.flatten(pullback)
            tie_mask[:] = [kinds.get(id(r), (r, True))[1] for r in residuals]
            residuals = [kinds.get(id(r), (r, True))[0] for r in residuals]
            return out, jax.tree.unflatten(tree, residuals)

        def backward(pullback: Any, cotangent: Any) -> tuple[Any, ...]:
            zero = _zero_from(cotangent)
            if zero is None:
                return pullback(cotangent)
            residuals, tree = jax.tree.flatten(pullback)
            residuals = [tie(r, zero) if wait else r for r, wait in zip(residuals, tie_mask)]
            grads = jax.tree.unflatten(tree, residuals)(cotangent)
            # The input's gradient waits for the parameter gradients, so they (and their
            # reduce-scatters) are done before the layer below starts its backward.
            zero_all = zero_of(grads[: n - 1])
            return (*grads[: n - 1], tie(grads[n - 1], zero_all), *grads[n:])

        layer.defvjp(forward, backward)
        return layer(*args, *consts)

    return run
