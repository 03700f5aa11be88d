"""Explicit ZeRO-3 FSDP (`shardax.parallel.fsdp`) equals one device, with the collectives ZeRO-3
prescribes in the compiled program.

Numerics: `train_step(layout=Layout(fsdp_mode='explicit'))` on 8 devices against the same step
jitted on one device without a mesh: the loss and gradient of a step (forward and backward), and 5
steps of AdamW and of plain SGD (SGD exposes constant-factor gradient errors in the next loss), on
`fsdp=8` and `fsdp=4,tp=2`, with and without gradient accumulation. Tolerance: the one other
strategies use (`tests/test_parallel_train.py`): rtol 2e-5 on losses (float32, the same math
summed in another order). Parameters after the 5 steps: `_reference.assert_trained_alike`, the
suite's one rule for updates under SGD and under Adam (whose m/sqrt(v) turns a last-bit difference
of a ~0 gradient into a step of up to lr). """

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device
from jax.sharding import PartitionSpec as P

from shardax import layout, models
from shardax.cli import main
from shardax.hlo import hlo_collectives
from shardax.mesh import MeshShardingHelper
from shardax.parallel import fsdp
from shardax.rules import LogicalAxisRules
from shardax.train.step import train_step

STEPS = 5
RTOL = 2e-5  # losses, as in test_parallel_train
CONFIG = dataclasses.replace(models.CONFIGS["llama-tiny"], n_layers=2, tie_embeddings=True)
SCAN = True  # the models here stack their layers
OPTIMIZERS = {"sgd": optax.sgd(0.1), "adamw": optax.adamw(3e-3, weight_decay=0.01)}
KIND = {"sgd": "sgd", "adamw": "adam"}  # for assert_trained_alike


def _batches():
    tokens = jax.random.randint(jax.random.key(1), (STEPS, 16, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(step, state, batches):
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.fixture(scope="module")
def reference():
    """Per optimizer: the one-device run (no mesh at all)."""
    return {name: train_one_device(CONFIG, tx, _batches(), scan_layers=SCAN)
            for name, tx in OPTIMIZERS.items()}


def _sharded_step(mesh_spec, tx, grad_accum):
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    graphdef, state = init_train_state(CONFIG, tx)
    step = mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=tx, grad_accum=grad_accum,
                param_rules=rules, layout=layout.Layout(fsdp_mode="explicit", scan_layers=SCAN)),
        in_shardings=(rules, None), out_shardings=(rules, None))
    return step, state


@pytest.mark.parametrize("mesh_spec,optimizer,grad_accum", [
    ("fsdp=8", "sgd", 1),
    ("fsdp=8", "adamw", 2),
    ("fsdp=4,tp=2", "adamw", 1),
    ("fsdp=4,tp=2", "sgd", 2),
])
def test_five_steps_equal_one_device(reference, mesh_spec, optimizer, grad_accum):
    step, state = _sharded_step(mesh_spec, OPTIMIZERS[optimizer], grad_accum)
    losses, state = _train(step, state, _batches())
    want = reference[optimizer]
    np.testing.assert_allclose(losses, want.losses, rtol=RTOL, atol=0)
    assert_trained_alike(state.params, want.state.params, want.start, steps=STEPS,
                         optimizer=KIND[optimizer])


# --- the building block on a small model: forward, gradients, collectives --------------------

L, D, V, B = 3, 16, 32, 16


def _toy():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": jax.random.normal(k[0], (V, D)) * 0.3,
              "layers": {"w": jax.random.normal(k[1], (L, D, D)) * 0.3, "b": jnp.zeros((L, D))},
              "norm": jnp.ones((D,))}
    specs = {"embed": P(None, "fsdp"), "layers": {"w": P(None, "fsdp", "tp"), "b": P()},
             "norm": P()}
    tokens = jax.random.randint(k[2], (B, 8), 0, V)
    targets = jax.random.randint(k[3], (B, 8), 0, V)
    return params, specs, tokens, targets


def _toy_loss(gather, params, tokens, targets):
    table = gather(params["embed"])  # tied: embedding and output projection
    x = table[tokens]
    x = fsdp.scan_layers(gather, lambda p, h: h + jnp.tanh(h @ p["w"] + p["b"]),
                         params["layers"], x)
    logits = (x * gather(params["norm"])) @ table.T
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


@pytest.fixture(scope="module")
def toy_reference():
    params, specs, tokens, targets = _toy()
    with jax.default_device(jax.devices()[0]):
        return jax.jit(lambda p, a, b: fsdp.value_and_grad(_toy_loss, p, specs, a, b))(
            params, tokens, targets)


def _auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("shape,names,grad_accum", [
    ((8,), ("fsdp",), 1),
    ((2, 4), ("dp", "fsdp"), 1),
    ((4, 2), ("fsdp", "tp"), 2),
])
def test_forward_gradients_and_collectives(toy_reference, shape, names, grad_accum):
    params, specs, tokens, targets = _toy()
    fn = jax.jit(lambda p, a, b: fsdp.value_and_grad(_toy_loss, p, specs, a, b,
                                                      grad_accum=grad_accum))
    with jax.set_mesh(_auto_mesh(shape, names)):
        loss, grads = fn(params, tokens, targets)
        hlo = fn.lower(params, tokens, targets).compile().as_text()
    want_loss, want_grads = toy_reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), grads, want_grads)
    ops = hlo_collectives(hlo)
    kinds = [c.kind for c in ops]
    # ZeRO-3: embedding gathered once (tied: one gather, one reduce-scatter), the layer weight
    # gathered in the forward and again in the backward, one reduce-scatter per sharded leaf
    # per layer and per microbatch (each microbatch's gradient is scattered at once).
    if "tp" not in names:
        assert kinds.count("all-gather") == 3, kinds
        assert kinds.count("reduce-scatter") == 2, kinds
        scatters = sum(c.multiplier for c in ops if c.kind == "reduce-scatter")
        assert scatters == (1 + L) * grad_accum, ops
        return
    # The tp-sharded layer weight moves in ppermute rings over 'fsdp' (devices 0,2,4,6 and
    # 1,3,5,7), never gathered over 'tp'; the embedding (fsdp only) in one gather/scatter.
    fsdp_groups = {(0, 2, 4, 6), (1, 3, 5, 7)}
    rings = [c for c in ops if c.kind == "collective-permute"]
    assert rings and all(set(c.groups) == fsdp_groups for c in rings), rings
    for kind in ("all-gather", "reduce-scatter"):
        over_fsdp = [c for c in ops if c.kind == kind and set(c.groups) == fsdp_groups]
        assert len(over_fsdp) == 1, ops
    assert over_fsdp[0].multiplier == grad_accum, ops  # one embedding scatter per microbatch


def test_gathers_in_compute_dtype_and_reduces_in_float32():
    params, specs, tokens, targets = _toy()
    fn = jax.jit(lambda p, a, b: fsdp.value_and_grad(_toy_loss, p, specs, a, b,
                                                      dtype=jnp.bfloat16))
    with jax.set_mesh(_auto_mesh((8,), ("fsdp",))):
        # The program as written: XLA's CPU backend later widens bf16 collectives to f32.
        hlo = fn.lower(params, tokens, targets).as_text(dialect="hlo")
    ops = re.findall(r"= (\w+)\[[^\]]*\]\S* (all-gather|reduce-scatter)\(", hlo)
    assert {dtype for dtype, kind in ops if kind == "all-gather"} == {"bf16"}, ops
    assert {dtype for dtype, kind in ops if kind == "reduce-scatter"} == {"f32"}, ops


def test_bad_batch_names_its_shape():
    params, specs, tokens, targets = _toy()
    with jax.set_mesh(_auto_mesh((8,), ("fsdp",))), pytest.raises(ValueError, match=r"\(12, 8\)"):
        jax.jit(lambda p, a, b: fsdp.value_and_grad(_toy_loss, p, specs, a, b))(
            params, tokens[:12], targets[:12])


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "fsdp=4,tp=2", "--tp-mode", "sync"], "--fsdp-mode explicit does not run with "
     "--tp-mode sync"),
    (["--mesh", "dp=8"], "--fsdp-mode explicit does not run with a mesh without an 'fsdp'"),
    (["--mesh", "fsdp=4,pp=2", "--pp-schedule", "1f1b"],
     "does not run with --pp-schedule 1f1b (it differentiates inside its own shard_map over "
     "'pp', which cannot nest in the FSDP region under differentiation in JAX 0.10: "
     "https://github.com/jax-ml/jax/pull/26588; gpipe and circular run)"),
])
def test_explicit_where_it_cannot_run_exits_2(flags, message, tmp_path, capsys):
    argv = ["train", "--out", str(tmp_path / "run"), "--batch-size", "8", "--fsdp-mode",
            "explicit", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_one_gather_per_dtype_and_values_equal_one_device():
    """A gathered subtree's split leaves move in one all-gather (and one reduce-scatter) per
    dtype: here a float32 and a bfloat16 pair, split on different dims, with equal shard
    shapes; the gradients equal one device's."""
    k = jax.random.split(jax.random.key(1), 5)
    params = {"a": jax.random.normal(k[0], (16, 8)), "b": jax.random.normal(k[1], (8, 16)),
              "c": jax.random.normal(k[2], (16, 8)).astype(jnp.bfloat16),
              "d": jax.random.normal(k[3], (8, 16)).astype(jnp.bfloat16)}
    specs = {"a": P("fsdp", None), "b": P(None, "fsdp"), "c": P("fsdp", None),
             "d": P(None, "fsdp")}
    x = jax.random.normal(k[4], (16, 16))

    def loss(gather, p, x):
        p = gather(p)
        h = jnp.tanh(x @ p["a"]) @ p["b"]
        h = h + (jnp.tanh(x @ p["c"].astype(jnp.float32)) @ p["d"].astype(jnp.float32))
        return jnp.mean(h ** 2)

    fn = jax.jit(lambda p, x: fsdp.value_and_grad(loss, p, specs, x))
    with jax.default_device(jax.devices()[0]):
        want = fn(params, x)
    with jax.set_mesh(_auto_mesh((8,), ("fsdp",))):
        got = fn(params, x)
        hlo = fn.lower(params, x).compile().as_text()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for name in params:  # bfloat16 gradients are summed in bfloat16: a few ulps apart
        g, w = (np.asarray(t[1][name], np.float32) for t in (got, want))
        ulp = 2.0 ** -8 if params[name].dtype == jnp.bfloat16 else 2.0 ** -23
        np.testing.assert_allclose(g, w, rtol=0, atol=8 * ulp * np.abs(w).max())
    kinds = [c.kind for c in hlo_collectives(hlo)]
    assert kinds.count("all-gather") == 2 and kinds.count("reduce-scatter") == 2, kinds
