"""Each family's block under a layout, applied from outside the model: Megatron
column/row-parallel attention and MLP over 'tp' (``shardax.parallel.tensor``) and the
mixtures of experts split over 'ep' (capacity: ``shardax.parallel.moe_mlp``; dropless:
``shardax.parallel.dropless.dropless_moe``, experts' hidden units over 'tp'), on the model's own
parameters (checkpoints move freely between layouts).

`block_fn(model, layout)` is what `shardax.layout.forward` calls: the model's own ``block``
where the layout needs nothing explicit, else this module's block for the model's family, as
torchtitan's ``parallelize_*`` does per model.

Example::

    block = block_fn(model, Layout(tp_mode="async"))   # tensor-parallel blocks
    h, aux = block(layer, h, extras, attend)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from shardax.layout.axes import BATCH_AXES, EXPERT_AXIS, TENSOR_AXIS, TOKEN_AXES
from shardax.layout.spec import Layout
from shardax.models.attention import attention
from shardax.models.gpt2 import GPT2
from shardax.models.llama import Llama, SwiGLU, gate_activation
from shardax.models.llama_moe import MoE
from shardax.models.moe import DroplessMoE
from shardax.models.remat import checkpoint_name
from shardax.parallel.axes import axis_size, mesh_or_context
from shardax.parallel.dropless import dropless_moe
from shardax.parallel.expert import moe_mlp
from shardax.parallel.tensor import column_parallel, row_parallel

__all__ = ["block_fn", "gpt2_block", "llama_block"]

Block = Callable[[Any, jax.Array, dict, Callable], tuple[jax.Array, jax.Array]]


def block_fn(model: Any, layout: Layout) -> Block:
    """``block(layer, h, extras, attend) -> (h, aux)`` of ``model`` under ``layout``: the
    model's own ``block`` unless tensor parallelism or a mixture of experts whose tokens go
    to their experts' devices (capacity; dropless over an 'ep' axis) needs this module's."""
    c = model.config
    impl = getattr(c, "moe_impl", "") if getattr(c, "n_experts", 0) else ""
    exchanged = impl == "capacity" or (impl == "dropless" and axis_size(EXPERT_AXIS) > 1)
    if layout.tp_mode == "none" and not exchanged:
        return model.block
    for family, block in _FAMILIES:
        if isinstance(model, family):
            return lambda layer, h, extras, attend=attention: block(layer, h, extras, attend,
                                                                     layout)
    raise ValueError(f"tp_mode={layout.tp_mode!r}: no tensor-parallel block for "
                     f"{type(model).__name__}")


def _kwargs(layout: Layout) -> dict[str, Any]:
    """Keyword arguments of the column/row-parallel blocks."""
    sync_sp = layout.tp_mode == "sync" and layout.sp
    # Only sync SP needs the batch axes manual (see shardax.parallel.tensor).
    return dict(mode=layout.tp_mode, sequence_parallel=layout.sp,
                batch_axes=TOKEN_AXES if sync_sp else ())


def _head_repeat(heads: int, tp: int) -> int:
    """Copies of each head so that 'tp' devices hold whole heads (1 when tp divides heads)."""
    if heads % tp == 0:
        return 1
    if tp % heads == 0:
        return tp // heads
    raise ValueError(f"{heads} heads cannot be split over 'tp' of size {tp}: one of them must "
                     "divide the other")


def _qkv(x, ws, biases, heads, dt, kw):
    """Megatron QKV: one fused column-parallel matmul (each 'tp' slice holds the q, k and v of
    its heads). ``ws``: the q, k, v weights [dim, heads_i, d]; ``biases``: theirs [heads_i, d]
    or None; ``heads``: (q heads, kv heads). Heads fewer than 'tp' are repeated so that every
    device holds whole heads. Returns q, k, v [b, s, heads_i * repeats, d] and the q repeats."""
    tp = axis_size(TENSOR_AXIS)
    rq, rk = (_head_repeat(h, tp) for h in heads)
    d, hd = ws[0].shape[0], ws[0].shape[-1]
    ws = [jnp.repeat(w.astype(dt), r, axis=1) for w, r in zip(ws, (rq, rk, rk))]
    nq, nk = ws[0].shape[1], ws[1].shape[1]
    w_qkv = jnp.concatenate([w.reshape(d, tp, -1) for w in ws], axis=-1)
    qkv = column_parallel(x, w_qkv.reshape(d, -1), **kw)
    b, s = qkv.shape[:2]
    qkv = qkv.reshape(b, s, tp, -1)
    q = qkv[..., :nq // tp * hd].reshape(b, s, nq, hd)
    k = qkv[..., nq // tp * hd:(nq + nk) // tp * hd].reshape(b, s, nk, hd)
    v = qkv[..., (nq + nk) // tp * hd:].reshape(b, s, nk, hd)
    if biases is not None:
        q, k, v = (y + jnp.repeat(bias.astype(dt), r, axis=0)
                   for y, bias, r in zip((q, k, v), biases, (rq, rk, rk)))
    return q, k, v, rq


def _out(attended, wo, rq, dt, kw):
    """The row-parallel output projection; a repeated head's weight is divided by its copies
    so that the sum over devices counts each head once."""
    b, s, heads, hd = attended.shape
    wo = jnp.repeat(wo.astype(dt), rq, axis=0)
    if rq > 1:
        wo = wo / rq
    return row_parallel(attended.reshape(b, s, heads * hd), wo.reshape(heads * hd, -1), **kw)


def llama_block(layer: Any, h: jax.Array, extras: dict, attend: Callable, layout: Layout
                ) -> tuple[jax.Array, jax.Array]:
    """A Llama block with tensor-parallel attention and dense MLP (``tp_mode``), and a capacity
    mixture of experts split over 'ep' (its tokens exchanged with ``all_to_all``)."""
    attn, c = layer.attn, layer.config
    cos, sin, segments = extras["cos"], extras["sin"], extras.get("segment_ids")
    tp = layout.tp_mode != "none"
    if not tp:
        x = layer.attn_residual(h, attn(layer.attn_norm(h), cos, sin, segments, attend))
    else:
        dt, kw = attn.dtype, _kwargs(layout)
        biases = (attn.bq[...], attn.bk[...], attn.bv[...]) if c.qkv_bias else None
        q, k, v, rq = _qkv(layer.attn_norm(h), (attn.wq[...], attn.wk[...], attn.wv[...]),
                           biases, (c.n_heads, c.n_kv_heads), dt, kw)
        q, k = attn.rope(*attn.qk_norm(q, k), cos, sin)
        out = attn.attend(q, k, v, attend, segment_ids=segments)
        x = layer.attn_residual(h, _out(out, attn.wo[...], rq, dt, kw))
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        return layer.mlp_add(x, mlp.run(layer.mlp_norm(x), moe_mlp, batch_axes=_token_axes()))
    if isinstance(mlp, DroplessMoE):  # the experts' hidden units split over 'tp'
        return layer.mlp_add(x, mlp.run(layer.mlp_norm(x), dropless_moe,
                                        batch_axes=_token_axes(), tensor_axis=TENSOR_AXIS))
    if not (tp and isinstance(mlp, SwiGLU)):
        return layer.mlp_residual(x)
    dt, kw = mlp.dtype, _kwargs(layout)
    # Gate and up columns interleaved so that each 'tp' slice holds both halves of its hidden
    # units: one column-parallel matmul (one all-gather ring under SP/async).
    w = jnp.stack([mlp.w_gate[...].astype(dt), mlp.w_up[...].astype(dt)], axis=-1)
    y = column_parallel(layer.mlp_norm(x), w.reshape(c.dim, 2 * c.mlp_dim), **kw)
    y = y.reshape(*y.shape[:-1], c.mlp_dim, 2)
    y = checkpoint_name(gate_activation(c)(y[..., 0]) * y[..., 1], "mlp_hidden")
    y = checkpoint_name(row_parallel(y, mlp.w_down[...].astype(dt), **kw), "mlp_out")
    return layer.mlp_add(x, y)


def _token_axes() -> tuple[str, ...]:
    """The data axes an expert-parallel MoE splits its tokens over too (none without 'ep')."""
    mesh = mesh_or_context()
    names = () if mesh is None else mesh.axis_names
    return tuple(a for a in BATCH_AXES if a in names) if EXPERT_AXIS in names else ()


def gpt2_block(layer: Any, h: jax.Array, extras: dict, attend: Callable, layout: Layout
               ) -> tuple[jax.Array, jax.Array]:
    """A GPT-2 block with tensor-parallel attention and MLP (biases added after each
    column-parallel matmul, and once after each row-parallel one)."""
    attn, mlp = layer.attn, layer.mlp
    dt, kw = attn.dtype, _kwargs(layout)
    heads = attn.wq.shape[1]
    q, k, v, rq = _qkv(layer.ln_1(h), (attn.wq[...], attn.wk[...], attn.wv[...]),
                       (attn.bq[...], attn.bk[...], attn.bv[...]), (heads, heads), dt, kw)
    out = attn.attend(q, k, v, attend, segment_ids=extras.get("segment_ids"))
    y = _out(out, attn.wo[...], rq, dt, kw) + attn.bo[...].astype(dt)
    x = layer.residual(h, checkpoint_name(y, "attn_proj"))
    up = column_parallel(layer.ln_2(x), mlp.w_fc[...].astype(dt), **kw)
    up = checkpoint_name(up + mlp.b_fc[...].astype(dt), "mlp_up")
    y = row_parallel(checkpoint_name(jax.nn.gelu(up), "mlp_hidden"), mlp.w_proj[...].astype(dt),
                     **kw)
    y = checkpoint_name(y + mlp.b_proj[...].astype(dt), "mlp_out")
    return layer.residual(x, y), jnp.zeros((), jnp.float32)


_FAMILIES = ((Llama, llama_block), (GPT2, gpt2_block))
