"""Creates the tiny Hugging Face models and reference outputs under tests/fixtures/hf/.

Run in a separate environment with torch and transformers (never installed by `make test`):

    python3 -m venv /work/hfref
    /work/hfref/bin/pip install torch transformers safetensors numpy
    /work/hfref/bin/python tests/reference/make_hf_fixtures.py

For each architecture it builds a random-weight model with transformers (float32, CPU, fixed
seed), saves it with ``save_pretrained`` (safetensors; 'llama_gqa' sharded with an index) and
writes ``reference.npz``: ``tokens`` [2, 16], transformers' float32 ``logits`` for them, and
``greedy`` [2, 16 + 32], 32 greedy tokens after each prompt (argmax, full forward per token).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
VOCAB, PROMPT, NEW = 128, 16, 32

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

# YaRN x4 over 16 original positions (the 48-token sequences reach past them).
YARN_TINY = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0}

MODELS = {
    # GQA (4 query heads on 2 kv heads), Llama 3 theta and rope_scaling, untied; sharded save.
    "llama_gqa": (transformers.LlamaConfig, dict(
        COMMON, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "24KB"),
    # Llama 2 style: multi-head attention, tied input/output embeddings.
    "llama_tied": (transformers.LlamaConfig, dict(
        COMMON, num_key_value_heads=4, tie_word_embeddings=True), None),
    "mistral": (transformers.MistralConfig, dict(
        COMMON, num_key_value_heads=2, sliding_window=4096, tie_word_embeddings=False), None),
    "qwen2": (transformers.Qwen2Config, dict(
        COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000000.0), None),
    # Qwen3: q/k RMSNorm per head, head_dim (16) not hidden_size / heads (8).
    "qwen3": (transformers.Qwen3Config, dict(
        COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        rope_theta=1000000.0), None),
    # Gemma 2: alternating sliding (window 8 < the 48 tokens generated) / global layers,
    # attention and final logit soft-capping, GeGLU, pre+post norms, query_pre_attn_scalar.
    "gemma2": (transformers.Gemma2Config, dict(
        COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh"), None),
    # Gemma 3 text: q/k norm, local (10000) / global (1e6, linear scaling x8 as Gemma 3 4B+)
    # rope bases, sliding pattern 3.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=16, sliding_window_pattern=3, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
        rope_scaling={"rope_type": "linear", "factor": 8.0}), None),
    # Mistral whose window (8) is shorter than the sequences (16 + 32 generated).
    "mistral_window": (transformers.MistralConfig, dict(
        COMMON, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False), None),
    # Mixtral: 4 experts, top-2 (renormalised), expert MLPs of 32 units.
    "mixtral": (transformers.MixtralConfig, dict(
        COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, tie_word_embeddings=False), None),
    # Qwen2-MoE: q/k/v biases, top-2 of 4 experts (not renormalised), a gated shared expert.
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
        COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False), None),
    # Qwen3-MoE: q/k norm, head_dim 16, top-2 of 4 experts, renormalised.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False), None),
    # DeepSeek-V3: latent attention (q rank 16, kv rank 16, rope 8 interleaved, nope 8, v 8),
    # a dense layer then one of top-2 of 4 sigmoid-routed experts (a correction bias, scaled
    # weights) plus 1 shared expert; group-limited: the 4 experts in 2 groups, the top 2 taken
    # from the best group only (n_group = 2, topk_group = 1).
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        COMMON, num_key_value_heads=4, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, rope_interleave=True, tie_word_embeddings=False,
        rope_scaling=YARN_TINY | {"mscale": 1.0, "mscale_all_dim": 0.8}), None),
    # gpt-oss: alternating sliding (window 8) / full layers, attention sinks, q/k/v/o biases,
    # head_dim 8, top-2 of 4 experts (router bias, top-k logits softmaxed, expert biases) with
    # the clamped SwiGLU (limit 1.0 so that the tiny model's activations reach it), YaRN.
    "gpt_oss": (transformers.GptOssConfig, dict(
        COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=8, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
        tie_word_embeddings=False, rope_parameters=YARN_TINY | {
            "rope_theta": 150000.0, "truncate": False}), None),
    "gpt2": (transformers.GPT2Config, dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None), None),
}


def make(name: str) -> None:
    config_cls, kwargs, shard = MODELS[name]
    torch.manual_seed(0)
    config = config_cls(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():  # give norms and biases non-trivial values too
        for pname, p in model.named_parameters():
            if (pname.endswith(("bias", "sinks")) or "norm" in pname or "ln_" in pname):
                p.add_(0.1 * torch.randn_like(p))
        for bname, buf in model.named_buffers():  # DeepSeek-V3's routing bias
            if bname.endswith("e_score_correction_bias"):
                buf.add_(0.1 * torch.randn_like(buf))
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": shard}
                                                           if shard else {}))
    (out / "generation_config.json").unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, PROMPT)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits.float().numpy()
        seq = torch.from_numpy(tokens)
        for _ in range(NEW):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    np.savez_compressed(out / "reference.npz", tokens=tokens.astype(np.int32),
                        logits=logits.astype(np.float32), greedy=seq.numpy().astype(np.int32))
    files = sorted(p.name for p in out.iterdir())
    print(name, files, json.loads((out / "config.json").read_text())["architectures"])


# YaRN RoPE: (config class, kwargs) whose _compute_yarn_parameters yarn_rope.npz holds.
YARN = {
    "gpt_oss": (transformers.GptOssConfig, dict(head_dim=64, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(qk_rope_head_dim=64, rope_parameters={
        "rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0})),
    "tiny_truncate": (transformers.LlamaConfig, dict(hidden_size=32, num_attention_heads=4,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 16,
                                       "rope_theta": 10000.0})),
}


def make_yarn() -> None:
    """yarn_rope.npz: each case's inverse frequencies, attention factor and head_dim."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    arrays = {}
    for name, (config_cls, kwargs) in YARN.items():
        inv, factor = _compute_yarn_parameters(config_cls(**kwargs))
        arrays.update({f"{name}_inv_freq": inv.numpy().astype(np.float32),
                       f"{name}_attention_factor": np.float64(factor),
                       f"{name}_head_dim": np.int64(2 * inv.shape[0])})
    np.savez(OUT / "yarn_rope.npz", **arrays)


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", transformers.__version__)
    for name in sys.argv[1:] or [*MODELS, "yarn"]:
        make_yarn() if name == "yarn" else make(name)
