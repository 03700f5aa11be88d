"""Model configs (hyper-parameters only, no layers) and their translation to and from Hugging
Face ``config.json`` dicts.

Example::

    from shardax.models.configs import CONFIGS, config_from_hf
    cfg = CONFIGS['llama-tiny']
    cfg = config_from_hf(json.load(open('Llama-3.2-1B/config.json')))   # a LlamaConfig
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from shardax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from shardax.models.ops import RopeScaling
from shardax.models.remat import REMAT_POLICIES, check_remat

__all__ = ["ATTENTION_IMPLEMENTATIONS", "CONFIGS", "PP_SCHEDULES", "REMAT_POLICIES", "TP_MODES",
           "GPT2Config", "LlamaConfig", "RopeScaling", "config_from_hf"]

TP_MODES = ("none", "sync", "async", "async_bidi")
PP_SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters. ``dtype`` is the compute dtype, ``param_dtype`` the storage one.

    ``scan_layers`` stacks the layers on a 'layers' axis and runs them with ``nnx.scan``;
    ``remat`` is one of 'none', 'full', 'save_dots', 'offload' (a ``jax.checkpoint`` policy).

    Parallelism (no effect without the matching mesh axis): ``tp_mode`` 'none' leaves tensor
    parallelism to XLA and the rules, 'sync'/'async'/'async_bidi' use ``shardax.parallel``'s
    column/row-parallel blocks; ``sequence_parallel`` needs one of those (the async modes
    imply it). ``pp_*``: pipeline schedule, microbatches and virtual stages over 'pp' (needs
    ``scan_layers``). ``n_experts > 0`` makes every MLP a top-``top_k`` mixture of experts with
    ``mlp_dim`` hidden units per expert; ``moe_aux_weight`` weighs its load-balancing loss.

    ``rope_scaling`` is Llama-3's frequency scaling, ``qkv_bias`` adds q/k/v biases (Qwen2),
    ``sliding_window`` limits attention to that many positions back (Mistral).
    ``attention`` picks the implementation (``shardax.models.attention``: 'auto', 'cudnn',
    'xla', 'blockwise', 'einsum'); ``remat`` also takes 'dots', 'names:q,k,v' and
    'offload:q,k' (``shardax.models.remat``).
    :meth:`from_hf_config` reads a Hugging Face ``config.json`` (Llama, Mistral, Qwen2).
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
    attention: str = "auto"
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    scan_layers: bool = False
    remat: str = "none"
    tp_mode: str = "none"
    sequence_parallel: bool = False
    pp_schedule: str = "gpipe"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 1
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")
        check_remat(self.remat)
        _check_attention(self.attention)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None)")
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        if self.sequence_parallel and self.tp_mode == "none":
            raise ValueError("sequence_parallel needs explicit tensor parallelism: "
                             "tp_mode 'sync', 'async' or 'async_bidi'")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {PP_SCHEDULES}, got "
                             f"{self.pp_schedule!r}")
        if self.pp_microbatches < 1 or self.pp_virtual_stages < 1:
            raise ValueError(f"pp_microbatches={self.pp_microbatches} and pp_virtual_stages="
                             f"{self.pp_virtual_stages} must be >= 1")
        if self.pp_schedule != "circular" and self.pp_virtual_stages != 1:
            raise ValueError(f"pp_virtual_stages={self.pp_virtual_stages} needs "
                             f"pp_schedule='circular' ({self.pp_schedule} has one stage per "
                             "device)")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"n_experts={self.n_experts} must be >= 0 and top_k={self.top_k} "
                             "in [1, n_experts]")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
        """The config of a Hugging Face Llama / Mistral / Qwen2 ``config.json`` (a dict).

        Example::

            cfg = LlamaConfig.from_hf_config(json.load(open('llama/config.json')))
        """
        return _llama_from_hf(hf, overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict describing this model (``LlamaForCausalLM``, or
        ``Qwen2ForCausalLM`` when ``qkv_bias``)."""
        return _llama_to_hf(self)

    @property
    def sp(self) -> bool:
        """Sequence-parallel activations: asked for, or implied by an async TP mode."""
        return self.sequence_parallel or self.tp_mode.startswith("async")


def _check_attention(name: str) -> None:
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {name!r}")


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
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "auto"

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        check_remat(self.remat)
        _check_attention(self.attention)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> GPT2Config:
        """The config of a Hugging Face GPT-2 ``config.json`` (a dict).

        Example::

            cfg = GPT2Config.from_hf_config(json.load(open('gpt2/config.json')))
        """
        return _gpt2_from_hf(hf, overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict describing this model (``GPT2LMHeadModel``)."""
        return _gpt2_to_hf(self)


GPT2_CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(),
    # GPT-2 small (124M); vocabulary 50257 padded to 50304 (a multiple of 128) so it splits
    # evenly over tensor-parallel axes.
    "gpt2": GPT2Config(vocab_size=50304, dim=768, n_layers=12, n_heads=12, mlp_dim=3072,
                       max_seq_len=1024),
}



CONFIGS: dict[str, LlamaConfig | GPT2Config] = {**LLAMA_CONFIGS, **GPT2_CONFIGS}

# Hugging Face model_type -> the shardax config class that reads it.
HF_MODEL_TYPES = {"llama": LlamaConfig, "mistral": LlamaConfig, "qwen2": LlamaConfig,
                  "gpt2": GPT2Config}


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> LlamaConfig | GPT2Config:
    """The shardax config of a Hugging Face ``config.json`` dict, by its ``model_type``.

    Raises ``ValueError`` naming the model type or key shardax cannot represent.

    Example::

        cfg = config_from_hf({'model_type': 'gpt2', 'n_embd': 64, ...})   # a GPT2Config
    """
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        archs = hf.get("architectures")
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r} (architectures "
                         f"{archs}); supported: {sorted(HF_MODEL_TYPES)}")
    return HF_MODEL_TYPES[model_type].from_hf_config(hf, **overrides)


def _unsupported(model_type: str, key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{model_type} config.json: {key}={value!r} is not supported ({why})")


def _llama_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> LlamaConfig:
    mt = hf.get("model_type", "llama")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise _unsupported(mt, "head_dim", head_dim, f"must equal hidden_size/heads = "
                           f"{dim // heads}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(mt, "hidden_act", act, "the MLP is SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _unsupported(mt, key, hf[key], "only Qwen2's q/k/v biases are")
    scaling = None
    # transformers >= 5 writes "rope_parameters" (theta included); older ones "rope_scaling".
    rp = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rp.get("rope_theta", 10000.0))
    rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                  float(rs["high_freq_factor"]),
                                  int(rs["original_max_position_embeddings"]))
        elif kind != "default":
            raise _unsupported(mt, "rope_scaling", rs, "only rope_type 'llama3' is")
    max_len = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if (mt == "mistral" or hf.get("use_sliding_window")) else None
    fields = dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, mlp_dim=hf["intermediate_size"],
        max_seq_len=max_len, rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_scaling=scaling,
        qkv_bias=mt == "qwen2", sliding_window=int(window) if window else None,
    )
    return LlamaConfig(**{**fields, **overrides})


def _llama_to_hf(c: LlamaConfig) -> dict[str, Any]:
    if c.n_experts:
        raise ValueError("a mixture-of-experts Llama has no Hugging Face LlamaForCausalLM form")
    qwen = c.qkv_bias
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.mlp_dim, "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": _dtype_name(c.param_dtype),
        "rope_scaling": None if c.rope_scaling is None else {
            "rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)},
    }
    if not qwen:
        out.update(attention_bias=False, mlp_bias=False, head_dim=c.head_dim)
    if c.sliding_window is not None:
        if qwen:
            out.update(use_sliding_window=True, sliding_window=c.sliding_window)
        else:
            out.update(architectures=["MistralForCausalLM"], model_type="mistral",
                       sliding_window=c.sliding_window)
    return out


def _gpt2_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> GPT2Config:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported("gpt2", "activation_function", act, "the MLP uses tanh GELU")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise _unsupported("gpt2", key, hf[key], "plain GPT-2 attention only")
    if not hf.get("scale_attn_weights", True):
        raise _unsupported("gpt2", "scale_attn_weights", False, "scores are scaled")
    dim = hf["n_embd"]
    fields = dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        mlp_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.get("n_positions", 1024),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )
    return GPT2Config(**{**fields, **overrides})


def _gpt2_to_hf(c: GPT2Config) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
        "n_embd": c.dim, "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.mlp_dim,
        "n_positions": c.max_seq_len, "n_ctx": c.max_seq_len, "layer_norm_epsilon": c.norm_eps,
        "activation_function": "gelu_new", "tie_word_embeddings": True,
        "torch_dtype": _dtype_name(c.param_dtype),
    }


def _dtype_name(dtype: Any) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        jnp.dtype(dtype).name, "float32")
