"""Dropless expert parallelism (``shardax.parallel.dropless``): on ep=8, ep=2 x fsdp=4,
ep=2 x tp=2 x fsdp=2 (experts' hidden units split over 'tp') and pp=2 x ep=2 x fsdp=2 (gpipe),
the tokens sent to their experts' devices with an all-to-all and back give the one-device
numbers: the first loss (forward), the first SGD update (the gradient: ``-lr * grad``), the
expert load, and 5 SGD steps. The CPU grouped matmul (tiles of one expert's rows) and the
GPU one (batched over a capacity bucket, `bucketed_matmul`) equal ``jax.lax.ragged_dot``.

Tolerance: the suite's (`_reference`: losses rtol 2e-5, parameters `assert_trained_alike`;
float32 summed in another order); the expert load is integer counts, exact.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state

from shardax import layout, models
from shardax.hlo import hlo_collectives
from shardax.layout import Layout
from shardax.mesh import MeshShardingHelper
from shardax.parallel import grouped_kernel
from shardax.parallel.dropless import dropless_moe, pair_counts
from shardax.parallel.grouped_kernel import bucketed_matmul, grouped_matmul, sort_by_expert
from shardax.rules import LogicalAxisRules
from shardax.train.step import train_step

STEPS, LR = 5, 0.1
# gpt-oss's experts (biases: gate and up split with the hidden units over 'tp', down added per
# token; the clamped SwiGLU; top-k softmax router); Mixtral's plain SwiGLU runs over 'ep'
# in tests/test_hf_cli.py and on one device in tests/test_moe.py.
CONFIG = dataclasses.replace(models.CONFIGS["llama-moe-tiny"], n_layers=2, n_experts=8,
                             mlp_dim=32, moe_impl="dropless", moe_aux_weight=0.1,
                             moe_bias=True, swiglu_limit=7.0, router_score="topk_softmax")
LAYOUT = Layout(scan_layers=True)


def _batches():
    tokens = jax.random.randint(jax.random.key(3), (STEPS, 16, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(step, state):
    """Losses, expert load metrics, parameters after the first step and after the last."""
    losses, loads, first = [], [], None
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        loads.append({k: np.asarray(v) for k, v in metrics.items() if k.startswith("moe/")})
        first = jax.device_get(state.params) if first is None else first
    return losses, loads, first, jax.device_get(state.params)


def _sharded_step(mesh_spec, lay=LAYOUT):
    tx = optax.sgd(LR)
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.presets.resolve(layout.PRESETS["fsdp_tp"], mesh.shape))
    graphdef, state = init_train_state(CONFIG, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             layout=lay),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    return step, state


@pytest.fixture(scope="module")
def reference():
    tx = optax.sgd(LR)
    with jax.default_device(jax.devices()[0]):
        graphdef, state = init_train_state(CONFIG, tx)
        start = jax.device_get(state.params)
        step = jax.jit(partial(train_step, graphdef=graphdef, tx=tx, layout=LAYOUT))
        return start, _train(step, state)


# One microbatch through the pipeline: the load-balancing loss sees the whole batch, as on one
# device (a pipeline does not return the expert load: no load metrics there).
PIPELINE = dataclasses.replace(LAYOUT, pp_schedule="gpipe", pp_microbatches=1)


@pytest.mark.parametrize("mesh_spec,lay", [("ep=8", LAYOUT), ("ep=2,fsdp=4", LAYOUT),
                                           ("ep=2,tp=2,fsdp=2", LAYOUT),
                                           ("pp=2,ep=2,fsdp=2", PIPELINE)],
                         ids=["ep", "ep-fsdp", "ep-tp-fsdp", "pp-ep-fsdp"])
def test_expert_parallel_equals_one_device(reference, mesh_spec, lay):
    start, (want_losses, want_loads, want_first, want_last) = reference
    step, state = _sharded_step(mesh_spec, lay)
    compiled = step.lower(state, _batches()[0]).compile()
    assert any(c.kind == "collective-permute" for c in hlo_collectives(compiled.as_text()))
    losses, loads, first, last = _train(compiled, state)
    np.testing.assert_allclose(losses[0], want_losses[0], rtol=2e-5)  # forward
    assert_trained_alike(first, want_first, start, steps=1, optimizer="sgd",
                         err_msg="first update: ")  # gradients
    for got, want in zip(loads, want_loads, strict=True):
        assert got.keys() == (set() if lay is PIPELINE else want.keys()) and want
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert want_losses[-1] < want_losses[0]
    assert_trained_alike(last, want_last, start, steps=STEPS, optimizer="sgd")


def test_tiled_grouped_matmul_equals_ragged_dot():
    """Tiles of 8 rows (uneven loads, an empty expert) against one ragged_dot, both ways."""
    keys = jax.random.split(jax.random.key(0), 4)
    experts = jax.random.randint(keys[0], (40, 2), 0, 4).at[:, 1].set(5)  # expert 4 empty
    x = jax.random.normal(keys[1], (40, 16))
    w = jax.random.normal(keys[2], (6, 16, 8))

    def out(w, x, tile):
        lay = sort_by_expert(experts, 6, tile)
        return grouped_matmul(x[lay.rows], w, lay.groups)[lay.slots]

    grad = jax.grad(lambda w, x, t: jnp.sum(jnp.sin(out(w, x, t))), argnums=(0, 1))
    both = jax.jit(lambda w, x, t: (out(w, x, t), grad(w, x, t)), static_argnums=2)
    want, got = both(w, x, 1), both(w, x, 8)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


# 64 rows over 4 experts: buckets of 24 and 32 rows an expert (1.25 and 2 x the mean 16,
# rounded up to 8), then ragged_dot (branch 2).
@pytest.mark.parametrize("sizes,branch", [([16, 16, 16, 16], 0), ([30, 10, 0, 24], 1),
                                          ([50, 4, 4, 6], 2), ([10, 0, 19, 14], 0)],
                         ids=["first bucket", "second bucket, an empty expert", "ragged_dot",
                              "rows past the groups"])
def test_bucketed_matmul_equals_ragged_dot(sizes, branch):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (64, 16))
    w = jax.random.normal(keys[1], (4, 16, 8))
    ct = jax.random.normal(keys[2], (64, 8))
    sizes = jnp.asarray(sizes, jnp.int32)
    capacities = grouped_kernel._capacities(64, 4)
    assert capacities == (24, 32) and grouped_kernel._bucket_index(sizes, capacities) == branch

    def both(fn):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
        return y, *vjp(ct)

    want, got = both(jax.lax.ragged_dot), jax.jit(lambda: both(bucketed_matmul))()
    assert not np.any(np.asarray(want[0][int(sizes.sum()):]))  # rows past the groups: zeros
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_refused_inside_a_shard_map_over_its_axes():
    mesh = MeshShardingHelper.from_string("ep=8").mesh
    w = jnp.ones((8, 4, 4))

    def body(t):
        return dropless_moe(t, jnp.ones((2, 1)), jnp.zeros((2, 1), int), None, w)

    with pytest.raises(ValueError, match=r"mesh axes \['ep'\] are already manual"):
        jax.shard_map(body, mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep"))(
            jnp.ones((16, 4)))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_exchange_moves_every_routed_row_once(backend, monkeypatch):
    """A skewed routing on ep=8 (device 0 sends all its pairs to device 3, several chunks;
    device 1 sends device 2 nothing): the count matrix is each device's bincount, and the
    experts' outputs (expert e scales its rows by e + 1) come back to every pair once, forward
    and backward, as numpy computes them: a row lost, duplicated or misplaced changes them.
    With the grouped matmul of either backend (tiles on CPU, capacity buckets on a GPU)."""
    monkeypatch.setattr(grouped_kernel, "_backend", lambda: backend)
    ep, t, k, n_experts, d = 8, 12, 2, 16, 4
    rng = np.random.default_rng(0)
    experts = rng.integers(0, n_experts, (ep, t, k))
    experts[0] = rng.integers(6, 8, (t, k))  # device 3's experts only: 24 rows, 3 chunks of 8
    experts[1] = np.where(experts[1] // 2 == 2, 0, experts[1])  # nothing to device 2
    experts = experts.reshape(ep * t, k)
    tokens = rng.standard_normal((ep * t, d)).astype(np.float32)
    weights = rng.random((ep * t, k)).astype(np.float32)
    w = np.arange(1, n_experts + 1, dtype=np.float32)[:, None, None] * np.eye(d, dtype=np.float32)
    mesh = MeshShardingHelper.from_string(f"ep={ep}").mesh
    mlp = lambda xs, groups, w: grouped_matmul(xs, w, groups)  # noqa: E731

    def loss(tokens):
        y = dropless_moe(tokens, jnp.asarray(weights), jnp.asarray(experts), mlp, jnp.asarray(w),
                         mesh=mesh)
        return jnp.sum(y * jnp.arange(d)), y

    counts = jax.jit(jax.shard_map(lambda e: pair_counts(e, n_experts, "ep"), mesh=mesh,
                                   in_specs=jax.P("ep"), out_specs=jax.P()))(experts)
    want_counts = [np.bincount(e.ravel(), minlength=n_experts) for e in np.split(experts, ep)]
    np.testing.assert_array_equal(counts, want_counts)
    assert counts[0, 6:8].sum() == t * k and counts[1, 4:6].sum() == 0
    scale = np.sum(weights * (experts + 1), axis=1, keepdims=True)
    grad, y = jax.jit(jax.grad(loss, has_aux=True))(jnp.asarray(tokens))
    np.testing.assert_allclose(y, scale * tokens, rtol=1e-6)
    np.testing.assert_allclose(grad, scale * np.arange(d), rtol=1e-6)
