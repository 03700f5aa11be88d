"""One attention function for every model and path: causal, sliding window, segment ids
(packed documents), GQA/MQA, soft-capping and decode padding, with several implementations.

Implementations (``implementation=``):

* ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')``, NVIDIA GPUs only
  (float16/bfloat16, head_dim a multiple of 8 up to 128; equal query and key lengths; causal
  and causal window masks, and segment ids or key masks as a dense [b, 1, s, s] mask beside them,
  which ``'auto'`` builds up to ``CUDNN_DENSE_MASK_MAX_LEN`` keys; no given positions);
* ``'xla'``: ``jax.nn.dot_product_attention(implementation='xla')`` with the mask built from
  positions and segment ids (it has no soft-capping or sinks: with ``softcap`` or ``sinks``
  it runs ``'einsum'``);
* ``'blockwise'``: pure JAX, flash-style (``shardax.parallel.attention_kernel``): a loop over
  key/value blocks with an online softmax and a backward that recomputes per block, so
  temporaries grow linearly with the sequence on every backend, CPU included;
* ``'einsum'``: the whole score matrix at once; the reference the tests compare with;
* ``'auto'``: cudnn where it applies, else blockwise when the key length is at least
  ``BLOCKWISE_MIN_LEN`` (1024), else xla.

On an H200 (``benchmarks/gpu_attention.py``), forward + backward of causal bf16 attention ran
4-9x faster under cuDNN than under xla and 7-17x faster than blockwise from 2k to 16k tokens;
with packed documents' segment ids, cuDNN with the dense mask ran 4.7x (2k) and 6.4x (8k)
faster than blockwise.

Context parallelism is the layout's: `shardax.layout.forward` passes models ring attention
(``shardax.parallel.ring_attention``, blockwise ring steps, the same masks) in place of this
function under context parallelism. Softmax statistics are float32; the result has q's dtype.

Example::

    out = attention(q, k, v)                                  # causal
    out = attention(q, k, v, window=4096, segment_ids=segs)   # Mistral-style, packed rows
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardax.parallel import attention_kernel as kernel
from shardax.parallel.attention_kernel import Spec, flash_attention

__all__ = ["BLOCKWISE_MIN_LEN", "CUDNN_DENSE_MASK_MAX_LEN", "IMPLEMENTATIONS", "Spec",
           "attention", "flash_attention", "resolve_implementation"]

IMPLEMENTATIONS = ("auto", "cudnn", "xla", "blockwise", "einsum")
# 'auto' picks blockwise from this key length on: below it the xla path's [s, s] scores are
# small and its single fused program has less loop overhead; from 1024 keys on blockwise was
# as fast on CPU (benchmarks/attention.py) at a fraction of the temporaries.
BLOCKWISE_MIN_LEN = 1024
# cuDNN takes segment ids and key masks only as a dense [b, 1, s, s] mask (a bias inside it),
# quadratic in the sequence: 'auto' builds it up to this key length (128 MiB of bias per row
# at 8k) and runs blockwise, linear in memory, beyond.
CUDNN_DENSE_MASK_MAX_LEN = 8192
_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)

Segments = jax.Array | tuple[jax.Array, jax.Array] | None


def _cudnn_reason(q: jax.Array, k: jax.Array, custom_mask: bool, softcap: float | None,
                  sinks: bool = False, positioned: bool = False,
                  two_sided_window: bool = False, auto: bool = False) -> str | None:
    """Why cuDNN cannot run this call (None when it can)."""
    device = jax.devices()[0]
    if device.platform != "gpu" or "nvidia" not in device.device_kind.lower():
        return "it needs an NVIDIA GPU"
    if q.dtype not in _CUDNN_DTYPES:
        return f"it needs float16 or bfloat16 inputs, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 128:
        return f"it needs head_dim a multiple of 8 up to 128, got {d}"
    if positioned:
        return "given positions need a mask built from them"
    if custom_mask and auto and k.shape[1] > CUDNN_DENSE_MASK_MAX_LEN:
        return (f"segment ids and key masks need a dense mask, quadratic in the "
                f"{k.shape[1]} keys ('auto' builds one up to {CUDNN_DENSE_MASK_MAX_LEN})")
    if softcap is not None:
        return "it has no soft-capping"
    if sinks:
        return "it has no attention sinks"
    if two_sided_window:
        return "its window reaches only back (causal)"
    if q.shape[1] != k.shape[1]:
        return "it needs equal query and key lengths here"
    return None


def resolve_implementation(implementation: str, q: jax.Array, k: jax.Array, *,
                           custom_mask: bool = False, softcap: float | None = None,
                           sinks: bool = False, positioned: bool = False,
                           two_sided_window: bool = False) -> str:
    """The implementation ``implementation`` means for these inputs (``'auto'`` resolved):
    ``custom_mask`` when segment ids or a key mask are given, ``positioned`` when query or
    key positions are, ``two_sided_window`` for a window without the causal mask.

    Example::

        resolve_implementation('auto', q, k)   # 'blockwise' on CPU at 8k tokens
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation not in ("cudnn", "auto"):
        return implementation
    reason = _cudnn_reason(q, k, custom_mask, softcap, sinks, positioned, two_sided_window,
                           auto=implementation == "auto")
    if reason is None:
        return "cudnn"
    if implementation == "cudnn":
        raise ValueError(f"attention implementation 'cudnn' cannot run q{tuple(q.shape)} "
                         f"{q.dtype}: {reason}; use 'auto', 'blockwise' or 'xla'")
    return "blockwise" if k.shape[1] >= BLOCKWISE_MIN_LEN else "xla"


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: Segments = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: jax.Array | None = None,
    implementation: str = "auto",
    block_size: int = 512,
) -> jax.Array:
    """Softmax attention of q [b, sq, heads, d] over k, v [b, sk, kv_heads, d] (kv_heads
    dividing heads: GQA/MQA). Returns [b, sq, heads, d] in q's dtype.

    Masks: key ``j`` is visible to query ``i`` when (``causal``) ``kv_pos[j] <= q_pos[i]``,
    (``window``) ``q_pos[i] - kv_pos[j] < window``, (``segment_ids``: [b, s] ints, or a
    ``(q_segments, kv_segments)`` pair) both are in the same segment, and (``kv_mask``: [b, sk]
    bool, false = padding) the key is not padding; segment ids are ints >= 0.
    ``q_positions`` / ``kv_positions`` ([b, s] or [s]) are sequence indices (a KV cache's
    slots), default ``0 ..``; they are not RoPE positions. A query that sees no key gets
    zeros. ``softcap``: scores become ``softcap * tanh(s / softcap)`` after the ``scale``
    (default ``1/sqrt(d)``). ``sinks`` [heads] (gpt-oss): a learned logit per head added
    to every row's softmax denominator (a key with no value); cuDNN has none (``'xla'``
    runs ``'einsum'`` then).

    ``block_size``: the blockwise kernel's query and key block.

    Example::

        out = attention(q, k, v, segment_ids=segs, implementation='blockwise')
    """
    kernel.check_qkv(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    positioned = q_positions is not None or kv_positions is not None
    if causal and sq != sk and not positioned:
        raise ValueError(f"causal attention of q{tuple(q.shape)} over k{tuple(k.shape)} needs "
                         "q_positions and kv_positions (the keys' and queries' sequence indices)")
    masked = segment_ids is not None or kv_mask is not None
    impl = resolve_implementation(implementation, q, k, custom_mask=masked, softcap=softcap,
                                  sinks=sinks is not None, positioned=positioned,
                                  two_sided_window=window is not None and not causal)
    spec = Spec(causal=causal, window=window, softcap=softcap, scale=scale,
                block_q=block_size, block_k=block_size)
    q_pos, kv_pos, q_seg, kv_seg = _mask_inputs(q, k, q_positions, kv_positions, segment_ids,
                                                kv_mask)
    if impl == "cudnn":
        local = None if window is None else (window - 1, 0)  # causal: cuDNN's only window
        # The dense mask repeats the causal and window masks, so that rows it leaves without
        # a key are known; is_causal and the window still let cuDNN skip masked tiles.
        mask = kernel.allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window) if masked else None
        out = jax.nn.dot_product_attention(
            q, k, v, mask=None if mask is None else mask[:, None], scale=scale,
            is_causal=causal, local_window_size=local, implementation="cudnn")
        return out if mask is None else _zero_unseen_rows(out, mask)
    if impl == "blockwise":
        return flash_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec=spec, sinks=sinks)
    mask = kernel.allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window)
    if impl == "einsum" or softcap is not None or sinks is not None:
        return kernel.reference(q, k, v, mask, spec, sinks)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                       implementation="xla")
    return _zero_unseen_rows(out, mask)


def _zero_unseen_rows(out: jax.Array, mask: jax.Array) -> jax.Array:
    """Zeros for the queries that see no key, as blockwise and einsum give (xla averages such
    a row's values)."""
    seen = jnp.any(mask, axis=-1)[:, :, None, None]
    return jnp.where(seen, out, jnp.zeros((), out.dtype))


def _mask_inputs(q, k, q_positions, kv_positions, segment_ids, kv_mask):
    """``(q_pos, kv_pos, q_seg, kv_seg)`` [b, s] int32; padding keys get segment -1."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    q_pos, kv_pos, q_seg, kv_seg = kernel.default_mask_inputs(q, k)
    if q_positions is not None:
        q_pos = jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32), (b, sq))
    if kv_positions is not None:
        kv_pos = jnp.broadcast_to(jnp.asarray(kv_positions, jnp.int32), (b, sk))
    elif q_positions is not None and sq == sk:
        kv_pos = q_pos
    if segment_ids is not None:
        qs, ks = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        q_seg = jnp.broadcast_to(jnp.asarray(qs, jnp.int32), (b, sq))
        kv_seg = jnp.broadcast_to(jnp.asarray(ks, jnp.int32), (b, sk))
    if kv_mask is not None:
        kv_seg = jnp.where(jnp.broadcast_to(kv_mask, (b, sk)), kv_seg, kernel.PAD_SEGMENT)
    return q_pos, kv_pos, q_seg, kv_seg
