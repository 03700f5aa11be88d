"""The per-block attention kernel: masked softmax attention of one query block against one
key/value block, as an einsum reference and as a flash-style blockwise loop.

Every mask is computed from positions and segment ids, per block, never stored whole: key
``j`` is visible to query ``i`` when ``seg_q[i] == seg_kv[j]``, and, if ``causal``,
``pos_kv[j] <= pos_q[i]``, and, with a ``window``, ``pos_q[i] - pos_kv[j] < window``. A key
whose segment id is ``-1`` is padding (no query sees it). Rows that see no key give zeros.

:func:`forward` returns the output and the log-sum-exp of every query row, and
:func:`backward` takes the log-sum-exp of the *whole* row, so blocks computed on different
devices (ring attention) combine exactly: :func:`combine` merges two partial results.
:func:`flash_attention` is the single-device custom-VJP form: temporaries are
``O(block_q * block_k)`` per step, linear in the sequence length overall, in the forward and
in the backward (it recomputes scores per block). Fully masked blocks are skipped.

Needs only JAX, so ``shardax.parallel.context`` can run it inside each ring step.

Example::

    out = flash_attention(q, k, v, *default_mask_inputs(q, k), spec=Spec(causal=True))
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["PAD_SEGMENT", "Spec", "allowed", "backward", "check_qkv", "combine",
           "default_mask_inputs", "flash_attention", "forward", "reference"]

# Finite "minus infinity": keeps exp(s - max) NaN-free for masked entries.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
# Segment id of padding keys (no query sees them); padded query rows get PAD_SEGMENT - 1.
PAD_SEGMENT = -1


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of an attention call: mask kind, score transform and block sizes.

    ``window``: a query sees keys less than ``window`` positions back (itself included, as
    Mistral's ``sliding_window``); ``softcap``: scores become ``softcap * tanh(s / softcap)``
    after scaling (Gemma 2); ``scale``: defaults to ``1 / sqrt(head_dim)``.
    """

    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    block_q: int = 512
    block_k: int = 512

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Raises ``ValueError`` naming the shapes unless q is [b, sq, heads, d] and k, v are
    [b, sk, kv_heads, d] with ``kv_heads`` dividing ``heads``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "attention expects q [batch, seq, heads, head_dim] and k/v [batch, seq, kv_heads,"
            f" head_dim]; got q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k{tuple(k.shape)} vs v{tuple(v.shape)}")
    b, _, h, d = q.shape
    kb, _, kvh, kd = k.shape
    if b != kb or d != kd:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)} disagree on batch or head_dim")
    if kvh == 0 or h % kvh:
        raise ValueError(
            f"heads={h} must be a multiple of kv_heads={kvh} (grouped-query attention);"
            f" q{tuple(q.shape)}, k{tuple(k.shape)}"
        )


def default_mask_inputs(q: jax.Array, k: jax.Array) -> tuple[jax.Array, ...]:
    """``(q_pos, kv_pos, q_seg, kv_seg)`` for plain attention: positions ``0 ..`` and one
    segment, each ``[batch, length]`` int32."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    pos = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    seg = lambda n: jnp.zeros((b, n), jnp.int32)
    return pos(sq), pos(sk), seg(sq), seg(sk)


def allowed(q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
            causal: bool, window: int | None) -> jax.Array:
    """``[b, sq, sk]`` bool: which keys each query sees (see the module docstring)."""
    ok = q_seg[:, :, None] == kv_seg[:, None, :]
    diff = q_pos[:, :, None] - kv_pos[:, None, :]
    if causal:
        ok &= diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def _group(x: jax.Array, kv_heads: int) -> jax.Array:
    # [b, s, heads, ...] -> [b, s, kv_heads, group, ...]; query head n uses kv head n // group.
    return x.reshape(x.shape[:2] + (kv_heads, x.shape[2] // kv_heads) + x.shape[3:])


def _ungroup(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])


def _scores(qg: jax.Array, k: jax.Array, spec: Spec) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (and soft-capped) scores ``[b, kv_heads, group, sq, sk]`` in float32, and the
    ``tanh`` the soft-cap's derivative needs (None without soft-capping)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    s = s * spec.scale_for(qg.shape[-1])
    if spec.softcap is None:
        return s, None
    t = jnp.tanh(s / spec.softcap)
    return spec.softcap * t, t


def reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, spec: Spec,
              sinks: jax.Array | None = None) -> jax.Array:
    """Einsum attention with a dense ``mask`` [b, sq, sk] (true = may attend): the whole
    score matrix at once, float32 softmax; the result has q's dtype. The tests' reference.
    ``sinks`` [heads]: a learned logit per head in every row's softmax denominator, with no
    value (gpt-oss's attention sinks).

    Example::

        out = reference(q, k, v, allowed(*default_mask_inputs(q, k), True, None), Spec())
    """
    check_qkv(q, k, v)
    s, _ = _scores(_group(q, k.shape[2]), k, spec)
    m = mask[:, None, None]
    s = jnp.where(m, s, _NEG)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1) * jnp.any(m, axis=-1, keepdims=True)
    else:  # the sink as one more column of the softmax, dropped after it
        sink = jnp.broadcast_to(_group_heads(sinks, k.shape[2])[None, :, :, None, None],
                                (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        p = p * jnp.any(m, axis=-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _ungroup(o).astype(q.dtype)


def _group_heads(sinks: jax.Array, kv_heads: int) -> jax.Array:
    """Per-head values [heads] (float32) as [kv_heads, group], the layout of the scores."""
    return sinks.astype(jnp.float32).reshape(kv_heads, -1)


def _blocks(x: jax.Array, size: int, fill) -> jax.Array:
    """[b, s, ...] -> [n, b, size, ...], padding s up to a multiple of ``size`` with ``fill``."""
    s = x.shape[1]
    n = -(-s // size)
    if n * size != s:
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, n * size - s)
        x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape((x.shape[0], n, size) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x: jax.Array, s: int) -> jax.Array:
    """[n, b, size, ...] -> [b, s, ...] (drops the padding)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])[:, :s]


def _varying(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """``x`` typed as varying over every manual mesh axis one of ``refs`` varies over: loop
    carries inside ``shard_map`` must have the type their updates get. (``full_like`` keeps
    its argument's varying axes and reads no values; outside ``shard_map`` this adds zeros.)"""
    for r in refs:
        x = x + jnp.full_like(r, 0, dtype=x.dtype, shape=())
    return x


def _tie(q: jax.Array, *masks: jax.Array) -> tuple[jax.Array, ...]:
    """``q`` and the mask inputs through one optimization barrier, so the masks depend on q.

    Without it, inside a scan over layers JAX's partial evaluation sees the per-block masks
    depend only on loop-invariant values (positions, segment ids) and hoists them out of the
    layer loop, materialising every block's mask at once: [s, s] memory again."""
    return jax.lax.optimization_barrier((q, *masks))


def _block_sizes(spec: Spec, sq: int, sk: int) -> tuple[int, int]:
    return min(spec.block_q, sq), min(spec.block_k, sk)


def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
            q_seg: jax.Array, kv_seg: jax.Array, spec: Spec) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)``: attention output ``[b, sq, heads, d]`` (float32) and the log-sum-exp of
    each query row's scores ``[b, sq, heads]`` (float32; about -inf for a row seeing nothing).

    A loop over query blocks, each scanning the key/value blocks with an online softmax;
    blocks the mask hides entirely are skipped.
    """
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    bq, bk = _block_sizes(spec, sq, k.shape[1])
    q, q_pos, kv_pos, q_seg, kv_seg = _tie(q, q_pos, kv_pos, q_seg, kv_seg)
    qb = _blocks(_group(q, kvh), bq, 0)
    qpb, qsb = _blocks(q_pos, bq, 0), _blocks(q_seg, bq, PAD_SEGMENT - 1)
    kb, vb = _blocks(k, bk, 0), _blocks(v, bk, 0)
    kpb, ksb = _blocks(kv_pos, bk, 0), _blocks(kv_seg, bk, PAD_SEGMENT)
    g = h // kvh

    def q_block(args):
        qi, qpi, qsi = args

        def kv_step(state, xs):
            kj, vj, kpj, ksj = xs
            mask = allowed(qpi, kpj, qsi, ksj, spec.causal, spec.window)

            def update(state):
                m, denom, acc = state
                s, _ = _scores(qi, kj, spec)
                visible = mask[:, None, None]
                s = jnp.where(visible, s, _NEG)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(vj.dtype), vj,
                                preferred_element_type=jnp.float32)
                return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv

            return jax.lax.cond(jnp.any(mask), update, lambda st: st, state), None

        init = (jnp.full((b, kvh, g, bq), _NEG, jnp.float32),
                jnp.zeros((b, kvh, g, bq), jnp.float32),
                jnp.zeros((b, kvh, g, bq, d), jnp.float32))
        init = tuple(_varying(x, qi, qpi, qsi, kb, vb, kpb, ksb) for x in init)
        (m, denom, acc), _ = jax.lax.scan(kv_step, init, (kb, vb, kpb, ksb))
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), _NEG)
        # [b, kvh, g, bq, ...] -> [b, bq, kvh * g, ...]
        out = jnp.moveaxis(out, 3, 1).reshape(b, bq, h, d)
        return out, jnp.moveaxis(lse, 3, 1).reshape(b, bq, h)

    out, lse = jax.lax.map(q_block, (qb, qpb, qsb))
    return _unblocks(out, sq), _unblocks(lse, sq)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, dout: jax.Array, lse: jax.Array,
             delta: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array,
             kv_seg: jax.Array, spec: Spec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Flash-attention backward: ``(dq, dk, dv)`` in float32 for this (query, key/value)
    pair, given the row log-sum-exp ``lse`` [b, sq, heads] and ``delta = sum(dout * out, -1)``
    [b, sq, heads] of the *whole* rows (so partial blocks' gradients add up).

    A scan over key/value blocks, each scanning the query blocks: dk, dv of a block accumulate
    in the inner loop, dq for all queries in the outer carry; scores are recomputed per block.
    """
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    bq, bk = _block_sizes(spec, sq, sk)
    f32 = jnp.float32
    q, q_pos, kv_pos, q_seg, kv_seg = _tie(q, q_pos, kv_pos, q_seg, kv_seg)
    qb = _blocks(_group(q, kvh), bq, 0)
    dob = _blocks(_group(dout, kvh), bq, 0)
    # [b, sq, h] -> blocks of [b, kvh, g, bq]
    row = lambda x: jnp.moveaxis(_blocks(_group(x, kvh), bq, 0), 2, 4)
    lseb, deltab = row(lse), row(delta)
    qpb, qsb = _blocks(q_pos, bq, 0), _blocks(q_seg, bq, PAD_SEGMENT - 1)
    kb, vb = _blocks(k, bk, 0), _blocks(v, bk, 0)
    kpb, ksb = _blocks(kv_pos, bk, 0), _blocks(kv_seg, bk, PAD_SEGMENT)
    nq = qb.shape[0]
    scale = spec.scale_for(d)

    def kv_block(dq, xs):
        kj, vj, kpj, ksj = xs

        def q_step(carry, xs):
            dk, dv, dq = carry
            i, qi, doi, lsei, deltai, qpi, qsi = xs
            mask = allowed(qpi, kpj, qsi, ksj, spec.causal, spec.window)

            def grads(carry):
                dk, dv, dq = carry
                s, t = _scores(qi, kj, spec)
                visible = mask[:, None, None]
                p = jnp.where(visible, jnp.exp(s - lsei[..., None]), 0.0)
                dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p, doi.astype(f32))
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=f32)
                ds = p * (dp - deltai[..., None])
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * scale
                dqi = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj.astype(f32))
                dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi.astype(f32))
                return dk, dv, dq.at[i].add(dqi)

            return jax.lax.cond(jnp.any(mask), grads, lambda c: c, (dk, dv, dq)), None

        zeros = _varying(jnp.zeros(kj.shape, f32), kj, vj, kpj, ksj, qb, dob, lseb, deltab, qpb,
                         qsb)
        # The block index varies like dq: under vmap (a pipeline's stages) the cond becomes a
        # select, and its scatter into dq must not mix varying and invariant indices.
        index = _varying(jnp.arange(nq), dq)
        (dk, dv, dq), _ = jax.lax.scan(
            q_step, (zeros, zeros, dq), (index, qb, dob, lseb, deltab, qpb, qsb))
        return dq, (dk, dv)

    dq = _varying(jnp.zeros(qb.shape, f32), qb, dob, lseb, deltab, qpb, qsb, kb, vb, kpb, ksb)
    dq, (dk, dv) = jax.lax.scan(kv_block, dq, (kb, vb, kpb, ksb))
    return _ungroup(_unblocks(dq, sq)), _unblocks(dk, sk), _unblocks(dv, sk)


def combine(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """Merges two partial results over disjoint key sets: ``(out, lse)`` of their union.

    ``out``: [b, sq, heads, d] float32; ``lse``: [b, sq, heads] float32.
    """
    m = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    out = (out_a * wa[..., None] + out_b * wb[..., None]) / total[..., None]
    return out, m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec):
    return forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec)[0].astype(q.dtype)


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec):
    out, lse = forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_bwd(spec, residuals, dout, dlse=None):
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if dlse is not None:  # d lse / d s = p: a log-sum-exp cotangent enters as ``delta - dlse``
        delta = delta - dlse
    dq, dk, dv = backward(q, k, v, dout, lse, delta, q_pos, kv_pos, q_seg, kv_seg, spec)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash_lse(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec):
    return forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec)


def _flash_lse_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec):
    out, lse = forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec)
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_lse_bwd(spec, residuals, cotangents):
    return _flash_bwd(spec, residuals, *cotangents)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _flash_sinks(q, k, v, ints, spec, sinks):
    """Blockwise attention with sinks: ``out * sigmoid(lse - sink)`` rescales each row's
    softmax to the denominator ``exp(lse) + exp(sink)``."""
    out, lse = _flash_lse(q, k, v, *ints, spec)
    keep = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))
    return (out * keep[..., None]).astype(q.dtype)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                    kv_pos: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, *,
                    spec: Spec = Spec(), sinks: jax.Array | None = None) -> jax.Array:
    """Blockwise (flash-style) attention with a recomputing backward; result in q's dtype.

    Positions and segment ids are ``[batch, length]`` integers (see the module docstring);
    ``sinks`` [heads]: attention sinks (see :func:`reference`).

    Example::

        out = flash_attention(q, k, v, *default_mask_inputs(q, k), spec=Spec(window=256))
    """
    check_qkv(q, k, v)
    ints = [jnp.asarray(x, jnp.int32) for x in (q_pos, kv_pos, q_seg, kv_seg)]
    if sinks is not None:
        return _flash_sinks(q, k, v, ints, spec, sinks)
    return _flash(q, k, v, *ints, spec)
