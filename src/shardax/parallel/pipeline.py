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
(GPipe: all forwards, then all backwards).

Schedules:

* ``'gpipe'``: stage ``s`` holds layers ``[s*L/P, (s+1)*L/P)``; ``M + P - 1`` steps.
* ``'circular'`` (interleaved, ``V`` virtual stages): layer ``i`` lives on stage
  ``(i // (L/(P*V))) % P`` and microbatches loop ``V`` times around the ring;
  ``V*M + P - 1`` steps of ``1/V`` the work each. Needs ``M >= P`` when ``V > 1``.

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

Schedule = Literal["gpipe", "circular"]
_SCHEDULES = ("gpipe", "circular")
PyTree = Any
_X = "pipeline_layer_input"


def bubble_fraction(
    schedule: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Fraction of pipeline step time a stage sits idle (textbook formula).

    ``'gpipe'``: ``(P-1)/(M+P-1)``; ``'circular'``: ``(P-1)/(V*M+P-1)`` (each of the
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
    steps = (m if schedule == "gpipe" else v * m) + p - 1
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
      schedule: ``'gpipe'`` or ``'circular'``; ``virtual_stages`` is ``V`` (circular only).
      loss_fn: optional ``loss_fn(outputs, *loss_args) -> array`` (a scalar loss, or a small
        array of them), computed on the stage that holds the outputs (stage 0, where they land
        after wrapping round the ring); only its result is then reduced over ``axis``.
        ``loss_args`` (e.g. labels, head params) are differentiable and replicated over
        ``axis``. ``loss_fn`` runs manual over ``axis``: it must not itself use ``shard_map``.
      remat: recompute each layer in the backward pass, storing only its input (one microbatch
        per layer per step) as GPipe does; ``remat_policy`` (a ``jax.checkpoint_policies``
        policy, e.g. ``dots_saveable``) saves more. ``remat=False`` stores every residual; with
        ``V > 1`` that includes one copy of a chunk's weights per step. The no-mesh path is a
        plain scan either way (wrap ``layer_fn`` in ``jax.checkpoint`` there if needed).
      axis: pipeline mesh axis; mesh: explicit mesh, else the ``jax.set_mesh`` context mesh.

    Returns:
      the outputs (same shape as ``x``, replicated over ``axis``), or what ``loss_fn`` returns.

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

    if num_stages == 1:
        out = sequential(layer_fn, params, x)
        return out if loss_fn is None else loss_fn(out, *loss_args)

    k = num_layers // (num_stages * v)
    out = _run_stages(layer_fn, params, x, axis, mesh, num_stages, v, m, k, remat, remat_policy)
    if loss_fn is None:
        return jax.tree.map(_from_microbatches, _on_stage0(out))
    return _loss_on_stage0(loss_fn, out, tuple(loss_args), axis, mesh)


def _run_stages(layer_fn, params, x, axis, mesh, num_stages, v, m, k, remat, remat_policy):
    """Every pipeline step in the global view: the stages are a leading ``[P]`` array dim
    sharded over ``axis``, each stage's chunk of layers is ``jax.vmap``-ed over it, and
    activations move one stage on with a ``ppermute``. Nothing around ``layer_fn`` is a manual
    region, so ``layer_fn`` may itself use ``shard_map`` over other axes (tensor, context or
    expert parallel blocks). Returns stage-major buffers ``[P, M, B/M, ...]``; row 0 holds the
    outputs (they land on stage 0 after their last trip round the ring)."""
    p = num_stages
    pin = functools.partial(_pin_stages, axis=axis, mesh=mesh)
    shift = jax.shard_map(
        lambda a: lax.ppermute(a, axis, [(s, (s + 1) % p) for s in range(p)]),
        mesh=mesh, in_specs=P(axis), out_specs=P(axis), axis_names={axis},
    )
    # [L, ...] -> [P, L/P, ...]: stage s holds rows [s*L/P, (s+1)*L/P), already on its devices.
    stages = pin(jax.tree.map(lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:]), params))
    stage = pin(jnp.arange(p))

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

    def where_stage(mask, a, b):  # per-stage select between two [P, ...] arrays
        return jnp.where(mask.reshape(-1, *(1,) * (a.ndim - 1)), a, b)

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
        h = jax.tree.map(functools.partial(where_stage, stage == 0), first, state)
        # Trip r (the r-th time round the ring) runs the stage's r-th chunk of K layers.
        out = run_all(stages, jnp.clip((t - stage) // m, 0, v - 1), h)
        state = pin(jax.tree.map(shift, out))
        # Stage 0 just received what the last stage computed for microbatch-step u.
        u = t - (p - 1)
        keep, slot = (stage == 0) & (u >= 0), u % m
        buf = jax.tree.map(
            lambda b, s: lax.dynamic_update_index_in_dim(
                b, where_stage(keep, s, lax.dynamic_index_in_dim(b, slot, 1, False)), slot, 1
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
        shape = jax.eval_shape(loss_fn, out, *loss_args)
        zero = lax.pcast(jnp.zeros(shape.shape, shape.dtype), axis, to="varying")
        loss = lax.cond(lax.axis_index(axis) == 0, lambda: loss_fn(out, *loss_args), lambda: zero)
        return lax.psum(loss, axis)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(), axis_names={axis})
    return run(buf, loss_args)


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
    if virtual_stages < 1 or (schedule == "gpipe" and virtual_stages != 1):
        raise ValueError(
            f"schedule {schedule!r} got virtual_stages={virtual_stages}; 'gpipe' needs 1, "
            "'circular' needs >= 1"
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
