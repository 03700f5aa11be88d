"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values come from a
small normed latent, RoPE runs on a decoupled part of q and on one key part shared by heads.

``x -> q``: ``q_b(norm(q_a(x)))`` (rank ``q_lora_rank``; 0: one projection ``wq``), per head
``nope + rope`` dims. ``x -> (latent, k_rope)``: ``wkv_a`` gives the rank-``kv_lora_rank``
latent and a ``qk_rope_head_dim`` key part shared by every head; ``wkv_b(norm(latent))`` gives
each head's key ``nope`` part and value. RoPE rotates the last ``qk_rope_head_dim`` dims of q
and k (DeepSeek's checkpoints store them interleaved, ``rope_interleave``). The module has the
interface of ``llama.Attention`` (``qkv``, ``rope``, ``attend``, ``out``), so the layouts and
the KV-cache decoder run it unchanged: k is ``[b, s, heads, nope + rope]`` and the value is
zero-padded to that size (the decoder caches the decompressed keys and values).

Example::

    cfg = LlamaConfig(n_experts=4, moe_impl='dropless', kv_lora_rank=16, q_lora_rank=16,
                      qk_rope_head_dim=8, head_dim_override=16, v_head_dim=8, n_kv_heads=4)
    attn = MLAttention(cfg, nnx.Rngs(0))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._layers import AttentionLayer, param
from shardax.models.attention import attention
from shardax.models.ops import apply_rope, rms_norm
from shardax.models.remat import checkpoint_name

if TYPE_CHECKING:
    from shardax.models.configs import LlamaConfig

__all__ = ["MLAttention", "deinterleave"]

_normal = nnx.initializers.normal
_ones = nnx.initializers.ones


def deinterleave(x: jax.Array) -> jax.Array:
    """Pairs ``(x0, x1), (x2, x3) ..`` of the last dim as halves ``(x0, x2, .., x1, x3, ..)``
    (transformers' ``apply_rotary_pos_emb_interleave`` before its rotate-half RoPE)."""
    shape = x.shape
    return jnp.swapaxes(x.reshape(*shape[:-1], shape[-1] // 2, 2), -1, -2).reshape(shape)


class MLAttention(AttentionLayer):
    """Multi-head latent attention; see the module."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        h, hd, r, pd = c.n_heads, c.head_dim, c.qk_rope_head_dim, c.param_dtype
        self.config, self.dtype = c, c.dtype
        if c.q_lora_rank:
            self.wq_a = param(rngs.params(), _normal(std), (c.dim, c.q_lora_rank),
                              ("embed", None), pd)
            self.q_norm = param(rngs.params(), _ones, (c.q_lora_rank,), ("norm",), pd)
            self.wq_b = param(rngs.params(), _normal(std), (c.q_lora_rank, h, hd),
                              (None, "heads", "head_dim"), pd)
        else:
            self.wq = param(rngs.params(), _normal(std), (c.dim, h, hd),
                            ("embed", "heads", "head_dim"), pd)
        self.wkv_a = param(rngs.params(), _normal(std), (c.dim, c.kv_lora_rank + r),
                           ("embed", None), pd)
        self.kv_norm = param(rngs.params(), _ones, (c.kv_lora_rank,), ("norm",), pd)
        self.wkv_b = param(rngs.params(), _normal(std),
                           (c.kv_lora_rank, h, hd - r + c.v_head_dim),
                           (None, "heads", "head_dim"), pd)
        self.wo = param(rngs.params(), _normal(out_std), (h, c.v_head_dim, c.dim),
                        ("heads", "head_dim", "embed"), pd)
        self.window: int | None = c.sliding_window
        self.local_rope = False

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q and k ``[b, s, heads, nope + rope]`` before RoPE, v ``[b, s, heads, v_head_dim]``
        zero-padded to the same size."""
        c, dt = self.config, self.dtype
        r = c.qk_rope_head_dim
        if c.q_lora_rank:
            qa = rms_norm(x @ self.wq_a[...].astype(dt), self.q_norm[...], c.norm_eps)
            q = jnp.einsum("bsr,rhd->bshd", qa, self.wq_b[...].astype(dt))
        else:
            q = jnp.einsum("bse,ehd->bshd", x, self.wq[...].astype(dt))
        kv_a = x @ self.wkv_a[...].astype(dt)
        latent = rms_norm(kv_a[..., :c.kv_lora_rank], self.kv_norm[...], c.norm_eps)
        kv = jnp.einsum("bsr,rhd->bshd", latent, self.wkv_b[...].astype(dt))
        nope = c.head_dim - r
        k_rope = jnp.broadcast_to(kv_a[..., None, c.kv_lora_rank:],
                                  (*kv.shape[:3], r))
        k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)
        v = jnp.pad(kv[..., nope:], [(0, 0)] * 3 + [(0, c.head_dim - c.v_head_dim)])
        return q, k, v

    def rope(self, q: jax.Array, k: jax.Array, cos: Any, sin: Any
             ) -> tuple[jax.Array, jax.Array]:
        """q and k with their last ``qk_rope_head_dim`` dims rotated."""
        c = self.config
        nope = c.head_dim - c.qk_rope_head_dim

        def rotate(x):
            part = x[..., nope:]
            if c.rope_interleave:
                part = deinterleave(part)
            return jnp.concatenate([x[..., :nope], apply_rope(part, cos, sin)], axis=-1)

        return rotate(q), rotate(k)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, fn: Callable = attention,
               **masks: Any) -> jax.Array:
        """Attention of roped q, k and (padded) v through ``fn`` (scale ``1/sqrt(nope +
        rope)``, times YaRN's mscale squared: ``attn_scale``); see ``llama.Attention.attend``."""
        q, k, v = (checkpoint_name(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        out = fn(q, k, v, window=self.window, scale=self.config.attn_scale, **masks)
        return checkpoint_name(out, "attn_out")

    def out(self, attended: jax.Array) -> jax.Array:
        """The output projection of the value dims of ``attended`` [b, s, heads, d]."""
        v = attended[..., :self.config.v_head_dim]
        return jnp.einsum("bshd,hde->bse", v, self.wo[...].astype(self.dtype))
