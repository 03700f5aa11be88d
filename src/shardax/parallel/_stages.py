"""Stage and microbatch machinery shared by the pipeline schedules (GPipe/circular and 1F1B).

The stages are a leading ``[P]`` array dim sharded over the pipeline axis; microbatch ``j`` of a
``[B, ...]`` batch is rows ``j, j+M, j+2M, ...`` (a batch sharding stays local to each one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardax import _compat

_X = "pipeline_layer_input"


def run_stages(layer_fn, params, x, *, axis, mesh, num_stages, v, m, k, remat, remat_policy):
    """Every pipeline step in the global view: the stages are a leading ``[P]`` array dim
    sharded over ``axis``, each stage's chunk of layers is ``jax.vmap``-ed over it, and
    activations move one stage on with a ``ppermute``. Nothing around ``layer_fn`` is a manual
    region, so ``layer_fn`` may itself use ``shard_map`` over other axes (tensor, context or
    expert parallel blocks). Returns stage-major buffers ``[P, M, B/M, ...]``; row 0 holds the
    outputs (they land on stage 0 after their last trip round the ring)."""
    p = num_stages
    pin = functools.partial(pin_stages, axis=axis, mesh=mesh)
    shift = ring_shift(axis, mesh, p, +1)
    stages, stage = split_stages(params, p, pin)

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
        mb = to_microbatches(a, m)
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


def on_stage0(buf):
    return jax.tree.map(lambda b: b[0], buf)


def loss_on_stage0(loss_fn, buf, loss_args, axis, mesh):
    """``loss_fn(outputs, *loss_args)`` run by stage 0 alone (it holds the outputs); only the
    scalar is reduced over ``axis``. ``loss_fn`` must not itself be manual over ``axis``."""

    def body(buf, loss_args):
        out = jax.tree.map(lambda b: from_microbatches(b[0]), buf)
        # Only stage 0 runs the branch, so it must hold no collective over `axis`: mark the
        # (replicated) loss_args varying out here, or their gradient psum lands inside the cond
        # and deadlocks. Collectives over the other (auto) axes stay within one stage: fine.
        loss_args = lax.pcast(loss_args, axis, to="varying")
        shapes = jax.eval_shape(loss_fn, out, *loss_args)
        zeros = lambda: varying_zeros(shapes, axis)  # noqa: E731
        loss = lax.cond(lax.axis_index(axis) == 0, lambda: loss_fn(out, *loss_args), zeros)
        return lax.psum(loss, axis)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(), axis_names={axis})
    return run(buf, loss_args)


def varying_zeros(shapes, axis):
    """Zeros of ``shapes`` (a tree of ``ShapeDtypeStruct``), varying over manual ``axis`` and
    over the enclosing manual axes the shapes vary over (the pipeline inside explicit FSDP's
    region): the branch of a ``lax.cond`` that the stages without the loss take."""
    def one(a):
        axes = tuple(sorted({axis} | _compat.shape_varying_axes(a)))
        return lax.pcast(jnp.zeros(a.shape, a.dtype), axes, to="varying")

    return jax.tree.map(one, shapes)


def ring_shift(axis, mesh, p, direction):
    """Send each stage's slice of a ``[P, ...]`` array to stage ``s + direction`` (mod P)."""
    pairs = [(s, (s + direction) % p) for s in range(p)]
    return jax.shard_map(
        lambda a: lax.ppermute(a, axis, pairs),
        mesh=mesh, in_specs=P(axis), out_specs=P(axis), axis_names={axis},
    )


def split_stages(params, p, pin):
    """``[L, ...] -> [P, L/P, ...]`` (stage s holds rows ``[s*L/P, (s+1)*L/P)``, already on its
    devices) and the stage index ``[P]``."""
    stages = pin(jax.tree.map(lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:]), params))
    return stages, pin(jnp.arange(p))


def where_stage(mask, a, b):
    """Per-stage select between two ``[P, ...]`` arrays (``mask`` is ``[P]``)."""
    return jnp.where(mask.reshape(-1, *(1,) * (a.ndim - 1)), a, b)


def pin_stages(tree, axis, mesh):
    """Shard the leading (stage) dim of every leaf over ``axis``; other dims are left to XLA."""

    def one(a):
        spec = P(axis, *(P.UNCONSTRAINED,) * (a.ndim - 1))
        return lax.with_sharding_constraint(a, NamedSharding(mesh, spec) if mesh else spec)

    return jax.tree.map(one, tree)


def to_microbatches(a: jax.Array, m: int) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]`` with microbatch ``j`` = rows ``j, j+M, ...``: a batch sharding
    stays on the ``B/M`` dim, so splitting needs no communication (a plain ``[M, B/M]`` split
    would put each microbatch on a subset of the devices).

    >>> to_microbatches(jnp.arange(4), 2).tolist()
    [[0, 2], [1, 3]]
    """
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def from_microbatches(a: jax.Array) -> jax.Array:
    """Inverse of :func:`to_microbatches`: ``[M, B/M, ...] -> [B, ...]``."""
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def leaf_shapes(tree):
    return [
        (jax.tree_util.keystr(k), jnp.shape(a))
        for k, a in jax.tree_util.tree_leaves_with_path(tree)
    ]


def count_layers(params, num_stages, v, axis):
    leaves = leaf_shapes(params)
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
