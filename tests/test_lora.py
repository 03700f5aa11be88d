"""LoRA: step-0 logits equal the base model's; merged weights give the adapter-applied logits;
only the adapters train (the optimizer state is adapter-sized, the base stays bit-identical);
a sharded LoRA step equals the one-device step; the PEFT export equals the committed adapter
fixture, whose logits under ``peft`` (tests/reference/make_lora_fixtures.py) equal shardax's;
``shardax train --lora-rank`` resumes on another mesh and exports merged weights or a PEFT
directory.

``python tests/test_lora.py`` rewrites the adapter fixture (tests/fixtures/lora/adapter).
"""

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cli import run_cli
from flax import nnx

from shardax import hf, layout, models
from shardax.hf.files import SafetensorsFile
from shardax.hf.peft import save_adapters
from shardax.mesh import MeshShardingHelper
from shardax.models.lora import LoRA, add_lora, lora_weights, merge_lora
from shardax.rules import LogicalAxisRules
from shardax.train import build
from shardax.train.config import TrainConfig, check
from shardax.train.resolve import resolve
from shardax.train.step import init_state, train_step

HERE = Path(__file__).parent
LLAMA = HERE / "fixtures" / "hf" / "llama_gqa"
FIXTURE = HERE / "fixtures" / "lora"
SETTINGS = LoRA(rank=4, alpha=8.0)
TINY = dataclasses.replace(models.CONFIGS["llama-tiny"], max_seq_len=16)

# The optimizer state is the last gradient and the parameters stay: gradients as computed.
_KEEP_GRADS = optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _perturb(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """Gives every ``lora_b`` of a layer stack (zeros at creation) fixed random values, so the
    adapters act: layer ``l``'s ``j``-th of ``J`` adapters from key ``seed + l * J + j``, the
    numbers the PEFT fixture was written with (when the layers were kept in a list)."""
    weights = list(lora_weights(model).values())
    for j, w in enumerate(weights):
        n, *shape = w.lora_b.shape
        w.lora_b[...] = jnp.stack([
            0.05 * jax.random.normal(jax.random.key(seed + layer * len(weights) + j), shape)
            for layer in range(n)])
    return model


def adapted_model() -> nnx.Module:
    """tests/fixtures/hf/llama_gqa with rank-4 adapters on the default targets, acting."""
    model = hf.load_model(LLAMA)
    model.config = dataclasses.replace(model.config, lora=SETTINGS)
    add_lora(model, SETTINGS, nnx.Rngs(1))
    return _perturb(model)


def _tokens() -> jnp.ndarray:
    return jnp.asarray(np.load(LLAMA / "reference.npz")["tokens"])


@pytest.mark.parametrize("stacked", [True, False])
def test_step0_logits_equal_the_base_model(stacked):
    # layers that differ (sliding-window and global ones) are kept in a list
    base = TINY if stacked else dataclasses.replace(TINY, sliding_window=4, global_every=2)
    plain = models.create(base, nnx.Rngs(0))
    adapted = models.create(dataclasses.replace(base, lora=SETTINGS), nnx.Rngs(0))
    assert adapted.stacked == stacked
    assert len(lora_weights(adapted)) == (7 if stacked else 7 * base.n_layers)
    tokens = jnp.arange(32).reshape(2, 16) % base.vocab_size
    np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(plain(tokens)))


def test_merged_weights_give_the_adapter_logits():
    model = adapted_model()
    tokens = _tokens()
    with_adapters = np.asarray(model(tokens))
    base = np.asarray(hf.load_model(LLAMA)(tokens))
    assert np.abs(with_adapters - base).max() > 1e-2  # the adapters act
    merge_lora(model)
    assert not lora_weights(model)
    def paths(m):
        return {path for path, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}

    assert paths(model) == paths(hf.load_model(LLAMA))
    np.testing.assert_allclose(np.asarray(model(tokens)), with_adapters, rtol=1e-5, atol=1e-5)


def test_targets_and_settings_are_checked():
    with pytest.raises(ValueError, match="match no weight"):
        add_lora(models.create(TINY, nnx.Rngs(0)), LoRA(2, targets="nothing$"), nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRA(0)
    model = models.create(TINY, nnx.Rngs(0))
    add_lora(model, LoRA(2, targets=r"attn/wq$"), nnx.Rngs(0))
    assert sorted(lora_weights(model)) == ["layers/attn/wq"]  # one adapter for the stack
    moe = models.create(dataclasses.replace(models.CONFIGS["llama-moe-tiny"], lora=SETTINGS),
                        nnx.Rngs(0))
    adapted = lora_weights(moe)
    assert adapted and all("/attn/" in path for path in adapted)  # expert weights stay frozen


def test_only_adapters_train_and_hold_optimizer_state():
    config = dataclasses.replace(TINY, lora=SETTINGS)
    graphdef, state = init_state(lambda: models.create(config, nnx.Rngs(0)), optax.adamw(1e-3))
    params = jax.tree.leaves(state.params)
    assert params and all(p.ndim >= 2 for p in params)
    flat = nnx.to_flat_state(state.params)
    assert flat and all(path[-1] in ("lora_a", "lora_b") for path, _ in flat)
    adapter_bytes = sum(x.nbytes for x in params)
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64  # adam's mu, nu (+ count)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(state.rest))
    assert base_bytes > 10 * adapter_bytes


def test_plan_shows_adapter_sized_optimizer_state():
    """What `shardax train` / `shardax plan` compile: per device, Adam's state is twice the
    adapters and the frozen base is an input without optimizer state."""
    run = resolve(check(TrainConfig(lora_rank=4, batch_size=8, seq_len=32, mesh="fsdp=8")))
    graphdef, shape = build.abstract(run.model_config, run.tx, 0, run.mesh)
    batch = (jax.ShapeDtypeStruct((8, 32), jnp.int32),) * 2
    rows = [r for r in build.step_function(run, graphdef, end_id=0).plan(shape, batch).rows
            if r.kind == "input"]

    def total(part):
        return sum(r.bytes_per_device for r in rows if r.path.startswith(f"state/{part}/"))

    assert 0 < total("params") < total("rest")
    assert 2 * total("params") <= total("opt_state") <= 2 * total("params") + 64
    assert not [r for r in rows if r.path.startswith("state/opt_state/")
                and "lora_" not in r.path and r.shape]


@pytest.fixture(scope="module")
def lora_state():
    config = dataclasses.replace(TINY, lora=SETTINGS)
    graphdef, state = init_state(lambda: _perturb(models.create(config, nnx.Rngs(0))),
                                 _KEEP_GRADS)
    rng = np.random.default_rng(0)
    rows = rng.integers(1, config.vocab_size, (8, 17))
    batch = (jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]))
    step = jax.jit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS))
    new, metrics = step(state, batch)
    return config, graphdef, state, batch, new, float(metrics["loss"])


def test_lora_step_keeps_the_base_bit_identical(lora_state):
    _, _, state, _, new, _ = lora_state
    for a, b in zip(jax.tree.leaves(state.rest), jax.tree.leaves(new.rest), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for g in jax.tree.leaves(new.opt_state):  # every adapter gets a gradient
        assert float(jnp.abs(g).max()) > 0


def test_lora_step_with_stacked_layers(lora_state):
    """Scanned (stacked) layers under jit and grad: the frozen base passes nnx.scan."""
    config, _, _, batch, _, _ = lora_state
    graphdef, state = init_state(lambda: models.create(config, nnx.Rngs(0)),
                                 _KEEP_GRADS)
    plain_graphdef, plain = init_state(lambda: models.create(
        dataclasses.replace(config, lora=None), nnx.Rngs(0)), _KEEP_GRADS)
    new, metrics = jax.jit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS))(state, batch)
    _, want = jax.jit(partial(train_step, graphdef=plain_graphdef, tx=_KEEP_GRADS))(plain, batch)
    assert float(metrics["loss"]) == float(want["loss"])  # B = 0: the base model, exactly
    assert float(jnp.abs(new.opt_state["layers"]["attn"]["wq"]["lora_b"][...]).max()) > 0


def test_lora_step_sharded_equals_one_device(lora_state):
    config, graphdef, state, batch, want, loss = lora_state
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp_tp"], mesh.shape, heads=config.n_heads, kv_heads=config.n_kv_heads))
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, param_rules=rules),
                     in_shardings=(rules, rules.spec_for(("batch", "length"), mesh.mesh)),
                     out_shardings=(rules, None))
    got, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want.opt_state),
                    strict=True):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * scale)


def _read(path: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    return {name: f.read(name) for name in f.tensors}


def test_peft_export_equals_the_fixture_and_peft_logits(tmp_path):
    model = adapted_model()
    save_adapters(model, tmp_path, base_model="tests/fixtures/hf/llama_gqa")
    assert (json.loads((tmp_path / "adapter_config.json").read_text())
            == json.loads((FIXTURE / "adapter" / "adapter_config.json").read_text()))
    got = _read(tmp_path / "adapter_model.safetensors")
    want = _read(FIXTURE / "adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight" in got
    for name in want:  # the fixture was written on one device: random bits agree to rounding
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # peft.PeftModel.from_pretrained(llama_gqa, adapter) gave these logits (reference env).
    ref = np.load(FIXTURE / "peft_logits.npz")
    logits = np.asarray(model(jnp.asarray(ref["tokens"])))
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-4 * scale)


def test_cli_lora_resumes_on_another_mesh_and_exports(tmp_path):
    pytest.importorskip("jinja2")  # the chat data: extra "hf"
    out = tmp_path / "run"
    common = ["--init-from", f"hf:{LLAMA}", "--tokenizer", str(HERE / "fixtures/chat/llama3"),
              "--data", str(HERE / "fixtures/chat/chat.jsonl"), "--seq-len", "32",
              "--batch-size", "8", "--lora-rank", "4", "--lora-alpha", "8", "--out", str(out),
              "--optimizer", "sgd", "--lr", "0.5", "--ckpt-every", "1", "--eval-every", "10"]
    r = run_cli("train", *common, "--steps", "1", "--mesh", "fsdp=8")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("train", *common, "--steps", "2", "--mesh", "fsdp=4,tp=2", "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for extra, to in (((), merged), (("--adapter-only",), adapter)):
        r = run_cli("export", "--out", str(out), "--to", str(to), *extra)
        assert r.returncode == 0, r.stderr[-2000:]
    assert (adapter / "adapter_config.json").is_file()
    r = run_cli("train", *common, "--steps", "3", "--resume", "--lora-rank", "2")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--lora-rank" in r.stderr
    # The base stayed frozen: every weight LoRA does not target is the imported one.
    got = _read(merged / "model.safetensors")
    for name in got:
        if "proj" not in name:
            np.testing.assert_array_equal(got[name], _read_any(LLAMA, name), err_msg=name)
    changed = [n for n in got if "proj" in n]
    assert changed and any(
        not np.array_equal(got[n], _read_any(LLAMA, n)) for n in changed)
    # The adapter directory applied to the base gives the merged model's logits.
    tokens = _tokens()
    model = hf.load_model(LLAMA)
    peft = _read(adapter / "adapter_model.safetensors")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    scale = settings["lora_alpha"] / settings["r"]
    weights = {n: _read_any(LLAMA, n) for n in changed}
    for n in changed:
        stem = "base_model.model." + n.removesuffix(".weight")
        weights[n] = weights[n] + scale * peft[stem + ".lora_B.weight"] @ peft[
            stem + ".lora_A.weight"]
        np.testing.assert_allclose(weights[n], got[n], rtol=1e-5, atol=1e-6, err_msg=n)
    assert np.isfinite(np.asarray(model(tokens))).all()


def _read_any(directory: Path, name: str) -> np.ndarray:
    for path in sorted(directory.glob("*.safetensors")):
        f = SafetensorsFile(path)
        if name in f.tensors:
            return f.read(name)
    raise KeyError(name)


def test_cli_lora_flags_are_checked(tmp_path):
    r = run_cli("train", "--lora-rank", "-1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--lora-rank -1" in r.stderr
    r = run_cli("train", "--lora-rank", "2", "--lora-targets", "(", "--out",
                 str(tmp_path / "run"))
    assert r.returncode == 2 and "--lora-targets" in r.stderr


if __name__ == "__main__":  # rewrite the adapter fixture
    save_adapters(adapted_model(), FIXTURE / "adapter", base_model="tests/fixtures/hf/llama_gqa")
    print("wrote", FIXTURE / "adapter")
