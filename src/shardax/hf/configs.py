"""Model configs to and from Hugging Face ``config.json`` dicts (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 text, Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss, GPT-2).

>>> from shardax.models.configs import CONFIGS
>>> config = config_from_hf(config_to_hf(CONFIGS["llama-tiny"]))
>>> config.n_layers == CONFIGS["llama-tiny"].n_layers
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from shardax.models.configs import GPT2Config, LlamaConfig, RopeScaling

__all__ = ["HF_MODEL_TYPES", "config_from_hf", "config_to_hf"]

# Hugging Face model_type -> the shardax config class that reads it.
HF_MODEL_TYPES = {"llama": LlamaConfig, "mistral": LlamaConfig, "qwen2": LlamaConfig,
                  "qwen3": LlamaConfig, "gemma2": LlamaConfig, "gemma3_text": LlamaConfig,
                  "mixtral": LlamaConfig, "qwen2_moe": LlamaConfig, "qwen3_moe": LlamaConfig,
                  "deepseek_v3": LlamaConfig, "gpt_oss": LlamaConfig, "gpt2": GPT2Config}
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
GEMMA_TYPES = ("gemma2", "gemma3_text")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
# Hugging Face activation name -> LlamaConfig.mlp_activation (the first name is written).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    """A Hugging Face ``config.json`` dict describing a model: the architecture of the Llama
    config's ``family`` (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``), or
    ``GPT2LMHeadModel``.

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
    gemma = mt in GEMMA_TYPES
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    if mt == "deepseek_v3":  # its head_dim is the RoPE part
        head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    if head_dim * heads != dim and mt in ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe"):
        raise _unsupported(mt, "head_dim", head_dim, f"must equal hidden_size/heads = "
                           f"{dim // heads}")
    act_key = "hidden_activation" if gemma and hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in _ACTIVATIONS:
        raise _unsupported(mt, act_key, act, f"the gated MLP supports {sorted(_ACTIVATIONS)}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (mt == "gpt_oss" and key == "attention_bias"):
            raise _unsupported(mt, key, hf[key], "only Qwen2's q/k/v biases are")
    if hf.get("use_bidirectional_attention"):
        raise _unsupported(mt, "use_bidirectional_attention", True, "attention is causal")
    # transformers >= 5 writes "rope_parameters" (theta included; Gemma 3 one per layer
    # type); older ones "rope_theta", "rope_scaling" and Gemma 3's "rope_local_base_freq".
    rp = hf.get("rope_parameters") or {}
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rp:
        local = rp.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise _unsupported(mt, "rope_parameters.sliding_attention", local,
                               "sliding layers take rope_type 'default' only")
        local_theta = local.get("rope_theta", local_theta)
        rp = rp["full_attention"]
    theta = hf.get("rope_theta", rp.get("rope_theta", 10000.0))
    rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    scaling = _rope_scaling_from_hf(mt, rs, hf) if rs else None
    max_len = hf.get("max_position_embeddings", 2048)
    window, global_every = _windows(mt, hf)
    qpas = hf.get("query_pre_attn_scalar") if gemma else None
    fields = dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, mlp_dim=hf["intermediate_size"],
        max_seq_len=max_len, rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)), rope_scaling=scaling,
        qkv_bias=mt == "qwen2", sliding_window=window, global_every=global_every,
        head_dim_override=head_dim if head_dim * heads != dim else None,
        qk_norm=mt in ("qwen3", "gemma3_text"), norm_offset=1.0 if gemma else 0.0,
        post_norms=gemma, mlp_activation=_ACTIVATIONS[act], embed_scale=gemma,
        attn_softcap=_float_or_none(hf.get("attn_logit_softcapping")) if gemma else None,
        final_softcap=_float_or_none(hf.get("final_logit_softcapping")) if gemma else None,
        query_pre_attn_scalar=None if qpas is None else float(qpas),
        rope_local_theta=(None if local_theta is None or mt != "gemma3_text"
                          else float(local_theta)),
    )
    if mt == "qwen3_moe":
        fields["qk_norm"] = True
    if mt in MOE_TYPES:
        fields.update(_moe_from_hf(mt, hf))
    if mt == "deepseek_v3":
        fields.update(_deepseek_from_hf(hf, head_dim))
    if mt == "gpt_oss":
        fields.update(_gpt_oss_from_hf(hf))
    return LlamaConfig(**{**fields, **overrides})


def _gpt_oss_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields: sinks, q/k/v/o biases, biased experts with the clamped SwiGLU."""
    quant = hf.get("quantization_config")
    if quant:
        raise _unsupported("gpt_oss", "quantization_config", {"quant_method": quant.get(
            "quant_method")}, "MXFP4 expert weights are not read: import a bfloat16 checkpoint "
            "or dequantize it first (transformers' Mxfp4Config(dequantize=True), then "
            "save_pretrained)")
    bias = bool(hf.get("attention_bias", True))
    return dict(n_experts=hf["num_local_experts"], mlp_dim=hf["intermediate_size"],
                router_score="topk_softmax", moe_bias=True, qkv_bias=bias, attn_out_bias=bias,
                attn_sinks=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _rope_scaling_from_hf(mt: str, rs: Mapping[str, Any], hf: Mapping[str, Any]
                          ) -> RopeScaling | None:
    """The `RopeScaling` of a ``rope_scaling`` / ``rope_parameters`` dict (None: default)."""
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        return RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                           float(rs["high_freq_factor"]),
                           int(rs["original_max_position_embeddings"]))
    if kind == "linear":
        return RopeScaling(float(rs["factor"]), rope_type="linear")
    if kind == "yarn":
        original = int(rs["original_max_position_embeddings"])
        factor = rs.get("factor") or hf["max_position_embeddings"] / original
        af = rs.get("attention_factor")
        return RopeScaling(
            float(factor), original_max_position_embeddings=original, rope_type="yarn",
            beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
            truncate=bool(rs.get("truncate", True)), mscale=float(rs.get("mscale") or 0),
            mscale_all_dim=float(rs.get("mscale_all_dim") or 0),
            yarn_attention_factor=None if af is None else float(af))
    if kind != "default":
        raise _unsupported(mt, "rope_scaling", dict(rs), "only rope_type 'llama3', 'linear' "
                           "and 'yarn' are")
    return None


def _deepseek_from_hf(hf: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """DeepSeek-V3's fields: latent attention, first dense layers, sigmoid routing."""
    mt = "deepseek_v3"
    groups = (hf.get("n_group") or 1, hf.get("topk_group") or 1)
    n, k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    g, kg = groups
    if not (isinstance(g, int) and isinstance(kg, int) and g >= 1 and n % g == 0
            and (g == 1 or n // g >= 2) and 1 <= kg <= g and kg * (n // g) >= k):
        raise _unsupported(mt, "n_group/topk_group", groups, f"n_group must split the "
                           f"n_routed_experts={n} into groups of 2 or more, topk_group be in "
                           f"[1, n_group] and its groups hold num_experts_per_tok={k} experts")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get(
            "scoring_func", "sigmoid") != "sigmoid":
        raise _unsupported(mt, "topk_method/scoring_func", (hf.get("topk_method"),
                           hf.get("scoring_func")), "only 'noaux_tc' with 'sigmoid' is")
    return dict(
        n_experts=hf["n_routed_experts"], mlp_dim=hf["moe_intermediate_size"],
        moe_norm_topk=bool(hf.get("norm_topk_prob", True)), router_score="sigmoid",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=g, topk_group=kg,
        shared_expert_dim=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        shared_expert_gate=False, moe_aux_weight=0.0,
        first_k_dense=hf.get("first_k_dense_replace", 0), dense_mlp_dim=hf["intermediate_size"],
        kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)), n_kv_heads=hf[
            "num_attention_heads"], head_dim_override=head_dim)


def _moe_from_hf(mt: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The dropless mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config."""
    if mt != "mixtral":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise _unsupported(mt, "decoder_sparse_step/mlp_only_layers",
                               (hf.get("decoder_sparse_step"), hf.get("mlp_only_layers")),
                               "every layer must be a mixture of experts")
    if mt in ("deepseek_v3", "gpt_oss"):
        return dict(top_k=hf["num_experts_per_tok"], moe_impl="dropless",
                    moe_aux_weight=float(hf.get("router_aux_loss_coef", 0.001)))
    fields = dict(
        n_experts=hf.get("num_local_experts") or hf["num_experts"],
        top_k=hf["num_experts_per_tok"], moe_impl="dropless",
        moe_norm_topk=True if mt == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        moe_aux_weight=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    if mt != "mixtral":
        fields["mlp_dim"] = hf["moe_intermediate_size"]
    if mt == "qwen2_moe":
        fields.update(qkv_bias=bool(hf.get("qkv_bias", True)),
                      shared_expert_dim=int(hf.get("shared_expert_intermediate_size") or 0))
    return fields


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def _windows(mt: str, hf: Mapping[str, Any]) -> tuple[int | None, int]:
    """``(sliding_window, global_every)`` from ``sliding_window`` and ``layer_types`` (or, in
    older configs, Mistral's all-sliding layers, ``use_sliding_window`` and Gemma's pattern)."""
    window = hf.get("sliding_window")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        if mt in GEMMA_TYPES:
            k = 2 if mt == "gemma2" else hf.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % k == 0 else "sliding_attention"
                     for i in range(n)]
        elif mt in ("mistral", "mixtral") or hf.get("use_sliding_window"):
            types = ["sliding_attention"] * n
        else:
            types = ["full_attention"] * n
    if mt.startswith("qwen") and not hf.get("use_sliding_window"):
        window = None  # transformers ignores the window then
    if not window or "sliding_attention" not in types:
        return None, 0
    if "full_attention" not in types:
        return int(window), 0
    k = types.index("full_attention") + 1
    if types != ["full_attention" if (i + 1) % k == 0 else "sliding_attention"
                 for i in range(n)]:
        raise _unsupported(mt, "layer_types", types, "sliding layers must be all, none, or "
                           "all but every k-th")
    return int(window), k


def _llama_to_hf(c: LlamaConfig) -> dict[str, Any]:
    if c.n_experts and c.moe_impl != "dropless":
        raise ValueError("a capacity-based mixture-of-experts Llama has no Hugging Face form "
                         "(moe_impl='dropless' exports as Mixtral or Qwen-MoE)")
    mt = c.family
    if mt in GEMMA_TYPES:
        return _gemma_to_hf(c, mt)
    if mt == "deepseek_v3":
        return _deepseek_to_hf(c)
    if mt == "gpt_oss":
        return _gpt_oss_to_hf(c)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]], "model_type": mt,
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.mlp_dim, "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.norm_eps,
        "hidden_act": _activation_name(c),
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": _dtype_name(c.param_dtype),
        "rope_scaling": _rope_scaling_to_hf(c.rope_scaling),
    }
    if mt not in ("qwen2", "qwen2_moe"):
        out.update(attention_bias=False, head_dim=c.head_dim)
    if mt in ("llama", "mistral"):
        out.update(mlp_bias=False)
    if mt in MOE_TYPES:
        out.update(_moe_to_hf(c, mt))
    if c.sliding_window is not None:
        if mt in ("mistral", "mixtral"):
            out.update(sliding_window=c.sliding_window)
        else:
            out.update(use_sliding_window=True, sliding_window=c.sliding_window,
                       max_window_layers=0, layer_types=_layer_types(c))
    elif mt in ("qwen3", "qwen2_moe", "qwen3_moe"):
        out.update(use_sliding_window=False, layer_types=_layer_types(c))
    return out


def _moe_to_hf(c: LlamaConfig, mt: str) -> dict[str, Any]:
    out: dict[str, Any] = {"num_experts_per_tok": c.top_k,
                           "router_aux_loss_coef": c.moe_aux_weight}
    if (c.n_group, c.topk_group) != (1, 1):
        raise ValueError(f"{mt} has no group-limited routing: n_group={c.n_group}, topk_group="
                         f"{c.topk_group} export only as DeepSeek-V3 (kv_lora_rank > 0)")
    if mt == "mixtral":
        if not c.moe_norm_topk:
            raise ValueError("Mixtral renormalises the top-k router weights: moe_norm_topk "
                             "must be True")
        return {**out, "num_local_experts": c.n_experts}
    # transformers 5 writes Qwen3-MoE's count as num_local_experts, Qwen2-MoE's as num_experts.
    experts_key = "num_local_experts" if mt == "qwen3_moe" else "num_experts"
    out.update({experts_key: c.n_experts}, moe_intermediate_size=c.mlp_dim,
               norm_topk_prob=c.moe_norm_topk, decoder_sparse_step=1, mlp_only_layers=[])
    if mt == "qwen2_moe":
        if not c.qkv_bias or not c.shared_expert_dim:
            raise ValueError("a Qwen2-MoE config needs qkv_bias and a shared expert "
                             f"(shared_expert_dim > 0), got qkv_bias={c.qkv_bias}, "
                             f"shared_expert_dim={c.shared_expert_dim}")
        out.update(qkv_bias=True, shared_expert_intermediate_size=c.shared_expert_dim)
    return out


def _deepseek_to_hf(c: LlamaConfig) -> dict[str, Any]:
    shared, m = c.shared_expert_dim, c.mlp_dim
    if (c.router_score != "sigmoid" or c.shared_expert_gate or shared % m
            or (c.rope_scaling is not None and c.rope_scaling.rope_type != "yarn")
            or c.sliding_window is not None or c.tie_embeddings):
        raise ValueError("a DeepSeek-V3 config (kv_lora_rank > 0 with experts) needs "
                         "router_score='sigmoid', an ungated shared expert of a multiple of "
                         "mlp_dim units, no rope_scaling but YaRN, no sliding_window, untied "
                         "embeddings")
    return {
        "architectures": [_ARCHITECTURES["deepseek_v3"]], "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_heads,
        "intermediate_size": c.dense_mlp_dim or m, "moe_intermediate_size": m,
        "n_routed_experts": c.n_experts, "n_shared_experts": shared // m,
        "num_experts_per_tok": c.top_k, "n_group": c.n_group, "topk_group": c.topk_group,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": c.moe_norm_topk,
        "routed_scaling_factor": c.routed_scaling_factor,
        "first_k_dense_replace": c.first_k_dense,
        "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": c.q_lora_rank or None,
        "qk_rope_head_dim": c.qk_rope_head_dim, "qk_nope_head_dim": c.head_dim
        - c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "head_dim": c.qk_rope_head_dim,
        "rope_interleave": c.rope_interleave, "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta, "rope_scaling": _rope_scaling_to_hf(c.rope_scaling),
        "rms_norm_eps": c.norm_eps,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(c.param_dtype),
    }


def _gpt_oss_to_hf(c: LlamaConfig) -> dict[str, Any]:
    if (c.router_score != "topk_softmax" or not c.moe_bias or c.qkv_bias != c.attn_out_bias
            or c.swiglu_limit is None or c.shared_expert_dim or c.tie_embeddings or c.qk_norm
            or c.first_k_dense or c.norm_offset or c.post_norms):
        raise ValueError("a gpt-oss config (attn_sinks with experts) needs "
                         "router_score='topk_softmax', moe_bias, swiglu_limit, qkv_bias == "
                         "attn_out_bias, and none of: a shared expert, tied embeddings, "
                         "qk_norm, dense layers, Gemma norms")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta,
            **(_rope_scaling_to_hf(c.rope_scaling) or {})}
    return {
        "architectures": [_ARCHITECTURES["gpt_oss"]], "model_type": "gpt_oss",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.mlp_dim,
        "num_local_experts": c.n_experts, "num_experts_per_tok": c.top_k,
        "router_aux_loss_coef": c.moe_aux_weight, "swiglu_limit": c.swiglu_limit,
        "swiglu_alpha": c.swiglu_alpha, "attention_bias": c.qkv_bias,
        "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": False, "rope_parameters": rope,
        "sliding_window": c.sliding_window, "layer_types": _layer_types(c),
        "torch_dtype": _dtype_name(c.param_dtype),
    }


def _gemma_to_hf(c: LlamaConfig, mt: str) -> dict[str, Any]:
    if c.embed_scale is False or not c.post_norms or c.mlp_activation != "gelu_tanh":
        raise ValueError(f"a config with norm_offset={c.norm_offset} has the form of {mt} only "
                         "with embed_scale, post_norms and mlp_activation='gelu_tanh'")
    if c.rope_scaling is not None and (mt == "gemma2" or c.rope_scaling.rope_type != "linear"):
        raise ValueError(f"{mt} export supports {'no' if mt == 'gemma2' else 'linear'} "
                         f"rope_scaling, got {c.rope_scaling}")
    qpas = c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else c.head_dim
    rope = {"rope_type": "default", "rope_theta": c.rope_theta,
            **(_rope_scaling_to_hf(c.rope_scaling) or {})}
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]], "model_type": mt,
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.mlp_dim,
        "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": _dtype_name(c.param_dtype),
        "query_pre_attn_scalar": int(qpas) if float(qpas).is_integer() else qpas,
        "attn_logit_softcapping": c.attn_softcap,
        "final_logit_softcapping": c.final_softcap,
        "sliding_window": c.sliding_window, "layer_types": _layer_types(c),
    }
    if mt == "gemma3_text":
        local = c.rope_theta if c.rope_local_theta is None else c.rope_local_theta
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}}
    else:
        out["rope_parameters"] = rope
    return out


def _rope_scaling_to_hf(s: RopeScaling | None) -> dict[str, Any] | None:
    if s is None:
        return None
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    keys = (("low_freq_factor", "high_freq_factor") if s.rope_type == "llama3" else
            ("beta_fast", "beta_slow", "truncate"))
    out = {"rope_type": s.rope_type, "factor": s.factor,
           "original_max_position_embeddings": s.original_max_position_embeddings,
           **{k: getattr(s, k) for k in keys}}
    if s.rope_type == "yarn":
        out.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim") if getattr(s, k)})
        if s.yarn_attention_factor is not None:
            out["attention_factor"] = s.yarn_attention_factor
    return out


def _layer_types(c: LlamaConfig) -> list[str]:
    return ["full_attention" if c.window_of(i) is None else "sliding_attention"
            for i in range(c.n_layers)]


def _activation_name(c: LlamaConfig) -> str:
    return {v: k for k, v in _ACTIVATIONS.items()}[c.mlp_activation]


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
