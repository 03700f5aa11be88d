"""Numerical building blocks shared by the Llama and GPT-2 models: norms, rotary position
embeddings (with ``rope_theta`` and Llama-3 ``rope_scaling``) and the einsum attention with a
dense mask (the models attend through ``shardax.models.attention``).

Example::

    cos, sin = rope_tables(positions, head_dim=16, theta=10000.0)
    q = apply_rope(q, cos, sin)
    out = gqa_attention(q, k, v)          # [b, s, heads, d]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from shardax.parallel import attention_kernel as kernel

__all__ = ["ROPE_TYPES", "RopeScaling", "apply_rope", "gqa_attention", "layer_norm", "rms_norm",
           "rope_frequencies", "rope_tables", "yarn_mscale"]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32, returned in ``x.dtype``; it multiplies by
    ``scale + offset`` (Gemma stores zero-centred scales and uses ``offset=1``).

    Example::

        y = rms_norm(x, jnp.ones(x.shape[-1]), 1e-5)
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (scale.astype(jnp.float32) + offset)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm computed in float32, returned in ``x.dtype``.

    Example::

        y = layer_norm(x, jnp.ones(64), jnp.zeros(64), 1e-5)
    """
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` / ``rope_parameters``:
    ``rope_type='llama3'`` (Llama 3.1), ``'linear'`` (every frequency divided by ``factor``:
    Gemma 3's global layers) or ``'yarn'`` (gpt-oss, DeepSeek-V3: frequencies interpolated
    outside the ``beta_fast`` .. ``beta_slow`` rotation band, and cos/sin multiplied by
    :attr:`attention_factor`). Fields a type does not use are ignored.

    Example::

        RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
        RopeScaling(factor=8.0, rope_type='linear')
        RopeScaling(factor=32.0, original_max_position_embeddings=4096, rope_type='yarn',
                    truncate=False)   # gpt-oss
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    yarn_attention_factor: float | None = None  # HF's "attention_factor" (None: from factor)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (so q.k by its square); 1 for other types.

        >>> RopeScaling(factor=32.0, rope_type='yarn').attention_factor
        1.3465735902799727
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return float(self.yarn_attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale)
                         / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)


ROPE_TYPES = ("llama3", "linear", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``).

    >>> yarn_mscale(1.0)
    1.0
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(exponents: np.ndarray, head_dim: int, theta: float, s: RopeScaling
                      ) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies (float32)."""
    def correction_dim(rotations):
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos = (np.float32(theta) ** exponents).astype(np.float32)
    inv = (1.0 / pos).astype(np.float32)
    interpolation = (1.0 / (np.float32(s.factor) * pos)).astype(np.float32)
    return (interpolation * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` (float32, computed as Hugging Face does).

    Example::

        rope_frequencies(128, 500000.0, RopeScaling())   # Llama 3.1
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv = (1.0 / np.float32(theta) ** exponents).astype(np.float32)
    if scaling is None:
        return inv
    s = scaling
    if s.rope_type == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "yarn":
        return _yarn_frequencies(exponents, head_dim, theta, s)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv).astype(np.float32)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables of shape [batch, length, head_dim // 2] for rotary embeddings (times
    YaRN's ``attention_factor``, as transformers scales them).

    Example::

        cos, sin = rope_tables(jnp.arange(16)[None], 16, 10000.0)
    """
    freqs = jnp.asarray(rope_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * freqs
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    factor = 1.0 if scaling is None else scaling.attention_factor
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [b, s, heads, head_dim] by the position angles (rotate-half convention,
    as Hugging Face Llama checkpoints store q/k)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                  mask: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention as one einsum (the whole score matrix): the reference
    ``shardax.models.attention``'s ``'einsum'`` implementation is.

    ``q``: [b, s, heads, d]; ``k``, ``v``: [b, t, kv_heads, d]; query head ``i`` reads kv head
    ``i // (heads // kv_heads)``. ``mask`` ([b, s, t] bool, true = may attend) replaces the
    causal ``tril``. Scores and softmax are in float32; rows that see no key give zeros.
    Returns [b, s, heads, d].

    Example::

        out = gqa_attention(q, k, v)
    """
    if mask is None:
        mask = kernel.allowed(*kernel.default_mask_inputs(q, k), True, None)
    return kernel.reference(q, k, v, mask, kernel.Spec())
