"""Model configs to and from Hugging Face ``config.json`` dicts (Llama, Mistral, Qwen2, GPT-2).

>>> from shardax.models.configs import CONFIGS
>>> config = config_from_hf(config_to_hf(CONFIGS["llama-tiny"]))
>>> config.n_layers == CONFIGS["llama-tiny"].n_layers
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from shardax.models.configs import GPT2Config, LlamaConfig, RopeScaling

__all__ = ["HF_MODEL_TYPES", "config_from_hf", "config_to_hf"]

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
    if HF_MODEL_TYPES[model_type] is GPT2Config:
        return _gpt2_from_hf(hf, overrides)
    return _llama_from_hf(hf, overrides)


def config_to_hf(config: LlamaConfig | GPT2Config) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict describing a model: ``LlamaForCausalLM`` (or
    ``Qwen2ForCausalLM`` when ``qkv_bias``), or ``GPT2LMHeadModel``.

    >>> from shardax.models.configs import CONFIGS
    >>> config_to_hf(CONFIGS["gpt2-tiny"])["model_type"]
    'gpt2'
    """
    if isinstance(config, GPT2Config):
        return _gpt2_to_hf(config)
    return _llama_to_hf(config)


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
