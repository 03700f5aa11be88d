"""The 1F1B pipeline schedule: each stage runs a microbatch's backward pass as soon as its loss
is known, so a stage keeps at most ``2P - 1`` microbatches in flight (see :func:`pipeline`).

Its gradients are formed inside the forward pass (a ``jax.custom_vjp``): first-order only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax.parallel._stages import (
    count_layers,
    from_microbatches,
    loss_on_stage0,
    pin_stages,
    ring_shift,
    run_stages,
    split_stages,
    to_microbatches,
    varying_zeros,
    where_stage,
)

__all__ = ["check_1f1b", "mean_over_microbatches", "one_f_one_b"]


def one_f_one_b(
    layer_fn: Callable, loss_fn: Callable, params, x, batch_args: tuple, loss_args: tuple, *,
    axis: str, mesh: jax.sharding.Mesh | None, num_stages: int, num_microbatches: int,
    remat: bool, remat_policy: Callable | None,
):
    """``(loss, aux)`` of the 1F1B schedule: the mean over microbatches of ``loss_fn`` (which
    returns ``(loss, aux)``), its gradients formed inside the pass. Called by
    :func:`shardax.parallel.pipeline` with the same arguments it documents.

    Example::

        loss, aux = one_f_one_b(layer, loss_fn, params, x, (labels,), (), axis="pp",
                                mesh=None, num_stages=4, num_microbatches=8, remat=True,
                                remat_policy=None)
    """
    m = num_microbatches
    batch = jax.tree.leaves(x)[0].shape[0]
    # Traced values layer_fn closes over (e.g. a weight shared by all layers) become explicit
    # inputs of the custom_vjp, so they get gradients too.
    rows = functools.partial(jax.tree.map, lambda a: a[: batch // m])
    layer_fn, layer_consts = _hoist_closures(
        layer_fn, jax.tree.map(lambda a: a[0], params), rows(x)
    )
    if _hoist_closures(loss_fn, rows(x), *rows(batch_args), *loss_args)[1]:
        raise ValueError(
            "schedule '1f1b': loss_fn closes over traced float values; pass them in "
            "loss_args (or per-row ones in loss_batch_args) so they get gradients"
        )
    return _one_f_one_b(
        _Static(layer_fn, loss_fn, axis, mesh, num_stages, m, remat, remat_policy),
        params, x, batch_args, loss_args, layer_consts,
    )


class _Static(NamedTuple):
    """What the 1F1B pipeline needs besides its arrays (the ``custom_vjp``'s static argument)."""

    layer_fn: Callable
    loss_fn: Callable
    axis: str
    mesh: jax.sharding.Mesh | None
    num_stages: int
    num_microbatches: int
    remat: bool
    remat_policy: Callable | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _one_f_one_b(static, params, x, batch_args, loss_args, layer_consts):
    """The 1F1B loss. Without differentiation this is the GPipe forward pass and the mean of
    the per-microbatch losses; under differentiation :func:`_one_f_one_b_grads` runs instead
    and the gradients it computed are scaled by the incoming cotangent. ``static.layer_fn``
    takes ``layer_consts`` as trailing arguments."""
    s = static
    p = s.num_stages
    out = run_stages(
        lambda lp, h: s.layer_fn(lp, h, *layer_consts), params, x, axis=s.axis, mesh=s.mesh,
        num_stages=p, v=1, m=s.num_microbatches, k=count_layers(params, p, 1, s.axis) // p,
        remat=False, remat_policy=None,
    )
    loss_fn = mean_over_microbatches(s.loss_fn, len(batch_args), s.num_microbatches)
    return loss_on_stage0(loss_fn, out, batch_args + loss_args, s.axis, s.mesh)


def _one_f_one_b_bwd(static, grads, ct):
    ct = ct[0]  # the loss's; its aux (metrics) is not differentiated

    def scale(g):
        return None if g is None else (g * ct).astype(g.dtype)

    return jax.tree.map(scale, grads, is_leaf=lambda g: g is None)


def _one_f_one_b_grads(static, params, x, batch_args, loss_args, layer_consts):
    """Loss and its gradients in one pass over ``M + 2P - 2`` steps (the ``custom_vjp``'s
    forward rule, with symbolic zeros: gradients are formed only for the inputs that are
    differentiated, e.g. not for the labels or the RoPE tables). At step ``t`` stage ``s``
    runs the forward pass of microbatch ``t - s`` and the backward pass of microbatch
    ``t - 2(P-1) + s``; the last stage computes the loss of a microbatch (and its cotangent)
    right after its forward pass, so microbatch ``j``'s backward starts in the step its forward
    ends. For each microbatch in flight (at most ``2P - 1``) a stage keeps each layer's input
    (``remat``; the backward recomputes one layer at a time) or only its own input (the
    backward recomputes the whole stage at once). Warm-up steps run no backward
    pass and cool-down steps no forward pass (three scans), so the step count costs what
    GPipe's does: ``(M + P - 1)`` forward and backward passes per stage."""
    s = static
    p, m, axis, mesh = s.num_stages, s.num_microbatches, s.axis, s.mesh
    params = jax.tree.map(lambda a: a.value, params)
    (x, want_x), (batch_args, want_batch), (loss_args, want_args), (consts, want_consts) = (
        _unwrap(t) for t in (x, batch_args, loss_args, layer_consts)
    )
    diff_consts = _select(consts, want_consts)
    pin = functools.partial(pin_stages, axis=axis, mesh=mesh)
    down, up = ring_shift(axis, mesh, p, +1), ring_shift(axis, mesh, p, -1)
    stages, stage = split_stages(params, p, pin)
    def layer(lp, h, diff_consts=diff_consts):
        return s.layer_fn(lp, h, *_combine(diff_consts, consts))

    if s.remat_policy is not None:
        layer = jax.checkpoint(layer, policy=s.remat_policy)

    def run_stage(stage_params, h, diff_consts=diff_consts):
        """The stage's output, and what its backward pass needs: each layer's input with
        ``remat``, else the stage's input."""
        y, inputs = lax.scan(lambda h, lp: (layer(lp, h, diff_consts), h), h, stage_params)
        return y, (inputs if s.remat else h)

    def stage_vjp(stage_params, saved, ct):
        """Gradients of the stage's params, its input and the layers' closed-over values."""
        if not s.remat:  # recompute the whole stage, keep its residuals for this microbatch
            run = lambda p, h, c: run_stage(p, h, c)[0]  # noqa: E731
            return jax.vjp(run, stage_params, saved, diff_consts)[1](ct)

        def back(carry, layer_and_input):  # recompute one layer from its input
            ct, d_consts = carry
            d_layer, ct, d_c = jax.vjp(layer, *layer_and_input, diff_consts)[1](ct)
            return (ct, jax.tree.map(jnp.add, d_consts, d_c)), d_layer

        zeros = jax.tree.map(jnp.zeros_like, diff_consts)
        (ct, d_consts), d_stage = lax.scan(back, (ct, zeros), (stage_params, saved), reverse=True)
        return d_stage, ct, d_consts

    forward_all, backward_all = jax.vmap(run_stage), jax.vmap(stage_vjp)

    def at(tree, i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), tree)

    def per_stage(tree):  # a copy for each stage: local, the tree is not split over `axis`
        return pin(jax.tree.map(lambda a: jnp.broadcast_to(a, (p, *a.shape)), tree))

    def add_where(mask, acc, g):
        return jax.tree.map(lambda a, b: a + where_stage(mask, b, jnp.zeros_like(b)), acc, g)

    x_mb = jax.tree.map(functools.partial(to_microbatches, m=m), x)
    batch_mb = jax.tree.map(functools.partial(to_microbatches, m=m), batch_args)
    loss_at = _loss_region(s, loss_args, want_batch, want_args)
    r = min(m, 2 * p - 1)  # a stage's microbatches in flight: ring slots of its input store
    # Steps where a stage has no microbatch compute on real data (not zeros) with a zero
    # cotangent, so masked-out gradients are finite: the stash starts as copies of the first
    # microbatch (with remat, as every layer's input).
    first = at(x_mb, 0)
    saved = jax.eval_shape(run_stage, at(stages, 0), first)[1]
    saved = jax.tree.map(lambda a, f: jnp.broadcast_to(f, a.shape), saved, first)
    carry = dict(
        fwd_in=per_stage(first),  # what the previous stage sent forward
        bwd_in=per_stage(jax.tree.map(jnp.zeros_like, first)),  # ... the next stage sent back
        stash=per_stage(jax.tree.map(lambda a: jnp.broadcast_to(a, (r, *a.shape)), saved)),
        d_params=jax.tree.map(jnp.zeros_like, stages),
        d_x=per_stage(jax.tree.map(jnp.zeros_like, _select(x_mb, want_x))),  # on stage 0
        d_batch=per_stage(jax.tree.map(jnp.zeros_like, _select(batch_mb, want_batch))),
        d_args=per_stage(jax.tree.map(jnp.zeros_like, _select(loss_args, want_args))),
        d_consts=per_stage(jax.tree.map(jnp.zeros_like, diff_consts)),  # summed over stages
    )
    # (loss, aux) of one microbatch; their sums over microbatches accumulate on stage P-1.
    values = jax.eval_shape(
        lambda out, batch: s.loss_fn(out, *batch, *loss_args), first, at(batch_mb, 0)
    )
    carry["values"] = pin(jax.tree.map(lambda v: jnp.zeros((p, *v.shape), jnp.float32), values))

    def step(c, t, forward, backward):
        c = dict(c)
        d_out = None
        if forward:
            j = t - stage
            h = jax.tree.map(
                functools.partial(where_stage, stage == 0),
                per_stage(at(x_mb, jnp.minimum(t, m - 1))),
                c["fwd_in"],
            )
            y, saved = forward_all(stages, h)
            c["stash"] = _store(c["stash"], j % r, saved, (j >= 0) & (j < m))
            c["fwd_in"] = pin(jax.tree.map(down, y))
            if backward:  # steady state: the last stage just finished microbatch t - (P-1)
                done = t - (p - 1)
                value, d_out, d_batch, d_args = loss_at(y, at(batch_mb, done))
                c["values"] = jax.tree.map(
                    lambda acc, v: acc + v.astype(jnp.float32), c["values"], value
                )
                c["d_args"] = jax.tree.map(jnp.add, c["d_args"], d_args)
                c["d_batch"] = jax.tree.map(
                    lambda buf, g: lax.dynamic_update_index_in_dim(buf, g, done, 1),
                    c["d_batch"], d_batch,
                )
        if backward:
            j = t - 2 * (p - 1) + stage
            ok = (j >= 0) & (j < m)
            ct = c["bwd_in"]
            if d_out is not None:
                ct = jax.tree.map(functools.partial(where_stage, stage == p - 1), d_out, ct)
            d_stage, d_h, d_consts = backward_all(stages, _load(c["stash"], j % r), ct)
            c["d_params"] = pin(add_where(ok, c["d_params"], d_stage))
            c["d_consts"] = pin(add_where(ok, c["d_consts"], d_consts))
            done = t - 2 * (p - 1)  # stage 0's microbatch
            keep = (stage == 0) & (done >= 0)
            c["d_x"] = jax.tree.map(
                lambda buf, g: lax.dynamic_update_index_in_dim(
                    buf,
                    where_stage(keep, g, lax.dynamic_index_in_dim(buf, done % m, 1, False)),
                    done % m,
                    1,
                ),
                c["d_x"], _select(d_h, want_x),
            )
            c["bwd_in"] = pin(jax.tree.map(up, d_h))
        return c, None

    phases = [(0, p - 1, True, False), (p - 1, m + p - 1, True, True),
              (m + p - 1, m + 2 * p - 2, False, True)]
    for start, stop, forward, backward in phases:
        body = functools.partial(step, forward=forward, backward=backward)
        carry, _ = lax.scan(body, carry, jnp.arange(start, stop))

    def from_stage(buf, s_):
        return jax.tree.map(lambda b: from_microbatches(b[s_]), buf)

    d_params = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]),
                            carry["d_params"])
    d_args = jax.tree.map(lambda b: b[p - 1], carry["d_args"])
    d_consts = jax.tree.map(lambda b: jnp.sum(b, 0), carry["d_consts"])
    grads = (d_params, from_stage(carry["d_x"], 0), from_stage(carry["d_batch"], p - 1), d_args,
             d_consts)
    mean = jax.tree.map(lambda acc, v: (acc[p - 1] / m).astype(v.dtype), carry["values"], values)
    return mean, grads


_one_f_one_b.defvjp(_one_f_one_b_grads, _one_f_one_b_bwd, symbolic_zeros=True)


def _loss_region(static, loss_args, want_batch, want_args):
    """``f(y, batch_j) -> ((loss, aux), d_y, d_batch_j, d_loss_args)``, each stacked ``[P, ...]``
    and zero except on the last stage, which alone runs ``loss_fn`` on its outputs ``y[P-1]``
    and its vjp (seeded with ``1/M``: the loss is the mean over microbatches). Only the leaves
    ``want_*`` marks get gradients."""
    s = static
    axis, p, m = s.axis, s.num_stages, s.num_microbatches

    def body(y, batch_j, loss_args):
        out = jax.tree.map(lambda a: a[0], y)
        # Differentiable inputs are marked varying so that no gradient psum over `axis` lands
        # inside the branch only the last stage runs (see loss_on_stage0).
        diff = (_select(batch_j, want_batch), _select(loss_args, want_args))
        diff = lax.pcast(diff, axis, to="varying")

        def value_and_grads():
            def loss(out, diff):
                batch, args = (_combine(d, a) for d, a in zip(diff, (batch_j, loss_args)))
                return s.loss_fn(out, *batch, *args)

            value, pull, aux = jax.vjp(loss, out, diff, has_aux=True)
            d_out, (d_batch, d_args) = pull(jnp.ones_like(value) / m)
            return (value, aux), d_out, d_batch, d_args

        shapes = jax.eval_shape(value_and_grads)
        zeros = lambda: varying_zeros(shapes, axis)  # noqa: E731
        result = lax.cond(lax.axis_index(axis) == p - 1, value_and_grads, zeros)
        return jax.tree.map(lambda a: a[None], result)

    region = jax.shard_map(
        body, mesh=s.mesh, in_specs=(P(axis), P(), P()), out_specs=P(axis), axis_names={axis}
    )
    return lambda y, batch_j: region(y, batch_j, loss_args)


def _hoist_closures(fn, *example_args):
    """``(fn, ())`` when ``fn`` closes over no traced values that may be differentiated, else
    ``jax.closure_convert``'s version taking them as trailing arguments, and the values."""
    converted, consts = jax.closure_convert(fn, *example_args)
    return (converted, tuple(consts)) if consts else (fn, ())


def mean_over_microbatches(loss_fn, num_batch_args, m):
    """``loss_fn`` applied to each microbatch of the outputs and of the first
    ``num_batch_args`` arguments (the rest are shared), averaged (each leaf of its result)."""

    def mean_loss(out, *args):
        batch, rest = args[:num_batch_args], args[num_batch_args:]
        split = jax.tree.map(functools.partial(to_microbatches, m=m), (out, batch))
        per_microbatch = lax.map(lambda ob: loss_fn(ob[0], *ob[1], *rest), split)
        return jax.tree.map(lambda a: jnp.mean(a, axis=0).astype(a.dtype), per_microbatch)

    return mean_loss


def _unwrap(primals):
    """``custom_vjp`` primals (symbolic-zeros mode) -> values, and for each leaf whether its
    gradient is wanted: it is differentiated, and of a float dtype."""
    values = jax.tree.map(lambda a: a.value, primals)
    wanted = jax.tree.map(
        lambda a: a.perturbed and jnp.issubdtype(jnp.result_type(a.value), jnp.inexact), primals
    )
    return values, wanted


def _select(tree, wanted):
    """``tree`` with the leaves not ``wanted`` replaced by ``None``."""
    return jax.tree.map(lambda a, w: a if w else None, tree, wanted)


def _combine(selected, tree):
    """Inverse of :func:`_select`: leaves from ``selected`` where present, else from ``tree``."""
    return jax.tree.map(lambda d, a: a if d is None else d, selected, tree,
                        is_leaf=lambda d: d is None)


def _store(buf, slots, value, mask):
    """``buf[s, slots[s]] = value[s]`` on the stages where ``mask``; ``buf`` is ``[P, R, ...]``."""

    def one(b, i, v, keep):
        return lax.dynamic_update_index_in_dim(b, jnp.where(keep, v, b[i]), i, 0)

    return jax.tree.map(lambda b, v: jax.vmap(one)(b, slots, v, mask), buf, value)


def _load(buf, slots):
    """``buf[s, slots[s]]`` for every stage ``s``."""
    return jax.tree.map(lambda b: jax.vmap(lambda b, i: b[i])(b, slots), buf)


def check_1f1b(loss_fn, x, mb_shapes, batch_args, loss_args, m, has_aux):
    if loss_fn is None:
        raise ValueError(
            "schedule '1f1b' runs each microbatch's backward pass inside the pipeline, so it "
            "needs loss_fn (for outputs without a loss use 'gpipe', the same forward pass)"
        )
    for path, a in jax.tree_util.tree_leaves_with_path(x):
        if not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            raise ValueError(
                f"schedule '1f1b' needs floating-point activations; pipeline input leaf "
                f"x{jax.tree_util.keystr(path)} has dtype {jnp.result_type(a)} (pass integer "
                "per-row data to loss_fn through loss_batch_args)"
            )
    mb_batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype), batch_args
    )
    out = jax.eval_shape(loss_fn, mb_shapes, *mb_batch, *loss_args)
    if has_aux:
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError(f"loss_has_aux=True needs loss_fn to return (loss, aux); got {out}")
        out = out[0]
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
        raise ValueError(
            "schedule '1f1b' needs loss_fn to return a scalar for one microbatch (its gradient "
            "is taken inside the pipeline; report other values with loss_has_aux=True); "
            f"got {out}"
        )
