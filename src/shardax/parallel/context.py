"""Context parallelism: ring attention over a sequence-sharded mesh axis (default ``'cp'``).

The sequence dimension of q, k and v is split over the ``cp`` mesh axis. Each device keeps its
query block and passes its key/value block around the ring with ``jax.lax.ppermute``; after
``cp`` steps every query block has seen every key/value block, combined with an online softmax
(running max and normaliser in float32). No device ever holds the full sequence of K/V or the
full ``[seq, seq]`` score matrix, in the forward or in the backward (a custom VJP sends K/V
round the ring again with their dK/dV accumulators). Other mesh axes (``fsdp``, ``tp`` ...)
stay with XLA: the ``shard_map`` is partial-manual over just ``cp``.

Causal attention on a contiguous split leaves device 0 with one block of work and device
``cp-1`` with ``cp`` blocks. :func:`load_balance` reorders the sequence so device ``i`` holds
chunks ``i`` and ``2*cp-1-i`` of ``2*cp``; then every device does the same work. The model
permutes its tokens (and RoPE positions, and labels) once, and ``ring_attention(...,
load_balanced=True)`` works in that layout; see ``docs/context_parallel.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardax.parallel import attention_kernel as kernel
from shardax.parallel.axes import axis_size, manual_axes

__all__ = ["attention", "load_balance", "ring_attention", "unload_balance"]


def _check_causal(q: jax.Array, k: jax.Array, causal: bool) -> None:
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs equal q and k sequence lengths; got q{tuple(q.shape)},"
            f" k{tuple(k.shape)}"
        )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = True,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Plain softmax attention with grouped-query heads; the single-device reference.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] with heads a
    multiple of kv_heads. Scores and softmax are float32; the output has q's dtype.

    >>> q = jnp.ones((2, 16, 4, 8))                    # [batch, seq, heads, head_dim]
    >>> k = v = jnp.ones((2, 16, 2, 8))                # [batch, seq, kv_heads, head_dim]
    >>> attention(q, k, v, causal=True).shape
    (2, 16, 4, 8)
    """
    kernel.check_qkv(q, k, v)
    _check_causal(q, k, causal)
    mask = kernel.allowed(*kernel.default_mask_inputs(q, k), causal, None)
    return kernel.reference(q, k, v, mask, kernel.Spec(causal=causal, scale=scale))


# ---------------------------------------------------------------------------------------------
# Load-balanced (zig-zag) sequence layout.


def _zigzag_order(axis_size: int) -> list[int]:
    # Device i holds chunks (i, 2n-1-i): [0, 2n-1, 1, 2n-2, ...].
    n = 2 * axis_size
    return [c for i in range(axis_size) for c in (i, n - 1 - i)]


def _permute_chunks(x: jax.Array, axis_size: int, seq_axis: int, inverse: bool) -> jax.Array:
    if axis_size < 1:
        raise ValueError(f"axis_size must be >= 1, got {axis_size}")
    ax = seq_axis % x.ndim
    s = x.shape[ax]
    n = 2 * axis_size
    if s % n:
        raise ValueError(
            f"load balancing over an axis of size {axis_size} splits the sequence into"
            f" 2*{axis_size}={n} chunks; seq={s} (axis {ax} of shape {tuple(x.shape)}) is not"
            " divisible by it"
        )
    order = _zigzag_order(axis_size)
    if inverse:
        order = sorted(range(n), key=order.__getitem__)
    xs = x.reshape(x.shape[:ax] + (n, s // n) + x.shape[ax + 1 :])
    xs = jnp.take(xs, jnp.asarray(order), axis=ax)
    return xs.reshape(x.shape)


def load_balance(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Reorders the sequence so that a contiguous split over ``axis_size`` devices balances
    causal attention: device ``i`` gets chunks ``i`` and ``2*axis_size-1-i`` of ``2*axis_size``.

    Apply it to token ids (or embeddings), RoPE positions and labels alike; undo it on outputs
    with :func:`unload_balance` (a mean loss over tokens does not need undoing).

    >>> tokens = jnp.arange(8)[None]                   # [batch, seq], cp=2 -> 4 chunks
    >>> load_balance(tokens, 2)                        # device 0: chunks 0, 3; device 1: 1, 2
    Array([[0, 1, 6, 7, 2, 3, 4, 5]], dtype=int32)
    >>> pos = load_balance(jnp.arange(8), 2, 0)        # positions for RoPE
    """
    return _permute_chunks(x, axis_size, seq_axis, inverse=False)


def unload_balance(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Exact inverse of :func:`load_balance`.

    >>> x = jnp.arange(16)[None]
    >>> bool((unload_balance(load_balance(x, 4), 4) == x).all())
    True
    """
    return _permute_chunks(x, axis_size, seq_axis, inverse=True)


# ---------------------------------------------------------------------------------------------
# Ring attention.


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, axis_size, spec):
    """Per-device ring loop (runs with ``axis`` manual). Blocks are local [b, s/cp, ...].
    Each step runs the blockwise kernel on the held K/V block (whose positions and segment
    ids travel with it, so masks are exact); partial results merge by log-sum-exp. Returns the
    output (float32) and the log-sum-exp of each query row ``[b, sq, heads]``."""
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    send = lambda x: jax.lax.ppermute(x, axis, perm)
    block = lambda kv: kernel.forward(q, kv[0], kv[1], q_pos, kv[2], q_seg, kv[3], spec)

    def ring_step(carry, _):
        (out, lse), kv = carry
        # The next block's transfer does not depend on this step's compute, so they overlap.
        return (kernel.combine(out, lse, *block(kv)), send(kv)), None

    kv = (k, v, kv_pos, kv_seg)
    state = block(kv)  # step 0: the device's own block
    # A scan keeps the program size independent of the axis size; the last step is peeled off
    # so that exactly n-1 blocks are sent.
    (state, kv), _ = jax.lax.scan(ring_step, (state, send(kv)), None, length=axis_size - 2)
    return kernel.combine(*state, *block(kv))


def _ring_backward(axis, axis_size, spec, residuals, dout):
    """The ring again, backwards in memory: K/V go round once more with their dK/dV
    accumulators, so nothing per ring step is stored (memory O(s/cp))."""
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    grad = lambda kb, vb, kpb, ksb: kernel.backward(q, kb, vb, dout, lse, delta, q_pos, kpb,
                                                    q_seg, ksb, spec)
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    send = lambda x: jax.lax.ppermute(x, axis, perm)

    def ring_step(carry, _):
        (kb, vb, kpb, ksb, dkb, dvb), dq = carry
        dq_t, dk_t, dv_t = grad(kb, vb, kpb, ksb)
        return (send((kb, vb, kpb, ksb, dkb + dk_t, dvb + dv_t)), dq + dq_t), None

    dq, dk, dv = grad(k, v, kv_pos, kv_seg)  # own block
    carry = (send((k, v, kv_pos, kv_seg, dk, dv)), dq)
    ((kb, vb, kpb, ksb, dkb, dvb), dq), _ = jax.lax.scan(ring_step, carry, None,
                                                         length=axis_size - 2)
    dq_t, dk_t, dv_t = grad(kb, vb, kpb, ksb)
    # After the last step this device holds the accumulators of device idx + 1: send them home.
    dk, dv = send((dkb + dk_t, dvb + dv_t))
    dq = dq + dq_t
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _ring_body(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, axis_size, spec):
    out, _ = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, axis_size, spec)
    return out.astype(q.dtype)


def _ring_body_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, axis_size, spec):
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, axis_size, spec)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


_ring_body.defvjp(_ring_body_fwd, _ring_backward)


def _as_pair(x: jax.Array | tuple[jax.Array, jax.Array] | None):
    return x if isinstance(x, tuple) or x is None else (x, x)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str = "cp",
    causal: bool = True,
    load_balanced: bool = False,
    window: int | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    block_size: int = 512,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> jax.Array:
    """Attention with the sequence sharded over mesh axis ``axis``, K/V passed around a ring.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] (heads a multiple
    of kv_heads). ``seq`` must divide by the ``axis`` size (by twice it when
    ``load_balanced``). Uses the context mesh (``jax.set_mesh``) unless ``mesh`` is given;
    with no mesh, no ``axis`` in it, or an ``axis`` of size 1 it is the single-device math.

    ``load_balanced=True`` means q, k, v (and the returned output) are in the order produced
    by ``load_balance(x, axis_size)``; for causal attention that gives every device equal work.

    Masks as in ``shardax.models.attention.attention``: ``window`` (sliding window),
    ``segment_ids`` ([batch, seq] ints, or a (q, kv) pair; attention stays within a segment),
    ``q_positions`` / ``kv_positions`` ([batch, seq]: the sequence index of each token, for
    causality and the window; default ``0 ..`` in the layout ``load_balanced`` says),
    ``softcap`` (scores ``softcap * tanh(s / softcap)``). Each ring step runs the blockwise
    kernel (``attention_kernel``, blocks of ``block_size``), skipping masked blocks, so a
    load-balanced causal ring does equal work per device.

    >>> mesh = jax.make_mesh((4, 2), ("cp", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> q = k = v = jnp.ones((2, 16, 4, 8))            # [batch, seq, heads, head_dim]
    >>> with jax.set_mesh(mesh):
    ...     out = jax.jit(ring_attention)(q, k, v)
    >>> bool(jnp.allclose(out, attention(q, k, v)))
    True
    """
    kernel.check_qkv(q, k, v)
    if q_positions is None:
        _check_causal(q, k, causal)
    n = axis_size(axis, mesh)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    chunks = 2 * n if load_balanced and n > 1 else n
    local_q, local_k = max(sq // chunks, 1), max(sk // chunks, 1)
    spec = kernel.Spec(causal=causal, window=window, softcap=softcap, scale=scale,
                       block_q=min(block_size, local_q), block_k=min(block_size, local_k))

    if kv_positions is None and sq == sk:
        kv_positions = q_positions
    segs = _as_pair(segment_ids) or (None, None)
    given = [None if x is None else jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b, length))
             for x, length in zip((q_positions, kv_positions, *segs), (sq, sk, sq, sk))]
    present = [x is not None for x in given]

    def fill(q, k, v, *extras):
        """Positions and segment ids of this block: the given ones, else computed here (no
        global index arrays: a device makes its own block's positions)."""
        it = iter(extras)
        vals = [next(it) if p else None for p in present]
        if n > 1 and (vals[0] is None or vals[1] is None):
            idx = jax.lax.axis_index(axis)
        for i, x in enumerate((q, k)):
            if vals[i] is None:
                vals[i] = (_local_positions(idx, n, x.shape[1], load_balanced, b) if n > 1
                           else jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32),
                                                 (b, x.shape[1])))
        for i, x in ((2, q), (3, k)):
            if vals[i] is None:
                vals[i] = jnp.zeros((b, x.shape[1]), jnp.int32)
        return vals

    if n == 1:
        q_pos, kv_pos, q_seg, kv_seg = fill(q, k, v, *(x for x in given if x is not None))
        mask = kernel.allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window)
        return kernel.reference(q, k, v, mask, spec)

    def body(q, k, v, *extras):
        return _ring_body(q, k, v, *fill(q, k, v, *extras), axis, n, spec)

    extras = [x for x in given if x is not None]
    if axis in manual_axes(mesh):
        # Already inside a shard_map over `axis`: q, k, v are this device's blocks.
        if load_balanced and q.shape[1] % 2:
            raise ValueError(
                f"ring_attention: local q seq={q.shape[1]} ({tuple(q.shape)}) must be even to"
                f" hold two load-balanced chunks over manual mesh axis {axis!r} (size {n})"
            )
        return body(q, k, v, *extras)
    for name, x in (("q", q), ("k", k)):
        if x.shape[1] % chunks:
            what = f"2*{n}={chunks} load-balanced chunks" if load_balanced else f"{n} devices"
            raise ValueError(
                f"ring_attention: {name} seq={x.shape[1]} ({name}{tuple(x.shape)}) must split"
                f" into {what} over mesh axis {axis!r} of size {n}"
            )
    seq_spec = P(None, axis)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(seq_spec,) * (3 + len(extras)),
        out_specs=seq_spec,
        axis_names={axis},
    )(q, k, v, *extras)


def _local_positions(idx: jax.Array, n: int, local: int, load_balanced: bool, b: int
                     ) -> jax.Array:
    """Global positions [b, local] of device ``idx``'s block of a sequence split ``n`` ways
    (chunks ``idx`` and ``2n-1-idx`` of ``2n`` when load-balanced)."""
    ar = jnp.arange(local, dtype=jnp.int32)
    if load_balanced:
        c = local // 2
        pos = jnp.where(ar < c, idx * c + ar, (2 * n - 1 - idx) * c + ar - c)
    else:
        pos = idx * local + ar
    return jnp.broadcast_to(pos, (b, local))
