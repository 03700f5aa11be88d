"""Model configs: the hyper-parameters of each model family and the named presets (no layers).

The translation to and from Hugging Face ``config.json`` dicts is `shardax.hf.configs`.

>>> CONFIGS['llama-tiny'].n_layers
4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from shardax.models.ops import RopeScaling, yarn_mscale

__all__ = ["CONFIGS", "GPT2Config", "LlamaConfig", "RopeScaling", "check_overrides"]

# How a model runs, not what it is: fields of shardax.layout.Layout (once config fields).
LAYOUT_FIELDS = ("remat", "attention", "scan_layers")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
MOE_IMPLS = ("capacity", "dropless")
ROUTER_SCORES = ("softmax", "sigmoid", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters. ``dtype`` is the compute dtype, ``param_dtype`` the storage one.

    How the model runs (its parallelism, remat, the attention implementation, scanned layers)
    is not here: it is a `shardax.layout.Layout`.
    ``n_experts > 0`` makes every MLP a top-``top_k`` mixture of experts with ``mlp_dim``
    hidden units per expert; ``moe_aux_weight`` weighs its load-balancing loss.

    ``rope_scaling`` is Llama-3's frequency scaling, ``qkv_bias`` adds q/k/v biases (Qwen2),
    ``sliding_window`` limits attention to that many positions back (Mistral).

    Qwen3 and Gemma 2/3 (`family` names which one a config is): ``head_dim_override`` sets
    the head size apart from ``dim // n_heads``; ``qk_norm`` RMS-normalises q and k per head
    before RoPE; ``norm_offset=1`` makes every RMSNorm scale by ``1 + w`` (weights stored
    zero-centred); ``post_norms`` adds a norm after attention and after the MLP (before each
    residual add); ``mlp_activation`` 'gelu_tanh' makes the gated MLP GeGLU; ``embed_scale``
    multiplies the embeddings by ``sqrt(dim)``; ``attn_softcap`` / ``final_softcap``
    soft-cap attention scores / output logits (``c * tanh(x / c)``); ``query_pre_attn_scalar``
    makes the attention scale ``query_pre_attn_scalar ** -0.5``. ``global_every=k > 0``:
    layer ``i`` attends globally when ``(i + 1) % k == 0`` and within ``sliding_window``
    otherwise, and ``rope_local_theta`` (when set) is the RoPE base of those sliding layers.

    Mixture of experts: ``moe_impl`` 'capacity' (``llama_moe.MoE``: fixed expert capacity,
    overflowing tokens dropped) or 'dropless' (``moe.DroplessMoE``: sorted tokens and grouped
    matmuls, Mixtral / Qwen-MoE); ``moe_norm_topk`` renormalises the top-k router weights
    (dropless); ``shared_expert_dim > 0`` adds Qwen2-MoE's gated shared expert.
    DeepSeek-V3's router (dropless): ``router_score`` 'sigmoid' (else 'softmax'), a per-layer
    bias added to the scores to pick the top-k (not to weigh them), moved by
    ``router_bias_update`` (gamma; 0: fixed, DeepSeek-V3 used 0.001) after each step towards
    equal load (auxiliary-loss-free balancing, `shardax.train.balance`), and the weights
    times ``routed_scaling_factor``. ``shared_expert_gate=False``: the shared expert is added
    ungated (DeepSeek-V3's ``n_shared_experts * moe_intermediate_size`` units).
    Group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``): the experts form
    ``n_group`` equal groups, a group scores the sum of its 2 best (biased) scores, and the
    top-k is taken among the experts of the ``topk_group`` best groups only.

    DeepSeek-V3's multi-head latent attention (``kv_lora_rank > 0``, `shardax.models.mla`):
    q through a rank-``q_lora_rank`` bottleneck (0: one projection), keys and values
    decompressed from a normed rank-``kv_lora_rank`` latent, RoPE on the last
    ``qk_rope_head_dim`` dims of each query head and on one key part shared by all heads;
    ``head_dim`` (``head_dim_override``) is the query/key head size (nope + rope),
    ``v_head_dim`` the value head size, ``n_kv_heads == n_heads``; ``rope_interleave``: the
    rotated dims are stored in pairs (DeepSeek's checkpoints). ``first_k_dense`` layers
    come first with a dense MLP of ``dense_mlp_dim`` (0: ``mlp_dim``) units.
    gpt-oss: ``attn_sinks`` gives every attention layer a learned logit per head in the
    softmax denominator; ``attn_out_bias`` a bias on the output projection (with
    ``qkv_bias``: gpt-oss's ``attention_bias``); ``moe_bias`` biases on the router and on
    every expert's gate, up and down projections (dropless); ``router_score='topk_softmax'``
    takes the top-k of the router logits and softmaxes over those k; ``swiglu_limit`` (not
    None) makes the experts' activation the clamped ``(up + 1) * gate * sigmoid(swiglu_alpha *
    gate)``, gate clamped above and up on both sides at the limit.
    `shardax.hf.configs` reads and writes its Hugging Face ``config.json`` (Llama, Mistral,
    Qwen2/3, Gemma 2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss).
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
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01
    head_dim_override: int | None = None
    qk_norm: bool = False
    norm_offset: float = 0.0
    post_norms: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    global_every: int = 0
    rope_local_theta: float | None = None
    moe_impl: str = "capacity"
    moe_norm_topk: bool = True
    shared_expert_dim: int = 0
    router_score: str = "softmax"
    router_bias_update: float = 0.0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_gate: bool = True
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    first_k_dense: int = 0
    dense_mlp_dim: int = 0
    attn_sinks: bool = False
    attn_out_bias: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    lora: Any = None  # shardax.models.lora.LoRA: adapters on the weights, base frozen

    def __post_init__(self):
        if self.kv_lora_rank:
            self._check_mla()
        if not 0 <= self.first_k_dense <= self.n_layers or (self.first_k_dense
                                                            and not self.n_experts):
            raise ValueError(f"first_k_dense={self.first_k_dense} must be in [0, n_layers="
                             f"{self.n_layers}] and needs n_experts > 0")
        if self.head_dim_override is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got "
                             f"{self.mlp_activation!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.shared_expert_dim and self.moe_impl != "dropless":
            raise ValueError(f"shared_expert_dim={self.shared_expert_dim} needs "
                             "moe_impl='dropless'")
        if self.router_score not in ROUTER_SCORES:
            raise ValueError(f"router_score must be one of {ROUTER_SCORES}, got "
                             f"{self.router_score!r}")
        if self.router_bias_update < 0:
            raise ValueError(f"router_bias_update={self.router_bias_update} must be >= 0")
        if self.n_experts and self.moe_impl != "dropless" and (
                self.router_bias or self.routed_scaling_factor != 1.0 or self.moe_bias
                or self.swiglu_limit is not None or self.router_score != "softmax"):
            raise ValueError("router_score other than 'softmax', router_bias_update, "
                             "routed_scaling_factor, moe_bias and swiglu_limit need "
                             "moe_impl='dropless'")
        if self.mla and (self.attn_sinks or self.attn_out_bias):
            raise ValueError("multi-head latent attention has no attn_sinks or attn_out_bias")
        if self.n_group != 1 or self.topk_group != 1:
            self._check_groups()
        if self.global_every < 0:
            raise ValueError(f"global_every={self.global_every} must be >= 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None)")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"n_experts={self.n_experts} must be >= 0 and top_k={self.top_k} "
                             "in [1, n_experts]")

    def _check_groups(self) -> None:
        g, kg, n = self.n_group, self.topk_group, self.n_experts
        if (self.moe_impl != "dropless" or g < 1 or n % g or n // g < 2
                or not 1 <= kg <= g or kg * (n // g) < self.top_k):
            raise ValueError(f"group-limited routing (n_group={g}, topk_group={kg}) needs "
                             f"moe_impl='dropless', n_group dividing n_experts={n} into groups "
                             f"of 2 or more, 1 <= topk_group <= n_group, and top_k={self.top_k}"
                             " experts in the groups kept")

    def _check_mla(self) -> None:
        r, v = self.qk_rope_head_dim, self.v_head_dim
        if r <= 0 or r % 2 or not 0 < v <= self.head_dim or self.head_dim <= r:
            raise ValueError(f"multi-head latent attention (kv_lora_rank={self.kv_lora_rank}) "
                             f"needs an even qk_rope_head_dim={r} > 0 below head_dim="
                             f"{self.head_dim} (nope + rope) and 0 < v_head_dim={v} <= head_dim")
        if self.n_kv_heads != self.n_heads or self.qkv_bias or self.qk_norm:
            raise ValueError("multi-head latent attention needs n_kv_heads == n_heads "
                             f"({self.n_kv_heads} != {self.n_heads}?), no qkv_bias, no qk_norm")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The dims of q and k that RoPE rotates (MLA: ``qk_rope_head_dim``; else all)."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def is_dense(self, layer: int) -> bool:
        """Whether layer ``layer`` has a dense MLP (no experts, or one of ``first_k_dense``)."""
        return not self.n_experts or layer < self.first_k_dense

    @property
    def router_bias(self) -> bool:
        """Whether the MoE router has a balancing bias (sigmoid scores, or one that moves)."""
        return bool(self.n_experts) and (self.router_score == "sigmoid"
                                         or self.router_bias_update > 0)

    @property
    def mixed_layers(self) -> bool:
        """Whether layers differ (sliding-window and global ones, two RoPE bases, or
        ``first_k_dense`` dense layers before the experts)."""
        return self.first_k_dense > 0 or self.global_every > 0 and (
            self.sliding_window is not None or self.rope_local_theta is not None)

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` attends over the whole sequence with the global RoPE base
        (``global_every``); without ``global_every`` every layer does.

        >>> LlamaConfig(global_every=2, sliding_window=8).is_global(1)
        True
        """
        return not self.global_every or (layer + 1) % self.global_every == 0

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: global attention)."""
        if self.global_every and self.is_global(layer):
            return None
        return self.sliding_window

    @property
    def attn_scale(self) -> float | None:
        """The attention score scale (None: ``1 / sqrt(head_dim)``); DeepSeek's latent
        attention under YaRN multiplies it by ``yarn_mscale(factor, mscale_all_dim) ** 2``."""
        q = self.query_pre_attn_scalar
        s = self.rope_scaling
        if self.mla and s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
            m = yarn_mscale(s.factor, s.mscale_all_dim)
            return self.head_dim ** -0.5 * m * m
        return None if q is None else float(q) ** -0.5

    @property
    def family(self) -> str:
        """The Hugging Face model type this config has the form of: 'deepseek_v3', 'gpt_oss',
        'mixtral',
        'qwen2_moe', 'qwen3_moe', 'gemma3_text', 'gemma2', 'qwen3', 'qwen2', 'mistral' or 'llama'.

        >>> LlamaConfig(qk_norm=True).family
        'qwen3'
        """
        if self.n_experts and self.moe_impl == "dropless":
            if self.mla:
                return "deepseek_v3"
            if self.attn_sinks:
                return "gpt_oss"
            if self.qk_norm:
                return "qwen3_moe"
            return "qwen2_moe" if self.qkv_bias or self.shared_expert_dim else "mixtral"
        if self.norm_offset:
            return "gemma3_text" if self.qk_norm else "gemma2"
        if self.qk_norm:
            return "qwen3"
        if self.qkv_bias:
            return "qwen2"
        return "mistral" if self.sliding_window is not None else "llama"


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
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
    # Llama 3 8B shapes (for `shardax plan`: planning needs no parameters in memory).
    "llama-8b": LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_dim=14336,
        max_seq_len=8192, rope_theta=500000.0,
    ),
    # llama-tiny with a 4-expert, top-2 mixture-of-experts MLP in every layer.
    "llama-moe-tiny": LlamaConfig(mlp_dim=128, n_experts=4, top_k=2),
    # DeepSeek-V3's routing on llama-moe-tiny: dropless, sigmoid scores, auxiliary-loss-free
    # balancing (a bias moved by 0.001 per step, no load-balancing loss).
    "llama-moe-aux-free-tiny": LlamaConfig(mlp_dim=128, n_experts=4, top_k=2,
                                           moe_impl="dropless", router_score="sigmoid",
                                           router_bias_update=0.001, moe_aux_weight=0.0),
    # DeepSeek-V3 shapes (671B without its multi-token-prediction layer): latent attention,
    # 3 dense layers, 256 routed experts top-8 (from the 4 best of 8 groups) plus one shared.
    # Its layers differ, so they are listed: `shardax plan` compiles 4 and 5 of them and
    # extends to 61 (`shardax.plan.depth`).
    "deepseek-v3": LlamaConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, mlp_dim=2048,
        max_seq_len=4096, norm_eps=1e-6, n_experts=256, top_k=8, moe_impl="dropless",
        router_score="sigmoid", routed_scaling_factor=2.5, moe_aux_weight=0.0,
        n_group=8, topk_group=4, shared_expert_dim=2048, shared_expert_gate=False,
        first_k_dense=3, dense_mlp_dim=18432, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, head_dim_override=192, v_head_dim=128),
    # gpt-oss shapes (openai/gpt-oss-20b and -120b config.json): sliding (128) and full layers
    # alternating, attention sinks, biases, top-4 experts with the clamped SwiGLU, YaRN x32.
    **{name: LlamaConfig(
        vocab_size=201088, dim=2880, n_layers=layers, n_heads=64, n_kv_heads=8,
        head_dim_override=64, mlp_dim=2880, max_seq_len=131072, rope_theta=150000.0,
        rope_scaling=RopeScaling(32.0, original_max_position_embeddings=4096,
                                 rope_type="yarn", truncate=False),
        sliding_window=128, global_every=2, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
        n_experts=experts, top_k=4, moe_impl="dropless", router_score="topk_softmax",
        moe_bias=True, swiglu_limit=7.0, moe_aux_weight=0.001)
       for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
}




@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyper-parameters; ``dtype`` computes, ``param_dtype`` stores; see ``LlamaConfig``.

    The MLP's GELU is the tanh approximation (Hugging Face's ``gelu_new``)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    mlp_dim: int = 256
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    lora: Any = None  # shardax.models.lora.LoRA: adapters on the weights, base frozen

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


GPT2_CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(),
    # GPT-2 small (124M); vocabulary 50257 padded to 50304 (a multiple of 128) so it splits
    # evenly over tensor-parallel axes.
    "gpt2": GPT2Config(vocab_size=50304, dim=768, n_layers=12, n_heads=12, mlp_dim=3072,
                       max_seq_len=1024),
}



CONFIGS: dict[str, LlamaConfig | GPT2Config] = {**LLAMA_CONFIGS, **GPT2_CONFIGS}


def check_overrides(where: str, overrides: Mapping[str, Any]) -> None:
    """Raises ``TypeError`` naming `shardax.layout.Layout` when ``overrides`` of a model config
    hold a setting of how the model runs (``remat``, ``attention``, ``scan_layers``) rather
    than of what it is.

    >>> check_overrides("get_config('llama-tiny')", {"remat": "full"})
    Traceback (most recent call last):
    ...
    TypeError: get_config('llama-tiny'): remat is how the model runs, not its architecture: \
pass it as shardax.layout.Layout(remat=...) (to layout.forward or train_step)
    """
    runtime = [k for k in LAYOUT_FIELDS if k in overrides]
    if runtime:
        raise TypeError(f"{where}: {', '.join(runtime)} is how the model runs, not its "
                        f"architecture: pass it as shardax.layout.Layout({runtime[0]}=...) "
                        "(to layout.forward or train_step)")
