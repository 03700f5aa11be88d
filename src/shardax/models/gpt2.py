"""GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings) in Flax NNX.

Same logical axis names as the Llama model, plus biases named after their output dim.

Example::

    model = GPT2(CONFIGS['gpt2-tiny'], nnx.Rngs(0))
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
from shardax.models.llama import gqa_attention

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyper-parameters; ``dtype`` computes, ``param_dtype`` stores; see ``LlamaConfig``."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    mlp_dim: int = 256
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(),
    # GPT-2 small (124M); vocabulary 50257 padded to 50304 (a multiple of 128) so it splits
    # evenly over tensor-parallel axes.
    "gpt2": GPT2Config(vocab_size=50304, dim=768, n_layers=12, n_heads=12, mlp_dim=3072,
                       max_seq_len=1024),
}


def param_count(config: GPT2Config) -> int:
    """Number of parameters of ``GPT2(config)``, from the config alone.

    Example::

        param_count(CONFIGS['gpt2'])   # 124_475_904
    """
    c = config
    attn = 4 * c.dim * c.dim + 4 * c.dim
    mlp = 2 * c.dim * c.mlp_dim + c.mlp_dim + c.dim
    layer = attn + mlp + 4 * c.dim
    return (c.vocab_size + c.max_seq_len) * c.dim + c.n_layers * layer + 2 * c.dim


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs.params(), nnx.initializers.ones, (dim,), ("norm",), param_dtype)
        self.bias = param(rngs.params(), _zeros, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        shape, names = (c.dim, c.n_heads, c.head_dim), ("embed", "heads", "head_dim")
        bshape, bnames = (c.n_heads, c.head_dim), ("heads", "head_dim")
        pd = c.param_dtype
        self.dtype = c.dtype
        self.wq = param(rngs.params(), _normal(std), shape, names, pd)
        self.wk = param(rngs.params(), _normal(std), shape, names, pd)
        self.wv = param(rngs.params(), _normal(std), shape, names, pd)
        self.bq = param(rngs.params(), _zeros, bshape, bnames, pd)
        self.bk = param(rngs.params(), _zeros, bshape, bnames, pd)
        self.bv = param(rngs.params(), _zeros, bshape, bnames, pd)
        self.wo = param(rngs.params(), _normal(out_std), (c.n_heads, c.head_dim, c.dim),
                        ("heads", "head_dim", "embed"), pd)
        self.bo = param(rngs.params(), _zeros, (c.dim,), ("embed",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        names = ("batch", "length", "heads", "head_dim")

        def proj(w, b):
            y = jnp.einsum("bse,ehd->bshd", x, w[...].astype(dt)) + b[...].astype(dt)
            return constrain(y, names)

        q, k, v = proj(self.wq, self.bq), proj(self.wk, self.bk), proj(self.wv, self.bv)
        out = constrain(gqa_attention(q, k, v), names)
        return jnp.einsum("bshd,hde->bse", out, self.wo[...].astype(dt)) + self.bo[...].astype(dt)


class MLPBlock(nnx.Module):
    def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        pd = c.param_dtype
        self.dtype = c.dtype
        self.w_fc = param(rngs.params(), _normal(std), (c.dim, c.mlp_dim), ("embed", "mlp"), pd)
        self.b_fc = param(rngs.params(), _zeros, (c.mlp_dim,), ("mlp",), pd)
        self.w_proj = param(rngs.params(), _normal(out_std), (c.mlp_dim, c.dim),
                            ("mlp", "embed"), pd)
        self.b_proj = param(rngs.params(), _zeros, (c.dim,), ("embed",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = jax.nn.gelu(x @ self.w_fc[...].astype(dt) + self.b_fc[...].astype(dt))
        h = constrain(h, ("batch", "length", "mlp"))
        return h @ self.w_proj[...].astype(dt) + self.b_proj[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.attn = Attention(c, rngs)
        self.ln_2 = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.mlp = MLPBlock(c, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x + self.attn(self.ln_1(x)), ("batch", "length", "embed"))
        return constrain(x + self.mlp(self.ln_2(x)), ("batch", "length", "embed"))


class GPT2(nnx.Module):
    """GPT-2 causal LM: ``model(tokens [b, s]) -> logits [b, s, vocab]`` (float32).

    The output projection is the token embedding (``wte``) transposed: one shared parameter.
    """

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs):
        c = self.config = config
        self.wte = param(rngs.params(), _normal(0.02), (c.vocab_size, c.dim),
                         ("vocab", "embed"), c.param_dtype)
        self.wpe = param(rngs.params(), _normal(0.01), (c.max_seq_len, c.dim),
                         (None, "embed"), c.param_dtype)
        self.layers = make_layers(lambda r: Block(c, r), c.n_layers, rngs, c.scan_layers)
        self.ln_f = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(f"length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}")
        table = constrain(self.wte[...], ("vocab", None))  # see Llama: gather 'embed' first
        x = jnp.take(table, tokens, axis=0) + self.wpe[: tokens.shape[1]]
        x = constrain(x.astype(c.dtype), ("batch", "length", "embed"))
        x = run_layers(self.layers, x, lambda layer, h: layer(h), c.scan_layers, c.remat)
        x = self.ln_f(x)
        logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(c.dtype)).astype(jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))
