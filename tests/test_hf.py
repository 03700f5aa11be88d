"""Hugging Face import/export (`shardax.hf`) and KV-cache generation against transformers.

The fixtures under tests/fixtures/hf/ were made by transformers (tests/reference/
make_hf_fixtures.py, run outside this environment): tiny random-weight Llama (GQA +
Llama-3 rope_scaling, saved sharded with an index), tied-embedding Llama, Mistral, Qwen2,
GPT-2, Qwen3 (q/k norm, head_dim 16 != hidden/heads), Gemma 2 (alternating window-8/global
layers, soft-capping, GeGLU, pre+post norms), Gemma 3 text (q/k norm, local/global RoPE bases,
sliding pattern 3), Mistral with an 8-token window (shorter than the 16-token prompts and the
48 tokens generated), and the mixtures of experts Mixtral, Qwen2-MoE (shared expert, top-k not
renormalised), Qwen3-MoE (4 experts, top 2; shardax's dropless MoE), DeepSeek-V3 (latent
attention, a first dense layer, sigmoid routing with a correction bias limited to the best of
2 expert groups, a shared expert, YaRN with mscale_all_dim) and gpt-oss (attention sinks,
alternating window-8/full layers, q/k/v/o biases, biased experts with the clamped SwiGLU,
YaRN), with transformers' float32 logits for fixed tokens and 32 greedy tokens per prompt.
Tolerance: logits within 1e-4 relative to the largest reference logit (float32; seen <= 1.1e-6);
greedy tokens, import -> export -> import and exported bytes: exact.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import multiprocess_env, run_cli
from flax import nnx
from safetensors import safe_open

from shardax import hf, models
from shardax.hf.files import SafetensorsFile, tensor_index
from shardax.layout import Layout, forward
from shardax.logical import use_logical_rules
from shardax.models import decode
from shardax.sharding import MeshShardingHelper
from shardax.utils import flatten_tree

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DENSE = ["llama_gqa", "llama_tied", "mistral", "qwen2", "gpt2", "qwen3", "gemma2", "gemma3",
         "mistral_window"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
ARCHS = DENSE + MOE
# Mixed sliding/global (or dense/MoE) layers cannot be stacked (scan_layers): they load as a
# list of layers.
LISTED = ("gpt2", "gemma2", "gemma3", "deepseek_v3", "gpt_oss")
REL = 1e-4


def reference(arch):
    return np.load(FIXTURES / arch / "reference.npz")


def logits_of(model, tokens, mesh=None, rules=None, lay=None):
    """The model's logits (under ``lay``, a `shardax.layout.Layout`, when given)."""
    fn = jax.jit(lambda m, t: m(t) if lay is None else forward.logits(m, lay, t))
    if mesh is None:
        return np.asarray(fn(model, jnp.asarray(tokens)))
    with jax.set_mesh(mesh.mesh), use_logical_rules(rules):
        return np.asarray(fn(model, jnp.asarray(tokens)))


def assert_logits_close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=REL * np.abs(want).max())


def params(model):
    """The parameters and routing biases of ``model``, by '/'-joined path."""
    state = nnx.state(model, hf.export.EXPORTED)
    return {k: np.asarray(v) for k, v in flatten_tree(state, sep="/").items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_on_one_device(arch):
    ref = reference(arch)
    model = hf.load_model(FIXTURES / arch)
    assert_logits_close(logits_of(model, ref["tokens"]), ref["logits"])


@pytest.mark.parametrize("arch", DENSE)
def test_logits_match_transformers_on_fsdp4_tp2(arch):
    """Loaded straight into fsdp=4,tp=2 (stacked layers for the llamas): every parameter has
    the layout the rules ask for, and the sharded forward gives transformers' logits."""
    ref = reference(arch)
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / arch)
    rules = hf.default_rules(config, mesh.mesh)
    graphdef, state = hf.load_params(FIXTURES / arch, config, mesh, rules)
    want = mesh.match_sharding_rule(rules, state)
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
    embed = "wte" if arch == "gpt2" else "embed"
    table = getattr(state, embed)[...]
    assert table.addressable_shards[0].data.size * 8 == table.size  # vocab/tp x embed/fsdp
    model = nnx.merge(graphdef, state)
    assert_logits_close(logits_of(model, ref["tokens"], mesh, rules), ref["logits"])


NEW_ARCHS = ["qwen3", "gemma2", "gemma3", "mistral_window"]


@pytest.mark.parametrize("arch", MOE)
def test_moe_logits_and_greedy_tokens_on_ep2_fsdp2_tp2_equal_transformers(arch):
    """Stacked layers (listed for DeepSeek-V3's dense first layer) loaded into ep=2,fsdp=2,tp=2:
    every expert weight [layers, experts, ...] is split over 'ep' (and fsdp/tp), and the logits
    and KV-cache greedy tokens are transformers'."""
    ref = reference(arch)
    mesh = MeshShardingHelper.from_string("ep=2,fsdp=2,tp=2")
    config = hf.load_config(FIXTURES / arch)
    rules = hf.default_rules(config, mesh.mesh)
    stacked = arch not in LISTED
    graphdef, state = hf.load_params(FIXTURES / arch, config, mesh, rules)
    last = state["layers"] if stacked else state["layers"][config.n_layers - 1]  # MoE layer
    mlp, axis = last["mlp"], int(stacked)
    for name in ("w_gate", "w_up", "w_down"):
        w = mlp[name][...]
        assert w.sharding.spec[axis] == "ep" and w.addressable_shards[0].data.shape[axis] == 2, name
    model = nnx.merge(graphdef, state)
    assert_logits_close(logits_of(model, ref["tokens"], mesh, rules), ref["logits"])
    out = decode.generate(model, ref["tokens"].tolist(), 32, mesh=mesh, rules=rules)
    np.testing.assert_array_equal(np.array(out.tokens), ref["greedy"][:, ref["tokens"].shape[1]:])


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_greedy_tokens_on_fsdp4_tp2_equal_transformers(arch):
    """The 32 greedy tokens decoded with the KV cache on fsdp=4,tp=2 (sliding windows of 8
    shorter than the 48-token sequences) are transformers' tokens."""
    ref = reference(arch)
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / arch)
    rules = hf.default_rules(config, mesh.mesh)
    model = nnx.merge(*hf.load_params(FIXTURES / arch, config, mesh, rules))
    out = decode.generate(model, ref["tokens"].tolist(), 32, mesh=mesh, rules=rules)
    np.testing.assert_array_equal(np.array(out.tokens), ref["greedy"][:, ref["tokens"].shape[1]:])


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_qk_norm_under_megatron_tensor_parallelism(arch):
    """tp_mode='sync' norms q and k per head inside the fused column-parallel QKV."""
    ref = reference(arch)
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / arch)
    rules = hf.default_rules(config, mesh.mesh)
    model = nnx.merge(*hf.load_params(FIXTURES / arch, config, mesh, rules))
    assert_logits_close(logits_of(model, ref["tokens"], mesh, rules, Layout(tp_mode="sync")),
                        ref["logits"])


def test_mixed_layers_stay_a_list_refuse_a_pipeline_and_export_keeps_the_layer_pattern():
    """Gemma 2's layers differ: they stay a list, which loops whatever ``scan_layers`` says,
    and a 'pp' axis (one stack split into stages) is refused naming why."""
    from shardax.layout.spec import check_mesh

    model = hf.load_model(FIXTURES / "gemma2")
    assert not model.stacked and isinstance(model.layers, nnx.List)  # its layers differ
    check_mesh(model.config, Layout(scan_layers=True), {"fsdp": 8}, batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match="global_every=2 mixes sliding-window and global"):
        check_mesh(model.config, Layout(), {"pp": 2, "fsdp": 4}, batch_size=8, seq_len=16)
    config = hf.load_config(FIXTURES / "gemma3")
    assert [config.window_of(i) for i in range(3)] == [8, 8, None]
    out = hf.config_to_hf(config)
    src = json.loads((FIXTURES / "gemma3" / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "query_pre_attn_scalar", "sliding_window"):
        assert out[key] == src[key], key


def test_deepseek_layers_refuse_a_pipeline_and_megatron_tp():
    """DeepSeek-V3's dense first layer keeps its layers listed, which a 'pp' axis cannot split
    into stages; Megatron tp_mode (fused QKV) has no latent-attention form: both refused naming
    why."""
    from shardax.layout.spec import check_mesh

    config = hf.load_config(FIXTURES / "deepseek_v3")
    with pytest.raises(ValueError, match="first_k_dense=1 dense layers precede the experts"):
        check_mesh(config, Layout(), {"pp": 2, "fsdp": 4}, batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match="tp_mode='sync' does not run multi-head latent"):
        check_mesh(config, Layout(tp_mode="sync"), {"fsdp": 4, "tp": 2}, batch_size=8,
                   seq_len=16)


def test_gpt_oss_sinks_refuse_megatron_tp_and_ring_attention():
    """Attention sinks run under the rules' tp/fsdp/ep (above), not under Megatron tp_mode
    or ring attention over 'cp': both refused naming why, before anything is built."""
    from shardax.layout.spec import check_mesh

    config = hf.load_config(FIXTURES / "gpt_oss")
    with pytest.raises(ValueError, match="tp_mode='sync' does not run gpt-oss attention"):
        check_mesh(config, Layout(tp_mode="sync"), {"fsdp": 4, "tp": 2}, batch_size=8,
                   seq_len=16)
    with pytest.raises(ValueError, match=r"attention sinks \(gpt-oss\) have no ring"):
        check_mesh(config, Layout(), {"fsdp": 4, "cp": 2}, batch_size=8, seq_len=16)


@pytest.mark.parametrize("mesh_spec", ["fsdp=4,tp=2", "tp=8"])
def test_qwen2_biases_under_megatron_tensor_parallelism(mesh_spec):
    """tp_mode='sync' adds the q/k/v biases inside the fused column-parallel QKV, also when
    'tp' (8) exceeds the 4 heads and they are repeated."""
    ref = reference("qwen2")
    mesh = MeshShardingHelper.from_string(mesh_spec)
    config = hf.load_config(FIXTURES / "qwen2")
    rules = hf.default_rules(config, mesh.mesh)
    model = nnx.merge(*hf.load_params(FIXTURES / "qwen2", config, mesh, rules))
    assert_logits_close(logits_of(model, ref["tokens"], mesh, rules, Layout(tp_mode="sync")),
                        ref["logits"])


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_counts_the_loaded_parameters(arch):
    config = hf.load_config(FIXTURES / arch)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(hf.load_model(FIXTURES / arch),
                                                      nnx.Param)))
    assert models.param_count(config) == n


# The MoE families' and NEW_ARCHS' KV-cache greedy tokens are checked against transformers'
# on a mesh (above: the same model and decoding code, with the experts routed alike on a mesh
# and without); one device for the others.
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in (*MOE, *NEW_ARCHS)])
def test_kv_cache_greedy_tokens_equal_transformers(arch):
    ref = reference(arch)
    model = hf.load_model(FIXTURES / arch)
    prompts = ref["tokens"].tolist()
    out = decode.generate(model, prompts, 32)
    np.testing.assert_array_equal(np.array(out.tokens), ref["greedy"][:, len(prompts[0]):])


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt2"])
def test_kv_cache_equals_full_recompute_sharded_with_ragged_prompts(arch):
    """Prompts of lengths 16, 5, 9, 1 on fsdp=4,tp=2: cached decoding gives the tokens of the
    full recompute, and each row the tokens it gets alone on one device (sampled)."""
    ref = reference(arch)
    full = ref["tokens"].tolist()
    prompts = [full[0], full[1][:5], full[0][3:12], full[1][:1]]
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / arch)
    rules = hf.default_rules(config, mesh.mesh)
    model = nnx.merge(*hf.load_params(FIXTURES / arch, config, mesh, rules))
    with jax.set_mesh(mesh.mesh), use_logical_rules(rules):  # split like the activations
        cache = jax.jit(lambda: decode.init_cache(model, 4, 32))()
    want = jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec(
        None, "fsdp", None, "tp", None))
    assert cache.k.sharding.is_equivalent_to(want, 5), cache.k.sharding
    kw = dict(temperature=0.7, seed=3, mesh=mesh, rules=rules)
    cached = decode.generate(model, prompts, 12, **kw)
    recomputed = decode.generate(model, prompts, 12, use_cache=False, **kw)
    assert cached.tokens == recomputed.tokens
    greedy = decode.generate(model, prompts, 12, mesh=mesh, rules=rules).tokens
    single = hf.load_model(FIXTURES / arch)
    for prompt, row in zip(prompts, greedy):
        assert decode.generate(single, [prompt], 12).tokens[0] == row
    # A batch the mesh does not divide (two prompts, the batch split 4 ways): padded to four
    # rows inside, two rows out, each with the tokens it gets alone on one device.
    assert decode.generate(model, prompts[1:3], 12, mesh=mesh, rules=rules).tokens == greedy[1:3]


@pytest.mark.parametrize("arch", ARCHS)
def test_import_export_import_is_bit_identical(arch, tmp_path):
    """Export in small files (sharded, with an index): the tensors are byte-for-byte the ones
    transformers saved, config.json reloads to the same config, and re-import is exact."""
    src = FIXTURES / arch
    model = hf.load_model(src)
    written = hf.save_model(model, tmp_path, max_shard_bytes=20_000)
    assert len(written) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    assert all(os.path.getsize(p) <= 20_000 + 4096 or len(SafetensorsFile(p).tensors) == 1
               for p in written)
    theirs, ours = tensor_index(src), tensor_index(tmp_path)
    tied = getattr(hf.load_config(src), "tie_embeddings", True)  # GPT-2 always ties
    expected = {n for n in theirs if not (n == "lm_head.weight" and tied)}
    assert set(ours) == expected
    for name in ours:
        a, b = theirs[name].read(name), ours[name].read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == json.loads((src / "config.json").read_text())[
        "architectures"] or arch == "mistral"  # Mistral exports as LlamaForCausalLM
    assert hf.load_config(tmp_path) == hf.load_config(src)
    again = params(hf.load_model(tmp_path))
    for k, v in params(model).items():
        assert v.tobytes() == again[k].tobytes(), k


def test_lora_on_deepseek_latent_attention_exports_peft_factors(tmp_path):
    """LoRA's default targets reach MLA's low-rank projections, and the PEFT adapter holds
    each projection's [rank, in] / [out, rank] factors (q_b and kv_b read the latent)."""
    import dataclasses

    from shardax.hf.peft import save_adapters
    from shardax.models.lora import LoRA, add_lora

    model = hf.load_model(FIXTURES / "deepseek_v3")
    model.config = dataclasses.replace(model.config, lora=LoRA(rank=4))
    paths = add_lora(model, LoRA(rank=4), nnx.Rngs(1))
    assert {f"layers/1/attn/{w}" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} <= set(paths)
    a = tensor_index(save_adapters(model, tmp_path).parent)
    name = "base_model.model.model.layers.1.self_attn.{}_proj{}.lora_{}.weight"
    want = {("q_a", "", "A"): (4, 32), ("q_b", "", "A"): (4, 16), ("q_b", "", "B"): (64, 4),
            ("kv_a", "_with_mqa", "B"): (24, 4), ("kv_b", "", "A"): (4, 16),
            ("kv_b", "", "B"): (64, 4)}
    assert {k: a[name.format(*k)].shape(name.format(*k)) for k in want} == want


REFERENCE_PYTHON = os.environ.get("SHARDAX_HF_REFERENCE_PYTHON")


@pytest.mark.skipif(not REFERENCE_PYTHON, reason="needs SHARDAX_HF_REFERENCE_PYTHON: a python "
                    "with torch and transformers (tests/reference/make_hf_fixtures.py)")
def test_exports_load_in_transformers_with_the_reference_outputs(tmp_path):
    """Every fixture, imported and exported by shardax, loads with transformers'
    AutoModelForCausalLM and gives the reference logits and greedy tokens."""
    args = []
    for arch in ARCHS:
        hf.save_model(hf.load_model(FIXTURES / arch), tmp_path / arch)
        args += [str(FIXTURES / arch), str(tmp_path / arch)]
    script = Path(__file__).parent / "reference" / "check_hf_exports.py"
    proc = subprocess.run([REFERENCE_PYTHON, str(script), *args], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok") == len(ARCHS), proc.stdout


def test_stacked_layers_round_trip_through_a_single_file(tmp_path):
    """A shardax-native model (stacked layers, sharded on fsdp=8) exports to one
    model.safetensors (a tensor per layer) and re-imports bit-identically."""
    mesh = MeshShardingHelper.from_string("fsdp=8")
    cfg = models.get_config("llama-tiny", n_layers=2, qkv_bias=True)
    model = models.create(cfg, nnx.Rngs(1))
    state = jax.device_put(nnx.state(model, nnx.Param),
                           jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec()))
    nnx.update(model, state)
    hf.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert "model.layers.1.self_attn.q_proj.bias" in f.keys()
    back = hf.load_model(tmp_path)
    assert back.stacked and back.config.qkv_bias
    ours, theirs = params(model), params(back)
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert v.tobytes() == theirs[k].tobytes(), k


def test_sharded_load_reads_each_device_slice_once_and_nothing_else():
    """fsdp=4,tp=2 in one process: the read log holds one read per distinct device slice of
    each tensor, each exactly that slice, and the bytes read equal the model's bytes."""
    arch = "llama_gqa"
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / arch)
    log = hf.ReadLog()
    graphdef, state = hf.load_params(FIXTURES / arch, config, mesh, read_log=log)
    leaves = jax.tree.leaves(state)
    reads = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        slices = {tuple(sl.indices(n)[:2] for sl, n in zip(s.index, x.shape))
                  for s in x.addressable_shards}
        # a stacked layer parameter's slice is one read per layer it spans
        stacked = "layers" in jax.tree_util.keystr(path[:1])
        reads += sum(s[0][1] - s[0][0] if stacked else 1 for s in slices)
    assert len(log.reads) == reads
    assert log.nbytes == sum(x.nbytes for x in leaves)
    embed = [r for r in log.reads if r[1] == "model.embed_tokens.weight"]
    assert sorted(r[2] for r in embed) == sorted(
        ((v0, v0 + 64), (e0, e0 + 8)) for v0 in (0, 64) for e0 in (0, 8, 16, 24))


MULTI = r"""
import sys
import jax
from shardax import distributed, hf
from shardax.sharding import MeshShardingHelper
distributed.initialize()
d, out = sys.argv[1], sys.argv[2]
mesh = MeshShardingHelper.from_string("fsdp=8")
log = hf.ReadLog()
config = hf.load_config(d)
graphdef, state = hf.load_params(d, config, mesh, read_log=log)
local = 0  # bytes of this process's distinct device slices
for x in jax.tree.leaves(state):
    seen = {}
    for s in x.addressable_shards:
        seen[tuple(sl.indices(n)[:2] for sl, n in zip(s.index, x.shape))] = s.data.nbytes
    local += sum(seen.values())
total = sum(x.nbytes for x in jax.tree.leaves(state))
print(f"process {jax.process_index()}: read {log.nbytes} of {total} bytes, local {local}")
hf.save_params(config, state, out, max_shard_bytes=20_000)
"""


@pytest.mark.multiprocess
def test_two_processes_read_only_their_slices_and_export_together(tmp_path):
    """Two processes x 4 devices, fsdp=8: each reads exactly its devices' distinct slices
    (about half the model: the replicated norms are read by both), and together they export
    byte-identical files to what one process writes."""
    script = tmp_path / "load.py"
    script.write_text(MULTI)
    out = tmp_path / "export"
    proc = run_cli("launch", "--nproc", "2", "--devices-per-proc", "4", "--", sys.executable,
                   script, FIXTURES / "llama_gqa", out, env=multiprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for p in (0, 1):
        line = next(x for x in proc.stdout.splitlines() if f"process {p}: read" in x)
        read, total, local = (int(w) for w in line.split() if w.isdigit())
        assert read == local and read <= 0.55 * total, line
    single = tmp_path / "single"
    hf.save_model(hf.load_model(FIXTURES / "llama_gqa"), single, max_shard_bytes=20_000)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single.iterdir())
    for f in single.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_unknown_architecture_and_bad_shapes_name_the_problem(tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert",
                                                  "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="unsupported Hugging Face model_type 'bert'"):
        hf.load_model(bert)
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "qwen2", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight'"
                                         r".* has shape"):
        hf.load_model(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"'model\.layers\.2\..*' is missing"):
        hf.load_model(bad)
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_model(tmp_path)


@pytest.mark.parametrize("case,theta,rope", [
    ("gpt_oss", 150000.0, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False,
                           "original_max_position_embeddings": 4096}),
    ("deepseek_v3", 10000.0, {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 4096}),
    ("tiny_truncate", 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 16}),
])
def test_yarn_rope_tables_equal_transformers(case, theta, rope):
    """YaRN frequencies and attention factor read from a config dict equal transformers'
    ``_compute_yarn_parameters`` (saved in yarn_rope.npz; its float32 ``base ** x`` may differ
    by one ulp), and the scaling survives export -> import."""
    ref = np.load(FIXTURES / "yarn_rope.npz")
    hd = int(ref[f"{case}_head_dim"])
    config = hf.config_from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 4 * hd,
                                "num_hidden_layers": 1, "num_attention_heads": 4,
                                "intermediate_size": 8, "max_position_embeddings": 64,
                                "rope_theta": theta, "rope_scaling": rope})
    s = config.rope_scaling
    np.testing.assert_allclose(models.ops.rope_frequencies(hd, theta, s),
                               ref[f"{case}_inv_freq"], rtol=2e-7, atol=0)
    assert s.attention_factor == pytest.approx(float(ref[f"{case}_attention_factor"]), rel=1e-12)
    cos, _ = models.ops.rope_tables(jnp.zeros((1, 1), jnp.int32), hd, theta, s)
    np.testing.assert_allclose(cos, s.attention_factor, rtol=1e-7)
    assert hf.config_from_hf(hf.config_to_hf(config)).rope_scaling == s


def test_lora_on_gpt_oss_attention_exports_peft_factors(tmp_path):
    """LoRA's default targets reach gpt-oss's q/k/v/o projections (their biases, the sinks and
    the experts stay frozen, as for the other mixtures of experts), and the PEFT adapter holds
    [rank, in] / [out, rank] factors under the projections' Hugging Face names."""
    import dataclasses

    from shardax.hf.peft import save_adapters
    from shardax.models.lora import LoRA, add_lora

    model = hf.load_model(FIXTURES / "gpt_oss")
    model.config = dataclasses.replace(model.config, lora=LoRA(rank=4))
    paths = add_lora(model, LoRA(rank=4), nnx.Rngs(1))
    assert set(paths) == {f"layers/{i}/attn/w{w}" for i in range(4) for w in "qkvo"}
    a = tensor_index(save_adapters(model, tmp_path).parent)
    name = "base_model.model.model.layers.3.self_attn.{}_proj.lora_{}.weight"
    want = {("q", "A"): (4, 32), ("q", "B"): (32, 4), ("k", "B"): (16, 4), ("o", "A"): (4, 32),
            ("o", "B"): (32, 4)}
    assert {k: a[name.format(*k)].shape(name.format(*k)) for k in want} == want


def test_an_mxfp4_gpt_oss_checkpoint_is_refused_in_one_line(tmp_path):
    """openai's gpt-oss checkpoints hold MXFP4 experts (``quantization_config``): `shardax
    train --init-from` refuses them in one line saying how to dequantize, writing nothing."""
    from _cli import assert_one_line_error

    src = json.loads((FIXTURES / "gpt_oss" / "config.json").read_text())
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(
        {**src, "quantization_config": {"quant_method": "mxfp4"}}))
    proc = run_cli("train", "--init-from", f"hf:{tmp_path / 'ckpt'}", "--steps", "1",
                   "--out", tmp_path / "run")
    assert_one_line_error(proc, "train", "quantization_config", "mxfp4", "dequantize")
    assert not (tmp_path / "run").exists()
