"""GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings) in Flax NNX.

Same logical axis names as the Llama model, plus biases named after their output dim; the
protocol of `shardax.models.protocol`, so every layout (`shardax.layout`) runs it.

Example::

    model = GPT2(CONFIGS['gpt2-tiny'], nnx.Rngs(0))
    logits = model(jnp.zeros((2, 16), jnp.int32))   # [2, 16, 256]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models import embedding
from shardax.models._annotate import constrain
from shardax.models._layers import make_layers, param
from shardax.models.attention import attention
from shardax.models.configs import GPT2_CONFIGS, GPT2Config
from shardax.models.ops import layer_norm
from shardax.models.protocol import LanguageModel
from shardax.models.remat import checkpoint_name

__all__ = ["CONFIGS", "GPT2", "GPT2Config", "param_count"]

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros


CONFIGS = GPT2_CONFIGS


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

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 attend: Callable = attention) -> jax.Array:
        q, k, v = self.qkv(x)
        out = constrain(self.attend(q, k, v, attend, segment_ids=segment_ids),
                        ("batch", "length", "heads", "head_dim"))
        return checkpoint_name(self.out(out), "attn_proj")

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, fn: Callable = attention,
               **masks: Any) -> jax.Array:
        """Attention through ``fn`` (``shardax.models.attention.attention``, or the layout's:
        its implementation, ring attention); ``masks``: more keyword arguments of it."""
        q, k, v = (checkpoint_name(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        out = fn(q, k, v, **masks)
        return checkpoint_name(out, "attn_out")

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v [b, s, heads, d]."""
        dt = self.dtype

        def proj(w, b):
            y = jnp.einsum("bse,ehd->bshd", x, w[...].astype(dt)) + b[...].astype(dt)
            return constrain(y, ("batch", "length", "heads", "head_dim"))

        return proj(self.wq, self.bq), proj(self.wk, self.bk), proj(self.wv, self.bv)

    def out(self, attended: jax.Array) -> jax.Array:
        """The output projection of attention results [b, s, heads, d] -> [b, s, dim]."""
        dt = self.dtype
        y = jnp.einsum("bshd,hde->bse", attended, self.wo[...].astype(dt))
        return y + self.bo[...].astype(dt)


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
        up = checkpoint_name(x @ self.w_fc[...].astype(dt) + self.b_fc[...].astype(dt), "mlp_up")
        h = constrain(checkpoint_name(jax.nn.gelu(up), "mlp_hidden"), ("batch", "length", "mlp"))
        return checkpoint_name(h @ self.w_proj[...].astype(dt) + self.b_proj[...].astype(dt),
                               "mlp_out")


class Block(nnx.Module):
    def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.attn = Attention(c, rngs)
        self.ln_2 = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)
        self.mlp = MLPBlock(c, rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 attend: Callable = attention) -> jax.Array:
        x = self.residual(x, self.attn(self.ln_1(x), segment_ids, attend))
        return self.residual(x, self.mlp(self.ln_2(x)))

    @staticmethod
    def residual(x: jax.Array, y: jax.Array) -> jax.Array:
        """The residual stream after adding a sublayer's output ``y``."""
        return constrain(x + y, ("batch", "length", "embed"))


class GPT2(LanguageModel):
    """GPT-2 causal LM: ``model(tokens [b, s]) -> logits [b, s, vocab]`` (float32); the
    protocol of `shardax.models.protocol`.

    The output projection is the token embedding (``wte``) transposed: one shared parameter.
    ``positions`` [b, s] index the learned position table (default ``0 .. s-1``).
    """

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs):
        c = self.config = config
        self.wte = param(rngs.params(), _normal(0.02), (c.vocab_size, c.dim),
                         ("vocab", "embed"), c.param_dtype)
        self.wpe = param(rngs.params(), _normal(0.01), (c.max_seq_len, c.dim),
                         (None, "embed"), c.param_dtype)
        self.layers = make_layers(lambda r: Block(c, r), c.n_layers, rngs)
        self.ln_f = LayerNorm(c.dim, c.norm_eps, c.param_dtype, rngs)

    def embed_inputs(self, tokens, positions=None, segment_ids=None, *, lookup=None):
        """Token plus position embeddings ``[b, s, dim]`` in the compute dtype, and the
        segment ids (if any) every block reads."""
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(f"length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}")
        if positions is None:
            pos = self.wpe[: tokens.shape[1]]
        else:
            pos = jnp.take(self.wpe[...], jnp.clip(positions, 0, c.max_seq_len - 1), axis=0)
        x = (lookup or embedding.lookup)(self.wte[...], tokens) + pos  # the table stays put
        x = constrain(x.astype(c.dtype), ("batch", "length", "embed"))
        return x, ({} if segment_ids is None else {"segment_ids": segment_ids})

    def block(self, layer, h, extras, attend=attention):
        """One transformer layer: ``(h, 0)`` (GPT-2 has no auxiliary loss)."""
        return layer(h, extras.get("segment_ids"), attend), jnp.zeros((), jnp.float32)

    def head_params(self):
        return self.ln_f.scale[...], self.ln_f.bias[...], self.wte[...]

    def head(self, x, scale, bias, w):
        """Final LayerNorm and the tied vocabulary projection: logits in float32."""
        c = self.config
        x = layer_norm(x, scale, bias, c.norm_eps)
        logits = jnp.einsum("bse,ve->bsv", x, w.astype(c.dtype)).astype(jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))
