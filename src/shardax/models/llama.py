"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in Flax NNX.

Every parameter carries logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads',
'head_dim', 'layers', 'norm'); key activations go through ``constrain`` with
('batch', 'length', ...) names, so sharding rules alone decide how the model is split.

Example::

    cfg = CONFIGS['llama-tiny']
    model = Llama(cfg, nnx.Rngs(0))
    logits = model(jnp.zeros((2, 16), jnp.int32))   # [2, 16, 256]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._annotate import constrain
from shardax.models._layers import REMAT_POLICIES, make_layers, param, run_layers

_normal = nnx.initializers.normal


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters. ``dtype`` is the compute dtype, ``param_dtype`` the storage one.

    ``scan_layers`` stacks the layers on a 'layers' axis and runs them with ``nnx.scan``;
    ``remat`` is one of 'none', 'full', 'save_dots', 'offload' (a ``jax.checkpoint`` policy).
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    mlp_dim: int = 176
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS: dict[str, LlamaConfig] = {
    # Byte-level; trains visibly in a minute on 2 CPU cores.
    "llama-tiny": LlamaConfig(),
    # ~25M parameters.
    "llama-small": LlamaConfig(
        vocab_size=32000, dim=384, n_layers=8, n_heads=8, n_kv_heads=4, mlp_dim=1024,
        max_seq_len=512, tie_embeddings=True,
    ),
    # ~125M parameters.
    "llama-125m": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, mlp_dim=2048,
        max_seq_len=1024,
    ),
    # TinyLlama-1.1B shapes.
    "llama-1b": LlamaConfig(
        vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_dim=5632,
        max_seq_len=2048,
    ),
}


def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, computed from the config alone.

    Example::

        param_count(CONFIGS['llama-1b'])   # 1_100_048_384
    """
    c = config
    attn = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    mlp = 3 * c.dim * c.mlp_dim
    layer = attn + mlp + 2 * c.dim
    head = 0 if c.tie_embeddings else c.dim * c.vocab_size
    return c.vocab_size * c.dim + c.n_layers * layer + c.dim + head


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables of shape [batch, length, head_dim // 2] for rotary embeddings."""
    freqs = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [b, s, heads, head_dim] by the position angles (rotate-half convention)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention without materialising repeated K/V heads.

    ``q``: [b, s, heads, d]; ``k``, ``v``: [b, t, kv_heads, d]; query head ``i`` reads kv head
    ``i // (heads // kv_heads)``. Scores and softmax are in float32. Returns [b, s, heads, d].
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    causal = jnp.tril(jnp.ones((s, k.shape[1]), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs.params(), nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        hd, pd = c.head_dim, c.param_dtype
        self.dtype = c.dtype
        self.wq = param(rngs.params(), _normal(std), (c.dim, c.n_heads, hd),
                        ("embed", "heads", "head_dim"), pd)
        self.wk = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs.params(), _normal(out_std), (c.n_heads, hd, c.dim),
                        ("heads", "head_dim", "embed"), pd)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        dt = self.dtype
        q = jnp.einsum("bse,ehd->bshd", x, self.wq[...].astype(dt))
        k = jnp.einsum("bse,ehd->bshd", x, self.wk[...].astype(dt))
        v = jnp.einsum("bse,ehd->bshd", x, self.wv[...].astype(dt))
        q = constrain(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        out = constrain(gqa_attention(q, k, v), ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("bshd,hde->bse", out, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        pd = c.param_dtype
        self.dtype = c.dtype
        self.w_gate = param(rngs.params(), _normal(std), (c.dim, c.mlp_dim), ("embed", "mlp"), pd)
        self.w_up = param(rngs.params(), _normal(std), (c.dim, c.mlp_dim), ("embed", "mlp"), pd)
        self.w_down = param(rngs.params(), _normal(out_std), (c.mlp_dim, c.dim),
                            ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (x @ self.w_up[...].astype(dt))
        h = constrain(h, ("batch", "length", "mlp"))
        return h @ self.w_down[...].astype(dt)


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.attn = Attention(c, rngs)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.mlp = SwiGLU(c, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = constrain(x, ("batch", "length", "embed"))
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed"))


class Llama(nnx.Module):
    """Causal language model: ``model(tokens [b, s]) -> logits [b, s, vocab]`` (float32).

    Example::

        model = Llama(CONFIGS['llama-tiny'], nnx.Rngs(0))
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = param(rngs.params(), _normal(0.02), (c.vocab_size, c.dim),
                           ("vocab", "embed"), c.param_dtype)
        self.layers = make_layers(lambda r: Block(c, r), c.n_layers, rngs, c.scan_layers)
        self.final_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        if not c.tie_embeddings:
            self.lm_head = param(rngs.params(), _normal(0.02), (c.dim, c.vocab_size),
                                 ("embed", "vocab"), c.param_dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(f"length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Gather the table's 'embed' dim first (as FSDP would); rows stay split by 'vocab'.
        table = constrain(self.embed[...], ("vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(c.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        x = run_layers(self.layers, x, lambda layer, h: layer(h, cos, sin),
                       c.scan_layers, c.remat)
        x = self.final_norm(x)
        if c.tie_embeddings:
            w, spec = self.embed[...].astype(c.dtype), "bse,ve->bsv"
        else:
            w, spec = self.lm_head[...].astype(c.dtype), "bse,ev->bsv"
        logits = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))
