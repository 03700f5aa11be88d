"""Pipeline parallelism over one mesh axis (default ``'pp'``) for a stack of identical layers.

Parameters are a pytree whose leaves carry a leading layer axis ``[L, ...]`` (the layout
``jax.lax.scan`` / ``nnx.scan`` produce); ``layer_fn(params_i, x) -> x`` is one layer. The batch
is split into ``M`` microbatches that flow through the stages. The program is written in the
global view: the stages are a leading ``[P]`` array dim sharded over the pipeline axis, each
stage's layers are ``jax.vmap``-ped over it, and activations move one stage on with a
``lax.ppermute`` (a small ``jax.shard_map`` over the pipeline axis). Every other mesh axis
(``dp``, ``fsdp``, ``tp``, ...) is left to XLA, and ``layer_fn`` may itself run
``jax.shard_map`` blocks over other axes (tensor, context, expert parallel), which a pipeline
that was one manual region could not nest. Gradients come from autodiff through the pipeline
(GPipe: all forwards, then all backwards), except under ``'1f1b'``.

Schedules:

* ``'gpipe'``: stage ``s`` holds layers ``[s*L/P, (s+1)*L/P)``; ``M + P - 1`` steps.
* ``'circular'`` (interleaved, ``V`` virtual stages): layer ``i`` lives on stage
  ``(i // (L/(P*V))) % P`` and microbatches loop ``V`` times around the ring;
  ``V*M + P - 1`` steps of ``1/V`` the work each. Needs ``M >= P`` when ``V > 1``.
* ``'1f1b'``: the GPipe layout and bubble, but each stage runs the backward pass of a
  microbatch as soon as the loss of it is known (one forward, one backward per step), so a
  stage keeps the inputs of at most ``2P - 1`` microbatches instead of all ``M``: activation
  memory no longer grows with ``M``. Needs ``loss_fn``; the loss is the mean over microbatches
  of ``loss_fn`` applied to each (equal to ``loss_fn`` on the whole batch when that is a mean
  over rows). Its gradients are computed inside the forward pass (a ``jax.custom_vjp``), so
  first-order derivatives only.

Both take the parameters in the *stage layout* (:func:`to_stage_layout`): a plain
``P('pp')`` on the leading axis gives each stage its layers. For ``'gpipe'`` (and whenever
``P == 1`` or ``V == 1``) the stage layout is the sequential layout.

Without a mesh, without a ``pp`` axis, or with ``pp`` of size 1, :func:`pipeline` is the plain
sequential scan over layers (:func:`sequential`), so the same code runs on one device.

Example::

    def layer(p, h):
        return h + jnp.tanh(h @ p["w"] + p["b"])

    params = {"w": jnp.zeros((8, 16, 16)), "b": jnp.zeros((8, 16))}   # L = 8 layers
    mesh = jax.make_mesh((4, 2), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda p, x: pipeline(layer, p, x, num_microbatches=4))(params, x)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "Schedule",
    "bubble_fraction",
    "from_stage_layout",
    "pipeline",
    "pipeline_size",
    "sequential",
    "stage_specs",
    "to_stage_layout",
]

Schedule = Literal["gpipe", "circular", "1f1b"]
_SCHEDULES = ("gpipe", "circular", "1f1b")
PyTree = Any
_X = "pipeline_layer_input"


def bubble_fraction(
    schedule: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Fraction of pipeline step time a stage sits idle (textbook formula).

    ``'gpipe'`` and ``'1f1b'``: ``(P-1)/(M+P-1)``; ``'circular'``: ``(P-1)/(V*M+P-1)`` (each of the
    ``V*M + P - 1`` steps does ``1/V`` of a stage's layers, so the fill/drain is ``V`` times
    shorter). Example: ``bubble_fraction('gpipe', 4, 4) == 3/7``.
    """
    _check_schedule(schedule, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(
            f"bubble_fraction needs num_stages, num_microbatches, virtual_stages >= 1; got "
            f"num_stages={p}, num_microbatches={m}, virtual_stages={v}"
        )
    steps = (v * m if schedule == "circular" else m) + p - 1
    return (p - 1) / steps


def pipeline_size(axis: str = "pp", mesh: jax.sharding.Mesh | None = None) -> int:
    """Size of the pipeline axis of ``mesh`` (or of the ``jax.set_mesh`` context); 1 if absent."""
    m = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if m is None or m.empty or axis not in m.axis_names:
        return 1
    return int(m.shape[axis])


def to_stage_layout(params: PyTree, num_stages: int, virtual_stages: int = 1) -> PyTree:
    """Reorder a sequential layer stack ``[L, ...]`` into the stage layout.

    Row ``j = s*(L/P) + r*K + k`` of the result is layer ``(r*P + s)*K + k`` with
    ``K = L/(P*V)``: stage ``s`` (rows ``[s*L/P, (s+1)*L/P)`` under ``P('pp')``) holds its
    chunks ``r = 0..V-1`` in order. Identity when ``P == 1`` or ``V == 1``. Example: ``L=8, P=2,
    V=2`` gives row order ``[0, 1, 4, 5, 2, 3, 6, 7]``.
    """
    return _relayout(params, num_stages, virtual_stages, to_stage=True)


def from_stage_layout(params: PyTree, num_stages: int, virtual_stages: int = 1) -> PyTree:
    """Inverse of :func:`to_stage_layout`: back to the sequential ``[L, ...]`` layer order."""
    return _relayout(params, num_stages, virtual_stages, to_stage=False)


def stage_specs(params: PyTree, axis: str = "pp", layer_specs: PyTree | None = None) -> PyTree:
    """``PartitionSpec`` tree sharding the leading layer axis of every leaf over ``axis``.

    ``layer_specs`` (a tree of per-layer specs for the trailing dims, e.g. fsdp/tp rules applied
    to one layer) is appended: ``P('fsdp', 'tp')`` becomes ``P('pp', 'fsdp', 'tp')``.
    Example: ``jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s),
    stage_specs(params)))``.
    """
    if layer_specs is None:
        return jax.tree.map(lambda _: P(axis), params)
    return jax.tree.map(
        lambda _, s: P(axis, *(s if s is not None else ())),
        params,
        layer_specs,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )


def sequential(layer_fn: Callable[[PyTree, PyTree], PyTree], params: PyTree, x: PyTree) -> PyTree:
    """Reference path: ``x = layer_fn(params[i], x)`` for ``i = 0..L-1`` with ``lax.scan``."""
    return lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]


def pipeline(
    layer_fn: Callable[[PyTree, PyTree], PyTree],
    params: PyTree,
    x: PyTree,
    *,
    num_microbatches: int,
    schedule: Schedule = "gpipe",
    virtual_stages: int = 1,
    loss_fn: Callable[..., jax.Array] | None = None,
    loss_args: tuple = (),
    loss_batch_args: tuple = (),
    loss_has_aux: bool = False,
    remat: bool = True,
    remat_policy: Callable[..., bool] | None = None,
    axis: str = "pp",
    mesh: jax.sharding.Mesh | None = None,
) -> PyTree:
    """Apply ``L`` layers to ``x`` as a pipeline over mesh axis ``axis``.

    Args:
      layer_fn: ``layer_fn(params_i, h) -> h`` (same structure, shapes and dtypes as ``h``).
      params: pytree of ``[L, ...]`` leaves in the stage layout (see :func:`to_stage_layout`).
      x: array or pytree of arrays with a common leading batch dim ``B``, ``B % M == 0``.
        Microbatch ``j`` is rows ``j, j+M, j+2M, ...`` so a ``dp`` sharding of the batch stays
        local to each microbatch.
      num_microbatches: ``M``.
      schedule: ``'gpipe'``, ``'circular'`` or ``'1f1b'``; ``virtual_stages`` is ``V``
        (circular only).
      loss_fn: optional ``loss_fn(outputs, *loss_batch_args, *loss_args) -> array`` (a scalar
        loss, or a small array of them), computed on the stage that holds the outputs; only
        its result is then reduced over ``axis``. ``loss_batch_args`` (e.g. labels) have the
        leading batch dim of ``x``; ``loss_args`` (e.g. head params) are anything else. Both
        are differentiable and replicated over ``axis``. ``loss_fn`` runs manual over
        ``axis``: it must not itself use ``shard_map``. Under ``'1f1b'`` it must return a
        scalar and is applied to each microbatch (with its rows of ``loss_batch_args``); the
        result is the mean over microbatches; it may not close over traced float values.
      loss_has_aux: ``loss_fn`` returns ``(loss, aux)`` with ``aux`` a pytree of arrays to
        report (metrics), not differentiate, as in ``jax.value_and_grad(has_aux=True)``; the
        pipeline then returns ``(loss, aux)``, ``aux`` under ``lax.stop_gradient`` (under
        ``'1f1b'``: ``loss`` a scalar, both averaged over microbatches).
      remat: recompute each layer in the backward pass, storing only its input (one microbatch
        per layer per step) as GPipe does; ``remat_policy`` (a ``jax.checkpoint_policies``
        policy, e.g. ``dots_saveable``) saves more. ``remat=False`` stores every residual; with
        ``V > 1`` that includes one copy of a chunk's weights per step. Under ``'1f1b'`` a
        stage always recomputes its forward pass from the stored stage input; ``remat`` then
        also recomputes each layer inside it (stores layer inputs, not every residual, of the
        one microbatch in flight). The no-mesh path is a plain scan either way (wrap
        ``layer_fn`` in ``jax.checkpoint`` there if needed).
      axis: pipeline mesh axis; mesh: explicit mesh, else the ``jax.set_mesh`` context mesh.

    Returns:
      the outputs (same shape as ``x``, replicated over ``axis``), or what ``loss_fn`` returns
      (with ``loss_has_aux``, its ``aux`` without gradient).

    Example::

        loss = pipeline(layer, params, x, num_microbatches=8, schedule="circular",
                        virtual_stages=2, loss_fn=xent, loss_args=(labels,))
    """
    num_stages = pipeline_size(axis, mesh)
    _check_schedule(schedule, virtual_stages)
    v = virtual_stages if schedule == "circular" else 1
    m = num_microbatches
    num_layers = _num_layers(params, num_stages, v, axis)
    batch = _batch_size(x, m)
    if v > 1 and m < num_stages:
        raise ValueError(
            f"circular pipeline over axis '{axis}' of size {num_stages} with virtual_stages={v} "
            f"needs num_microbatches >= {num_stages} (got {m}): a microbatch must be back at "
            "stage 0 before it is needed there again"
        )
    mb_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct((batch // m, *a.shape[1:]), a.dtype), x)
    _check_layer(layer_fn, params, mb_shapes)
    batch_args, loss_args = tuple(loss_batch_args), tuple(loss_args)
    _check_batch_args(batch_args, batch)
    if loss_has_aux and loss_fn is None:
        raise ValueError("pipeline loss_has_aux=True needs a loss_fn")
    if schedule == "1f1b":
        _check_1f1b(loss_fn, x, mb_shapes, batch_args, loss_args, m, loss_has_aux)
        if not loss_has_aux:  # one code path: the 1F1B loss region always yields (loss, aux)
            loss_fn = _with_no_aux(loss_fn)

    if num_stages == 1:
        out = sequential(layer_fn, params, x)
        if loss_fn is None:
            return out
        if schedule == "1f1b":
            loss_fn = _mean_over_microbatches(loss_fn, len(batch_args), m)
        return _finish_loss(loss_fn(out, *batch_args, *loss_args), schedule, loss_has_aux)

    k = num_layers // (num_stages * v)
    run = functools.partial(
        _run_stages, layer_fn, axis=axis, mesh=mesh, num_stages=num_stages, v=v, m=m, k=k,
        remat=remat, remat_policy=remat_policy,
    )
    if loss_fn is None:
        return jax.tree.map(_from_microbatches, _on_stage0(run(params, x)))
    if schedule != "1f1b":
        result = _loss_on_stage0(loss_fn, run(params, x), batch_args + loss_args, axis, mesh)
        return _finish_loss(result, schedule, loss_has_aux)
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
    result = _one_f_one_b(
        _Static(layer_fn, loss_fn, axis, mesh, num_stages, m, remat, remat_policy),
        params, x, batch_args, loss_args, layer_consts,
    )
    return _finish_loss(result, schedule, loss_has_aux)


def _with_no_aux(loss_fn):
    return lambda *args: (loss_fn(*args), ())


def _finish_loss(result, schedule, has_aux):
    """What :func:`pipeline` returns for ``loss_fn``'s ``result``: ``aux`` gets no gradient."""
    if has_aux:
        if not isinstance(result, tuple) or len(result) != 2:
            raise ValueError(f"loss_has_aux=True needs loss_fn to return (loss, aux); got {result}")
        loss, aux = result
        return loss, lax.stop_gradient(aux)
    return result[0] if schedule == "1f1b" else result


def _run_stages(layer_fn, params, x, *, axis, mesh, num_stages, v, m, k, remat, remat_policy):
    """Every pipeline step in the global view: the stages are a leading ``[P]`` array dim
    sharded over ``axis``, each stage's chunk of layers is ``jax.vmap``-ed over it, and
    activations move one stage on with a ``ppermute``. Nothing around ``layer_fn`` is a manual
    region, so ``layer_fn`` may itself use ``shard_map`` over other axes (tensor, context or
    expert parallel blocks). Returns stage-major buffers ``[P, M, B/M, ...]``; row 0 holds the
    outputs (they land on stage 0 after their last trip round the ring)."""
    p = num_stages
    pin = functools.partial(_pin_stages, axis=axis, mesh=mesh)
    shift = _ring_shift(axis, mesh, p, +1)
    stages, stage = _stage_params(params, p, pin)

    def run_chunk(params, trip, h):
        def one(h, layer_params):
            return layer_fn(layer_params, checkpoint_name(h, _X) if remat else h), None

        if v > 1:  # the stage's rows [trip*K, (trip+1)*K)
            params = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, trip * k, k), params)
        return lax.scan(one, h, params)[0]

    if remat:
        # Save each layer's input (one microbatch) and recompute the layer in the backward pass.
        # This also keeps the step-dependent weight slices out of the residuals, which would
        # otherwise store one copy of the chunk's weights per pipeline step.
        policy = jax.checkpoint_policies.save_only_these_names(_X)
        if remat_policy is not None:
            policy = jax.checkpoint_policies.save_from_both_policies(remat_policy, policy)
        run_chunk = jax.checkpoint(run_chunk, policy=policy)
    run_all = jax.vmap(run_chunk)

    # buf[s] is stage s's copy of the microbatched input; stage 0's also collects what comes
    # back round the ring (the next trip's input, and finally the outputs). The copies are
    # local: x is not split over `axis`, so broadcasting it costs no communication.
    def stage_copies(a):
        mb = _to_microbatches(a, m)
        return jnp.broadcast_to(mb, (p, *mb.shape))

    buf = pin(jax.tree.map(stage_copies, x))
    # Bubble steps compute on real data (not zeros) so layers never see unrealistic inputs
    # whose masked-out gradients could still be NaN * 0.
    state = jax.tree.map(lambda b: b[:, 0], buf)

    def step(carry, t):
        buf, state = carry
        first = jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, t % m, 1, False), buf)
        h = jax.tree.map(functools.partial(_where_stage, stage == 0), first, state)
        # Trip r (the r-th time round the ring) runs the stage's r-th chunk of K layers.
        out = run_all(stages, jnp.clip((t - stage) // m, 0, v - 1), h)
        state = pin(jax.tree.map(shift, out))
        # Stage 0 just received what the last stage computed for microbatch-step u.
        u = t - (p - 1)
        keep, slot = (stage == 0) & (u >= 0), u % m
        buf = jax.tree.map(
            lambda b, s: lax.dynamic_update_index_in_dim(
                b, _where_stage(keep, s, lax.dynamic_index_in_dim(b, slot, 1, False)), slot, 1
            ),
            buf,
            state,
        )
        return (pin(buf), state), None

    (buf, _), _ = lax.scan(step, (buf, state), jnp.arange(v * m + p - 1))
    return buf


def _on_stage0(buf):
    return jax.tree.map(lambda b: b[0], buf)


def _loss_on_stage0(loss_fn, buf, loss_args, axis, mesh):
    """``loss_fn(outputs, *loss_args)`` run by stage 0 alone (it holds the outputs); only the
    scalar is reduced over ``axis``. ``loss_fn`` must not itself be manual over ``axis``."""

    def body(buf, loss_args):
        out = jax.tree.map(lambda b: _from_microbatches(b[0]), buf)
        # Only stage 0 runs the branch, so it must hold no collective over `axis`: mark the
        # (replicated) loss_args varying out here, or their gradient psum lands inside the cond
        # and deadlocks. Collectives over the other (auto) axes stay within one stage: fine.
        loss_args = lax.pcast(loss_args, axis, to="varying")
        shapes = jax.eval_shape(loss_fn, out, *loss_args)
        zeros = lambda: _varying_zeros(shapes, axis)  # noqa: E731
        loss = lax.cond(lax.axis_index(axis) == 0, lambda: loss_fn(out, *loss_args), zeros)
        return lax.psum(loss, axis)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(), axis_names={axis})
    return run(buf, loss_args)


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
    out = _run_stages(
        lambda lp, h: s.layer_fn(lp, h, *layer_consts), params, x, axis=s.axis, mesh=s.mesh,
        num_stages=p, v=1, m=s.num_microbatches, k=_num_layers(params, p, 1, s.axis) // p,
        remat=False, remat_policy=None,
    )
    loss_fn = _mean_over_microbatches(s.loss_fn, len(batch_args), s.num_microbatches)
    return _loss_on_stage0(loss_fn, out, batch_args + loss_args, s.axis, s.mesh)


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
    pin = functools.partial(_pin_stages, axis=axis, mesh=mesh)
    down, up = _ring_shift(axis, mesh, p, +1), _ring_shift(axis, mesh, p, -1)
    stages, stage = _stage_params(params, p, pin)
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
        return jax.tree.map(lambda a, b: a + _where_stage(mask, b, jnp.zeros_like(b)), acc, g)

    x_mb = jax.tree.map(functools.partial(_to_microbatches, m=m), x)
    batch_mb = jax.tree.map(functools.partial(_to_microbatches, m=m), batch_args)
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
                functools.partial(_where_stage, stage == 0),
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
                ct = jax.tree.map(functools.partial(_where_stage, stage == p - 1), d_out, ct)
            d_stage, d_h, d_consts = backward_all(stages, _load(c["stash"], j % r), ct)
            c["d_params"] = pin(add_where(ok, c["d_params"], d_stage))
            c["d_consts"] = pin(add_where(ok, c["d_consts"], d_consts))
            done = t - 2 * (p - 1)  # stage 0's microbatch
            keep = (stage == 0) & (done >= 0)
            c["d_x"] = jax.tree.map(
                lambda buf, g: lax.dynamic_update_index_in_dim(
                    buf,
                    _where_stage(keep, g, lax.dynamic_index_in_dim(buf, done % m, 1, False)),
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
        return jax.tree.map(lambda b: _from_microbatches(b[s_]), buf)

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
        # inside the branch only the last stage runs (see _loss_on_stage0).
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
        zeros = lambda: _varying_zeros(shapes, axis)  # noqa: E731
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


def _varying_zeros(shapes, axis):
    """Zeros of ``shapes`` (a tree of ``ShapeDtypeStruct``), varying over manual ``axis``: the
    branch of a ``lax.cond`` that the stages without the loss take."""
    return jax.tree.map(lambda a: lax.pcast(jnp.zeros(a.shape, a.dtype), axis, to="varying"),
                        shapes)


def _mean_over_microbatches(loss_fn, num_batch_args, m):
    """``loss_fn`` applied to each microbatch of the outputs and of the first
    ``num_batch_args`` arguments (the rest are shared), averaged (each leaf of its result)."""

    def mean_loss(out, *args):
        batch, rest = args[:num_batch_args], args[num_batch_args:]
        split = jax.tree.map(functools.partial(_to_microbatches, m=m), (out, batch))
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


def _ring_shift(axis, mesh, p, direction):
    """Send each stage's slice of a ``[P, ...]`` array to stage ``s + direction`` (mod P)."""
    pairs = [(s, (s + direction) % p) for s in range(p)]
    return jax.shard_map(
        lambda a: lax.ppermute(a, axis, pairs),
        mesh=mesh, in_specs=P(axis), out_specs=P(axis), axis_names={axis},
    )


def _stage_params(params, p, pin):
    """``[L, ...] -> [P, L/P, ...]`` (stage s holds rows ``[s*L/P, (s+1)*L/P)``, already on its
    devices) and the stage index ``[P]``."""
    stages = pin(jax.tree.map(lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:]), params))
    return stages, pin(jnp.arange(p))


def _where_stage(mask, a, b):
    """Per-stage select between two ``[P, ...]`` arrays (``mask`` is ``[P]``)."""
    return jnp.where(mask.reshape(-1, *(1,) * (a.ndim - 1)), a, b)


def _pin_stages(tree, axis, mesh):
    """Shard the leading (stage) dim of every leaf over ``axis``; other dims are left to XLA."""

    def one(a):
        spec = P(axis, *(P.UNCONSTRAINED,) * (a.ndim - 1))
        return lax.with_sharding_constraint(a, NamedSharding(mesh, spec) if mesh else spec)

    return jax.tree.map(one, tree)


def _to_microbatches(a: jax.Array, m: int) -> jax.Array:
    # [B, ...] -> [M, B/M, ...] with microbatch j = rows j, j+M, ...: a batch sharding stays on
    # the B/M dim, so splitting needs no communication.
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _from_microbatches(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _relayout(params, num_stages, virtual_stages, to_stage):
    p, v = num_stages, virtual_stages
    _num_layers(params, p, v, "pp")

    def one(a):
        k = a.shape[0] // (p * v)
        rest = a.shape[1:]
        if to_stage:  # layer (r, s, k) -> row (s, r, k)
            return jnp.swapaxes(a.reshape(v, p, k, *rest), 0, 1).reshape(a.shape)
        return jnp.swapaxes(a.reshape(p, v, k, *rest), 0, 1).reshape(a.shape)

    return jax.tree.map(one, params)


def _check_schedule(schedule, virtual_stages):
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {_SCHEDULES}")
    if virtual_stages < 1 or (schedule != "circular" and virtual_stages != 1):
        raise ValueError(
            f"schedule {schedule!r} got virtual_stages={virtual_stages}; 'gpipe' and '1f1b' "
            "need 1, 'circular' needs >= 1"
        )


def _check_batch_args(batch_args, batch):
    for path, shape in _shapes(batch_args):
        if not shape or shape[0] != batch:
            raise ValueError(
                f"pipeline loss_batch_args leaf {path} of shape {shape} must have the leading "
                f"batch dim of x ({batch})"
            )


def _check_1f1b(loss_fn, x, mb_shapes, batch_args, loss_args, m, has_aux):
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


def _shapes(tree):
    return [
        (jax.tree_util.keystr(k), jnp.shape(a))
        for k, a in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _num_layers(params, num_stages, v, axis):
    leaves = _shapes(params)
    if not leaves:
        raise ValueError("pipeline params have no array leaves")
    path0, shape0 = leaves[0]
    for path, shape in leaves:
        if not shape or shape[0] != shape0[0]:
            raise ValueError(
                f"pipeline params need a leading layer axis shared by all leaves; leaf {path} "
                f"of shape {shape} has {shape[0] if shape else 0} layers but {path0} of shape "
                f"{shape0} has {shape0[0] if shape0 else 0}"
            )
    n = shape0[0]
    if n % (num_stages * v):
        raise ValueError(
            f"number of layers L={n} (leading dim of params leaf {path0}, shape {shape0}) must "
            f"be divisible by pipeline axis '{axis}' size {num_stages} x virtual_stages {v} = "
            f"{num_stages * v}"
        )
    return n


def _batch_size(x, m):
    leaves = _shapes(x)
    if not leaves:
        raise ValueError("pipeline input x has no array leaves")
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    b = leaves[0][1][0] if leaves[0][1] else None
    for path, shape in leaves:
        if not shape or shape[0] != b or b % m:
            raise ValueError(
                f"pipeline input leaf x{path} of shape {shape}: the leading batch dim must be "
                f"shared by all leaves (first leaf shape {leaves[0][1]}) and divisible by "
                f"num_microbatches={m}"
            )
    return b


def _check_layer(layer_fn, params, mb_shapes):
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), params)
    out = jax.eval_shape(layer_fn, one, mb_shapes)
    want = jax.tree.map(lambda s: (s.shape, s.dtype), mb_shapes)
    got = jax.tree.map(lambda s: (s.shape, s.dtype), out)
    if jax.tree.structure(out) != jax.tree.structure(mb_shapes) or got != want:
        raise ValueError(
            "pipeline layer_fn must map a microbatch to the same structure, shapes and dtypes "
            f"(identical layers); input {want}, output {got}"
        )
