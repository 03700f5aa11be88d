"""Checks that shardax's Hugging Face exports load in transformers, in an environment with torch.

    make check-transformers                       # a separate .venv-transformers, then this
    python benchmarks/hf_transformers.py          # where shardax[train,hf], torch, transformers are

`AutoModelForCausalLM.from_pretrained` on a shardax export must give the shardax logits (within
1e-4 of the largest logit, float32): for each tiny model under tests/fixtures/hf/ (made by
transformers, every parameter moved so the export is not the fixture's bytes) and for three
shardax-native models. Prints one line per case and exits 1 if any differs.

Not part of `make test`: torch from PyPI on Linux pulls its CUDA libraries (about 2.9 GB
downloaded, 4 GB installed, for a CPU-only check), which does not fit the suite's 15-minute
budget on a fresh machine. The rest of the Hugging Face support is tested against the
transformers-made fixtures without torch (tests/test_hf.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402  (this script's own environment; see the docstring)
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import hf, models  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
REL = 1e-4
ARCHES = ["llama_gqa", "llama_tied", "mistral", "qwen2", "gpt2", "qwen3", "gemma2", "gemma3",
          "mistral_window", "mixtral", "qwen2_moe", "qwen3_moe"]
NATIVE = [
    ("llama-tiny", dict(tie_embeddings=True, rope_theta=500000.0,
                        rope_scaling=models.RopeScaling(8.0, 1.0, 4.0, 32))),
    ("gpt2-tiny", {}),
    ("llama-tiny", dict(qk_norm=True, head_dim_override=32)),  # Qwen3
    ("llama-tiny", dict(norm_offset=1.0, post_norms=True, mlp_activation="gelu_tanh",  # Gemma 3
                        embed_scale=True, qk_norm=True, sliding_window=8, global_every=2,
                        rope_local_theta=10000.0, rope_theta=1e6, query_pre_attn_scalar=16.0)),
    ("llama-tiny", dict(n_experts=4, top_k=2, moe_impl="dropless")),  # Mixtral
]


def transformers_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()


def shardax_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


def perturbed(model, seed: int):
    """The model with every parameter moved (so the export is not the fixture's bytes)."""
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                                   state))
    return model


def check(name: str, model, tokens: np.ndarray, **save_options) -> bool:
    """Exports ``model``, loads it in transformers and compares the logits; prints one line."""
    with tempfile.TemporaryDirectory() as out:
        hf.save_model(model, out, **save_options)
        ours = shardax_logits(model, tokens)
        theirs = transformers_logits(Path(out), tokens)
    error = float(np.max(np.abs(theirs - ours)))
    bound = REL * float(np.abs(ours).max())
    ok = theirs.shape == ours.shape and error <= bound
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |transformers - shardax| = {error:.3g} "
          f"(bound {bound:.3g})")
    return ok


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    results = []
    for arch in ARCHES:
        tokens = np.load(FIXTURES / arch / "reference.npz")["tokens"]
        model = perturbed(hf.load_model(FIXTURES / arch), 1)
        results.append(check(f"export of {arch}", model, tokens, max_shard_bytes=30_000))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    for name, overrides in NATIVE:
        model = models.create(models.get_config(name, n_layers=2, **overrides), nnx.Rngs(0))
        results.append(check(f"native {name} {sorted(overrides)}", model, tokens))
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
