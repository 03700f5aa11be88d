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
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardax.parallel.axes import axis_size, manual_axes

__all__ = ["attention", "load_balance", "ring_attention", "unload_balance"]

# Finite "minus infinity": keeps exp(s - max) NaN-free for masked entries.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "attention expects q [batch, seq, heads, head_dim] and k/v [batch, seq, kv_heads,"
            f" head_dim]; got q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k{tuple(k.shape)} vs v{tuple(v.shape)}")
    b, sq, h, d = q.shape
    kb, sk, kvh, kd = k.shape
    if b != kb or d != kd:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)} disagree on batch or head_dim")
    if kvh == 0 or h % kvh:
        raise ValueError(
            f"heads={h} must be a multiple of kv_heads={kvh} (grouped-query attention);"
            f" q{tuple(q.shape)}, k{tuple(k.shape)}"
        )
    if causal and sq != sk:
        raise ValueError(
            f"causal attention needs equal q and k sequence lengths; got q{tuple(q.shape)},"
            f" k{tuple(k.shape)}"
        )


def _group(q: jax.Array, kv_heads: int) -> jax.Array:
    # [b, s, heads, d] -> [b, s, kv_heads, group, d]; query head n uses kv head n // group.
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def _ungroup(o: jax.Array) -> jax.Array:
    # [b, kv_heads, group, s, d] -> [b, s, heads, d]
    b, kvh, g, s, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, kvh * g, d)


def _scores(qg: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    return s * scale


def _causal_mask(sq: int, sk: int) -> jax.Array:
    return jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]


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
    _check_qkv(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(_group(q, k.shape[2]), k, scale)
    if causal:
        s = jnp.where(_causal_mask(q.shape[1], k.shape[1]), s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _ungroup(o).astype(q.dtype)


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

# Online-softmax state of a query block: running max m, normaliser denom, unnormalised output
# acc; m and denom: [b, kv_heads, group, sq] float32, acc: [b, kv_heads, group, sq, d] float32.
_State = tuple[jax.Array, jax.Array, jax.Array]


def _block_update(
    state: _State | None,
    qg: jax.Array,
    k: jax.Array,
    v: jax.Array,
    scale: float,
    causal: bool,
) -> _State:
    s = _scores(qg, k, scale)
    if causal:
        s = jnp.where(_causal_mask(s.shape[-2], s.shape[-1]), s, _NEG)
    # The output does not depend on the max mathematically; stopping its gradient saves work
    # and keeps ties in the max out of the backward pass.
    m_blk = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    m_new = m_blk if state is None else jnp.maximum(state[0], m_blk)
    p = jnp.exp(s - m_new[..., None])
    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    if state is None:
        return m_new, p.sum(-1), pv
    m, denom, acc = state
    corr = jnp.exp(m - m_new)
    return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv


def _update_q_half(
    state: _State, qg: jax.Array, k: jax.Array, v: jax.Array, scale: float
) -> _State:
    # Balanced layout, kv block from a later device: only the second query chunk sees it.
    c = qg.shape[1] // 2
    tail = tuple(x[..., c:] for x in state[:2]) + (state[2][..., c:, :],)
    m, denom, acc = _block_update(tail, qg[:, c:], k, v, scale, False)
    return (
        jnp.concatenate([state[0][..., :c], m], axis=-1),
        jnp.concatenate([state[1][..., :c], denom], axis=-1),
        jnp.concatenate([state[2][..., :c, :], acc], axis=-2),
    )


def _ring_forward(q, k, v, axis, axis_size, causal, load_balanced, scale):
    """Per-device ring loop (runs with ``axis`` manual). Blocks are local [b, s/cp, ...].
    Returns the output and the log-sum-exp of each query row, ``[b, kv_heads, group, sq]``."""
    qg = _group(q, k.shape[2])
    idx = jax.lax.axis_index(axis)

    def step(state: _State, kv: tuple[jax.Array, jax.Array], t: jax.Array) -> _State:
        # At step t this device holds the kv block of device j = (idx - t) % n.
        kb, vb = kv
        if not causal:
            return _block_update(state, qg, kb, vb, scale, False)
        if not load_balanced:
            # j < idx (i.e. idx >= t): every query sees every key; j > idx: nothing to do.
            return jax.lax.cond(
                idx >= t,
                lambda st: _block_update(st, qg, kb, vb, scale, False),
                lambda st: st,
                state,
            )
        # j < idx: both query chunks (idx, 2n-1-idx) see kv chunk j and none sees 2n-1-j.
        # j > idx: only query chunk 2n-1-idx sees kv, and sees both its chunks.
        # Either way exactly half a block of unmasked work.
        half = kb.shape[1] // 2
        return jax.lax.cond(
            idx >= t,
            lambda st: _block_update(st, qg, kb[:, :half], vb[:, :half], scale, False),
            lambda st: _update_q_half(st, qg, kb, vb, scale),
            state,
        )

    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    send = lambda kv: jax.lax.ppermute(kv, axis, perm)

    def ring_step(carry, t):
        state, kv = carry
        # The next block's transfer does not depend on this step's compute, so they overlap.
        return (step(state, kv, t), send(kv)), None

    # Step 0: the device's own block. Causal masking on local indices is right in both
    # layouts, since a device's chunks (i then 2n-1-i) are in increasing global order.
    kv = send((k, v))
    state = _block_update(None, qg, k, v, scale, causal)
    # A scan keeps the program size independent of the axis size; the last step is peeled off
    # so that exactly n-1 blocks are sent.
    (state, kv), _ = jax.lax.scan(ring_step, (state, kv), jnp.arange(1, axis_size - 1))
    state = step(state, kv, jnp.asarray(axis_size - 1))
    m, denom, acc = state
    return _ungroup(acc / denom[..., None]).astype(q.dtype), m + jnp.log(denom)


def _block_grad(qg, kb, vb, dog, lse, delta, scale, causal):
    """Flash-attention backward of one (query block, K/V block) pair, in float32.

    qg, dog: [b, sq, kv_heads, group, d]; kb, vb: [b, sk, kv_heads, d]; lse, delta:
    [b, kv_heads, group, sq]. Returns the contributions to dq (grouped), dk and dv.
    """
    f32 = jnp.float32
    s = _scores(qg, kb, scale)
    if causal:
        s = jnp.where(_causal_mask(s.shape[-2], s.shape[-1]), s, _NEG)
    p = jnp.exp(s - lse[..., None])  # the softmax probabilities, from the forward's lse
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog.astype(f32))
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vb, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb.astype(f32))
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg.astype(f32))
    return dq, dk, dv


def _ring_backward(axis, axis_size, causal, load_balanced, scale, residuals, dout):
    """The ring again, backwards in memory: K/V go round once more with their dK/dV
    accumulators, so nothing per ring step is stored (memory O(s/cp))."""
    q, k, v, out, lse = residuals
    kvh, f32 = k.shape[2], jnp.float32
    qg, dog = _group(q, kvh), _group(dout, kvh)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog.astype(f32), _group(out, kvh).astype(f32))
    idx = jax.lax.axis_index(axis)
    grad = functools.partial(_block_grad, scale=scale)

    def block(kb, vb, t):
        # The same work split as the forward's `step` (see there), for the block of device
        # (idx - t) % n held at step t >= 1.
        if not causal:
            return grad(qg, kb, vb, dog, lse, delta, causal=False)
        zeros = lambda: tuple(jnp.zeros_like(x, f32) for x in (qg, kb, vb))
        full = lambda: grad(qg, kb, vb, dog, lse, delta, causal=False)
        if not load_balanced:
            return jax.lax.cond(idx >= t, full, zeros)
        half, c = kb.shape[1] // 2, qg.shape[1] // 2

        def first_kv_half():
            dq, dk, dv = grad(qg, kb[:, :half], vb[:, :half], dog, lse, delta, causal=False)
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
            return dq, pad(dk), pad(dv)

        def second_q_half():
            dq, dk, dv = grad(qg[:, c:], kb, vb, dog[:, c:], lse[..., c:], delta[..., c:],
                              causal=False)
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

        return jax.lax.cond(idx >= t, first_kv_half, second_q_half)

    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    send = lambda x: jax.lax.ppermute(x, axis, perm)

    def ring_step(carry, t):
        (kb, vb, dkb, dvb), dq = carry
        dq_t, dk_t, dv_t = block(kb, vb, t)
        return (send((kb, vb, dkb + dk_t, dvb + dv_t)), dq + dq_t), None

    dq, dk, dv = grad(qg, k, v, dog, lse, delta, causal=causal)  # own block
    carry = (send((k, v, dk, dv)), dq)
    ((kb, vb, dkb, dvb), dq), _ = jax.lax.scan(ring_step, carry, jnp.arange(1, axis_size - 1))
    dq_t, dk_t, dv_t = block(kb, vb, jnp.asarray(axis_size - 1))
    # After the last step this device holds the accumulators of device idx + 1: send them home.
    dk, dv = send((dkb + dk_t, dvb + dv_t))
    dq = (dq + dq_t).reshape(q.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ring_body(q, k, v, axis, axis_size, causal, load_balanced, scale):
    return _ring_forward(q, k, v, axis, axis_size, causal, load_balanced, scale)[0]


def _ring_body_fwd(q, k, v, axis, axis_size, causal, load_balanced, scale):
    out, lse = _ring_forward(q, k, v, axis, axis_size, causal, load_balanced, scale)
    return out, (q, k, v, out, lse)


_ring_body.defvjp(_ring_body_fwd, _ring_backward)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str = "cp",
    causal: bool = True,
    load_balanced: bool = False,
    scale: float | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> jax.Array:
    """Attention with the sequence sharded over mesh axis ``axis``, K/V passed around a ring.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] (heads a multiple
    of kv_heads). ``seq`` must divide by the ``axis`` size (by twice it when
    ``load_balanced``). Uses the context mesh (``jax.set_mesh``) unless ``mesh`` is given;
    with no mesh, no ``axis`` in it, or an ``axis`` of size 1 it is :func:`attention`.

    ``load_balanced=True`` means q, k, v (and the returned output) are in the order produced
    by ``load_balance(x, axis_size)``; for causal attention that gives every device equal work.
    With ``causal=False`` the flag only checks divisibility (attention is order-equivariant).

    >>> mesh = jax.make_mesh((4, 2), ("cp", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> q = k = v = jnp.ones((2, 16, 4, 8))            # [batch, seq, heads, head_dim]
    >>> with jax.set_mesh(mesh):
    ...     out = jax.jit(ring_attention)(q, k, v)
    >>> bool(jnp.allclose(out, attention(q, k, v)))
    True
    """
    _check_qkv(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n = axis_size(axis, mesh)
    if n == 1:
        return attention(q, k, v, causal, scale=scale)
    body = lambda q, k, v: _ring_body(q, k, v, axis, n, causal, load_balanced, scale)
    if axis in manual_axes(mesh):
        # Already inside a shard_map over `axis`: q, k, v are this device's blocks.
        if load_balanced and q.shape[1] % 2:
            raise ValueError(
                f"ring_attention: local q seq={q.shape[1]} ({tuple(q.shape)}) must be even to"
                f" hold two load-balanced chunks over manual mesh axis {axis!r} (size {n})"
            )
        return body(q, k, v)
    chunks = 2 * n if load_balanced else n
    for name, x in (("q", q), ("k", k)):
        if x.shape[1] % chunks:
            what = f"2*{n}={chunks} load-balanced chunks" if load_balanced else f"{n} devices"
            raise ValueError(
                f"ring_attention: {name} seq={x.shape[1]} ({name}{tuple(x.shape)}) must split"
                f" into {what} over mesh axis {axis!r} of size {n}"
            )
    spec = P(None, axis)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        axis_names={axis},
    )(q, k, v)
