"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in Flax NNX, with
the flags (``LlamaConfig``) that make it Mistral, Qwen2/3 or Gemma 2/3 (text).

Every parameter carries logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads',
'head_dim', 'layers', 'norm', 'expert'); key activations go through ``constrain`` with
('batch', 'length', ...) names, so sharding rules alone decide how the model is split.
The model is the architecture only: its parallelism, remat and attention implementation
are applied from outside (`shardax.layout`) through the protocol of `shardax.models.protocol`
(``embed``, ``layers``, ``block``, ``head``). ``n_experts > 0``: the MLP is a mixture of
experts (``llama_moe.MoE``, or the dropless ``moe.DroplessMoE`` with ``moe_impl='dropless'``).

Example::

    cfg = CONFIGS['llama-tiny']
    model = Llama(cfg, nnx.Rngs(0))
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
from shardax.models._layers import AttentionLayer, make_layers, param
from shardax.models.attention import attention
from shardax.models.configs import LLAMA_CONFIGS, LlamaConfig
from shardax.models.llama_moe import MoE
from shardax.models.mla import MLAttention
from shardax.models.moe import DroplessMoE
from shardax.models.ops import apply_rope, gqa_attention, rms_norm, rope_tables
from shardax.models.protocol import LanguageModel
from shardax.models.remat import checkpoint_name

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "apply_rope", "attention", "gate_activation",
           "gqa_attention", "param_count", "rms_norm", "rope_tables"]

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros
CONFIGS = LLAMA_CONFIGS

def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, computed from the config alone.

    Example::

        param_count(CONFIGS['llama-1b'])   # 1_100_048_384
    """
    c = config
    attn = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    if c.qkv_bias:
        attn += c.head_dim * (c.n_heads + 2 * c.n_kv_heads)
    if c.qk_norm:
        attn += 2 * c.head_dim
    attn += c.dim * c.attn_out_bias + c.n_heads * c.attn_sinks
    if c.mla:
        h, r, kl, ql = c.n_heads, c.qk_rope_head_dim, c.kv_lora_rank, c.q_lora_rank
        q = (c.dim * ql + ql + ql * h * c.head_dim) if ql else c.dim * h * c.head_dim
        attn = (q + c.dim * (kl + r) + kl + kl * h * (c.head_dim - r + c.v_head_dim)
                + h * c.v_head_dim * c.dim)
    dense = 3 * c.dim * (c.dense_mlp_dim or c.mlp_dim if c.n_experts else c.mlp_dim)
    mlp = dense
    if c.n_experts:
        mlp = c.n_experts * 3 * c.dim * c.mlp_dim + c.dim * c.n_experts
        if c.moe_bias:
            mlp += c.n_experts * (2 * c.mlp_dim + c.dim + 1)
        if c.shared_expert_dim:
            mlp += 3 * c.dim * c.shared_expert_dim + (c.dim if c.shared_expert_gate else 0)
    layer = attn + (4 if c.post_norms else 2) * c.dim
    mlps = c.first_k_dense * dense + (c.n_layers - c.first_k_dense) * mlp
    head = 0 if c.tie_embeddings else c.dim * c.vocab_size
    return c.vocab_size * c.dim + c.n_layers * layer + mlps + c.dim + head


class RMSNorm(nnx.Module):
    """RMSNorm scaling by ``w + offset`` (``offset=1``: Gemma's zero-centred ``w``, initialised
    to 0), so that a new norm is the identity scale either way."""

    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs,
                 offset: float = 0.0):
        self.eps, self.offset = eps, offset
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = param(rngs.params(), init, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


def _norm(c: LlamaConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, c.norm_eps, c.param_dtype, rngs, c.norm_offset)


def gate_activation(c: LlamaConfig) -> Callable[[jax.Array], jax.Array]:
    """The gate activation: SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU)."""
    if c.mlp_activation == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


class Attention(AttentionLayer):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        hd, pd = c.head_dim, c.param_dtype
        self.config = c
        self.dtype = c.dtype
        self.wq = param(rngs.params(), _normal(std), (c.dim, c.n_heads, hd),
                        ("embed", "heads", "head_dim"), pd)
        self.wk = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs.params(), _normal(out_std), (c.n_heads, hd, c.dim),
                        ("heads", "head_dim", "embed"), pd)
        if c.qkv_bias:
            self.bq = param(rngs.params(), _zeros, (c.n_heads, hd), ("heads", "head_dim"), pd)
            self.bk = param(rngs.params(), _zeros, (c.n_kv_heads, hd), ("kv_heads", "head_dim"),
                            pd)
            self.bv = param(rngs.params(), _zeros, (c.n_kv_heads, hd), ("kv_heads", "head_dim"),
                            pd)
        if c.qk_norm:
            self.q_norm = _norm(c, hd, rngs)
            self.k_norm = _norm(c, hd, rngs)
        if c.attn_out_bias:
            self.bo = param(rngs.params(), _zeros, (c.dim,), ("embed",), pd)
        if c.attn_sinks:  # gpt-oss: one logit per head in the softmax denominator
            self.sinks = param(rngs.params(), _zeros, (c.n_heads,), ("heads",), pd)
        # Per-layer attention kind; `Llama` sets it per layer when the layers differ.
        self.window: int | None = c.sliding_window
        self.local_rope = False

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, fn: Callable = attention,
               **masks: Any) -> jax.Array:
        """Attention of roped q, k and v under the config (sliding window, soft-cap, scale)
        through ``fn`` (``shardax.models.attention.attention``, or the layout's: its
        implementation, ring attention); ``masks``: more keyword arguments of it."""
        c = self.config
        q, k, v = (checkpoint_name(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        if c.attn_sinks:
            masks["sinks"] = self.sinks[...]
        out = fn(q, k, v, window=self.window, softcap=c.attn_softcap, scale=c.attn_scale,
                 **masks)
        return checkpoint_name(out, "attn_out")

    def rope(self, q: jax.Array, k: jax.Array, cos: Any, sin: Any
             ) -> tuple[jax.Array, jax.Array]:
        """q and k rotated by this layer's tables: ``cos``/``sin`` are one table, or a
        ``(global, local)`` pair when sliding layers have their own base (Gemma 3)."""
        if isinstance(cos, tuple):
            i = 1 if self.local_rope else 0
            cos, sin = cos[i], sin[i]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q and k normed per head (``qk_norm``; unchanged without it)."""
        if not self.config.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def out(self, attended: jax.Array) -> jax.Array:
        """The output projection of attention results [b, s, heads, d] -> [b, s, dim]."""
        y = jnp.einsum("bshd,hde->bse", attended, self.wo[...].astype(self.dtype))
        return y + self.bo[...].astype(self.dtype) if self.config.attn_out_bias else y

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, heads, d], k and v [b, s, kv_heads, d], before RoPE (q and k normed per
        head with ``qk_norm``)."""
        dt = self.dtype
        out = []
        for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")):
            y = jnp.einsum("bse,ehd->bshd", x, getattr(self, w)[...].astype(dt))
            if self.config.qkv_bias:
                y = y + getattr(self, bias)[...].astype(dt)
            out.append(y)
        q, k = self.qk_norm(out[0], out[1])
        return q, k, out[2]


class SwiGLU(nnx.Module):
    """The gated MLP ``down(act(gate(x)) * up(x))``: SwiGLU, or GeGLU with
    ``mlp_activation='gelu_tanh'``."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs, mlp_dim: int | None = None):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        pd, m = c.param_dtype, mlp_dim or c.mlp_dim
        self.dtype = c.dtype
        self.w_gate = param(rngs.params(), _normal(std), (c.dim, m), ("embed", "mlp"), pd)
        self.w_up = param(rngs.params(), _normal(std), (c.dim, m), ("embed", "mlp"), pd)
        self.w_down = param(rngs.params(), _normal(out_std), (m, c.dim), ("mlp", "embed"), pd)

        self.config = c

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, c = self.dtype, self.config
        gate = checkpoint_name(x @ self.w_gate[...].astype(dt), "mlp_gate")
        up = checkpoint_name(x @ self.w_up[...].astype(dt), "mlp_up")
        h = constrain(checkpoint_name(gate_activation(c)(gate) * up, "mlp_hidden"),
                      ("batch", "length", "mlp"))
        return checkpoint_name(h @ self.w_down[...].astype(dt), "mlp_out")


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with
    ``post_norms`` (Gemma 2/3) the attention and MLP outputs are normed again before each add.

    Returns ``(x, aux)``: ``aux`` is the MoE's `MoEStats` (0 for a dense MLP). ``dense``: a
    dense MLP of ``dense_mlp_dim`` units in a model with experts (``first_k_dense``).
    """

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs, dense: bool = False):
        self.config = c
        self.attn_norm = _norm(c, c.dim, rngs)
        self.attn = MLAttention(c, rngs) if c.mla else Attention(c, rngs)
        self.mlp_norm = _norm(c, c.dim, rngs)
        if dense:
            self.mlp = SwiGLU(c, rngs, c.dense_mlp_dim)
        elif not c.n_experts:
            self.mlp = SwiGLU(c, rngs)
        else:
            self.mlp = DroplessMoE(c, rngs) if c.moe_impl == "dropless" else MoE(c, rngs)
        if c.post_norms:
            self.attn_post_norm = _norm(c, c.dim, rngs)
            self.mlp_post_norm = _norm(c, c.dim, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 segment_ids: jax.Array | None = None, attend: Callable = attention
                 ) -> tuple[jax.Array, jax.Array]:
        x = self.attn_residual(x, self.attn(self.attn_norm(x), cos, sin, segment_ids, attend))
        return self.mlp_residual(x)

    def attn_residual(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """The residual stream after adding the attention output ``y``."""
        if self.config.post_norms:
            y = self.attn_post_norm(y)
        return constrain(x + y, ("batch", "length", "embed"))

    def mlp_residual(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(x + mlp(norm(x)), aux)``: the MLP half of the layer."""
        return self.mlp_add(x, self.mlp(self.mlp_norm(x)))

    def mlp_add(self, x: jax.Array, y: Any) -> tuple[jax.Array, jax.Array]:
        """``(x + y, aux)`` for the MLP output ``y`` (or ``(y, stats)`` of a mixture of
        experts), post-normed with ``post_norms``."""
        y, aux = y if isinstance(y, tuple) else (y, jnp.zeros((), jnp.float32))
        if self.config.post_norms:
            y = self.mlp_post_norm(y)
        return constrain(x + y, ("batch", "length", "embed")), aux


class Llama(LanguageModel):
    """Causal language model: ``model(tokens [b, s]) -> logits [b, s, vocab]`` (float32); the
    protocol of `shardax.models.protocol`.

    Example::

        model = Llama(CONFIGS['llama-tiny'], nnx.Rngs(0))
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = param(rngs.params(), _normal(0.02), (c.vocab_size, c.dim),
                                 ("vocab", "embed"), c.param_dtype)
        kinds = iter(range(c.n_layers))  # make_layers builds layer i from the i-th call
        self.layers = make_layers(
            lambda r: Block(c, r, dense=c.first_k_dense > 0 and c.is_dense(next(kinds))),
            c.n_layers, rngs, stacked=not c.mixed_layers)  # a list where layers differ
        if c.mixed_layers:  # list layout
            for i, layer in enumerate(self.layers):
                layer.attn.window = c.window_of(i)
                layer.attn.local_rope = c.rope_local_theta is not None and not c.is_global(i)
        self.final_norm = _norm(c, c.dim, rngs)
        if not c.tie_embeddings:
            self.lm_head = param(rngs.params(), _normal(0.02), (c.dim, c.vocab_size),
                                 ("embed", "vocab"), c.param_dtype)

    @property
    def has_aux(self) -> bool:
        return bool(self.config.n_experts)

    @property
    def aux_weight(self) -> float:
        return self.config.moe_aux_weight

    @property
    def lookup_table(self) -> str | None:
        return None if self.config.tie_embeddings else "embed"

    def embed_inputs(self, tokens, positions=None, segment_ids=None, *, lookup=None):
        """Token embeddings ``[b, s, dim]`` in the compute dtype, and the RoPE tables (and
        segment ids) every block reads."""
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(f"length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = (lookup or embedding.lookup)(self.embed[...], tokens).astype(c.dtype)
        if c.embed_scale:  # Gemma: the scale rounded to the compute dtype, as transformers
            x = x * jnp.asarray(c.dim ** 0.5, c.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_tables(positions, c.rope_dim, c.rope_theta, c.rope_scaling)
        if c.rope_local_theta is not None:  # (global, local) tables: see Attention.rope
            lcos, lsin = rope_tables(positions, c.head_dim, c.rope_local_theta)
            cos, sin = (cos, lcos), (sin, lsin)
        extras = {"cos": cos, "sin": sin}
        if segment_ids is not None:
            extras["segment_ids"] = segment_ids
        return x, extras

    def block(self, layer, h, extras, attend=attention):
        """One decoder layer: ``(h, aux)``, aux the MoE's `MoEStats` (0 if dense)."""
        return layer(h, extras["cos"], extras["sin"], extras.get("segment_ids"), attend)

    def head_params(self):
        w = self.embed if self.config.tie_embeddings else self.lm_head
        return self.final_norm.scale[...], w[...]

    def head(self, x, norm_scale, w):
        """Final norm and vocabulary projection: logits ``[b, s, vocab]`` in float32."""
        c = self.config
        x = rms_norm(x, norm_scale, c.norm_eps, c.norm_offset)
        spec = "bse,ve->bsv" if c.tie_embeddings else "bse,ev->bsv"
        # Computed in the compute dtype, then widened: with preferred_element_type=float32 the
        # backward would gather and reduce the (tied) table in float32 under bf16 params.
        logits = jnp.einsum(spec, x, w.astype(c.dtype)).astype(jnp.float32)
        if c.final_softcap is not None:
            logits = c.final_softcap * jnp.tanh(logits / c.final_softcap)
        return constrain(logits, ("batch", "length", "vocab"))
