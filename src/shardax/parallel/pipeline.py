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
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardax.parallel._stages import (
    count_layers,
    from_microbatches,
    leaf_shapes,
    loss_on_stage0,
    on_stage0,
    run_stages,
)
from shardax.parallel.axes import axis_size
from shardax.parallel.one_f_one_b import check_1f1b, mean_over_microbatches, one_f_one_b

__all__ = [
    "Schedule",
    "bubble_fraction",
    "from_stage_layout",
    "pipeline",
    "sequential",
    "stage_specs",
    "to_stage_layout",
]

Schedule = Literal["gpipe", "circular", "1f1b"]
_SCHEDULES = ("gpipe", "circular", "1f1b")
PyTree = Any


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


def to_stage_layout(
    params: PyTree, num_stages: int, virtual_stages: int = 1, axis: str = "pp"
) -> PyTree:
    """Reorder a sequential layer stack ``[L, ...]`` into the stage layout.

    Row ``j = s*(L/P) + r*K + k`` of the result is layer ``(r*P + s)*K + k`` with
    ``K = L/(P*V)``: stage ``s`` (rows ``[s*L/P, (s+1)*L/P)`` under ``P('pp')``) holds its
    chunks ``r = 0..V-1`` in order. Identity when ``P == 1`` or ``V == 1``. Example: ``L=8, P=2,
    V=2`` gives row order ``[0, 1, 4, 5, 2, 3, 6, 7]``.
    """
    return _relayout(params, num_stages, virtual_stages, axis, to_stage=True)


def from_stage_layout(
    params: PyTree, num_stages: int, virtual_stages: int = 1, axis: str = "pp"
) -> PyTree:
    """Inverse of :func:`to_stage_layout`: back to the sequential ``[L, ...]`` layer order."""
    return _relayout(params, num_stages, virtual_stages, axis, to_stage=False)


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
    num_stages = axis_size(axis, mesh)
    _check_schedule(schedule, virtual_stages)
    v = virtual_stages if schedule == "circular" else 1
    m = num_microbatches
    num_layers = count_layers(params, num_stages, v, axis)
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
        check_1f1b(loss_fn, x, mb_shapes, batch_args, loss_args, m, loss_has_aux)
        if not loss_has_aux:  # one code path: the 1F1B loss region always yields (loss, aux)
            loss_fn = _with_no_aux(loss_fn)

    if num_stages == 1:
        out = sequential(layer_fn, params, x)
        if loss_fn is None:
            return out
        if schedule == "1f1b":
            loss_fn = mean_over_microbatches(loss_fn, len(batch_args), m)
        return _finish_loss(loss_fn(out, *batch_args, *loss_args), schedule, loss_has_aux)

    k = num_layers // (num_stages * v)
    run = functools.partial(
        run_stages, layer_fn, axis=axis, mesh=mesh, num_stages=num_stages, v=v, m=m, k=k,
        remat=remat, remat_policy=remat_policy,
    )
    if loss_fn is None:
        return jax.tree.map(from_microbatches, on_stage0(run(params, x)))
    if schedule != "1f1b":
        result = loss_on_stage0(loss_fn, run(params, x), batch_args + loss_args, axis, mesh)
        return _finish_loss(result, schedule, loss_has_aux)
    result = one_f_one_b(
        layer_fn, loss_fn, params, x, batch_args, loss_args, axis=axis, mesh=mesh,
        num_stages=num_stages, num_microbatches=m, remat=remat, remat_policy=remat_policy,
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


def _relayout(params, num_stages, virtual_stages, axis, to_stage):
    p, v = num_stages, virtual_stages
    count_layers(params, p, v, axis)

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
    for path, shape in leaf_shapes(batch_args):
        if not shape or shape[0] != batch:
            raise ValueError(
                f"pipeline loss_batch_args leaf {path} of shape {shape} must have the leading "
                f"batch dim of x ({batch})"
            )


def _batch_size(x, m):
    leaves = leaf_shapes(x)
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
