"""Exports load in transformers: `AutoModelForCausalLM.from_pretrained` on a shardax export
gives the shardax logits (1e-4 relative to the largest logit, float32). Skipped unless torch
and transformers are importable (they are not test dependencies; see
tests/reference/make_hf_fixtures.py for the reference environment)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardax import hf, models  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
REL = 1e-4


def transformers_logits(directory, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()


def perturbed(model, seed):
    """The model with every parameter moved (so the export is not the fixture's bytes)."""
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                                   state))
    return model


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_tied", "mistral", "qwen2", "gpt2"])
def test_transformers_loads_the_export(arch, tmp_path):
    tokens = np.load(FIXTURES / arch / "reference.npz")["tokens"]
    model = perturbed(hf.load_model(FIXTURES / arch), 1)
    hf.save_model(model, tmp_path, max_shard_bytes=30_000)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    theirs = transformers_logits(tmp_path, tokens)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=REL * np.abs(ours).max())


@pytest.mark.parametrize("name,overrides", [
    ("llama-tiny", dict(scan_layers=True)),
    ("llama-tiny", dict(tie_embeddings=True, rope_theta=500000.0,
                        rope_scaling=models.RopeScaling(8.0, 1.0, 4.0, 32))),
    ("gpt2-tiny", {}),
])
def test_transformers_loads_a_shardax_native_model(name, overrides, tmp_path):
    model = models.create(models.get_config(name, n_layers=2, **overrides), nnx.Rngs(0))
    hf.save_model(model, tmp_path)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    ours = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    theirs = transformers_logits(tmp_path, tokens)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=REL * np.abs(ours).max())
