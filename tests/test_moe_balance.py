"""Auxiliary-loss-free balancing (DeepSeek-V3's router bias) and the expert load metrics.

The bias update is checked against numpy with the routing recomputed from the router logits;
the sigmoid router against a hand-computed case; a `shardax train` run of
``llama-moe-aux-free-tiny`` on dp=2,fsdp=4 against the same steps on one device (bias
included), its resume against the straight run (bit-identical), and its metrics.jsonl.
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cli import committed_steps, read_metrics
from _reference import TINY_TRAIN, assert_trained_alike, init_train_state, train_one_device
from flax import nnx

from shardax import models
from shardax.models.llama_moe import MoE
from shardax.models.moe import route
from shardax.models.protocol import MoEStats
from shardax.train import balance
from shardax.train.checkpoint import Checkpointer, flat
from shardax.train.loop import TrainConfig, prepare, train
from shardax.train.step import train_step

MODEL = "llama-moe-aux-free-tiny"
STEPS = 5
TINY = {**TINY_TRAIN, "model": MODEL, "steps": STEPS, "lr": 0.05}
RTOL = 2e-5  # float32, the same math in another reduction order (as test_parallel_train)


def _bias(tree) -> np.ndarray:
    """The router bias leaves of a train state (or its checkpoint), stacked [layers, E]."""
    leaves = [np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
              if "router_bias" in jax.tree_util.keystr(p)]
    assert leaves, "no router bias in the state"
    return np.concatenate([x.reshape(-1, x.shape[-1]) for x in leaves])


def test_sigmoid_router_picks_by_biased_scores_and_weighs_by_unbiased():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.0, 3.0]])
    bias = jnp.array([0.0, 0.0, 5.0, -5.0])
    w, e, _ = route(logits, 2, True, score="sigmoid", bias=bias, scale=2.5)
    # Row 0: scores + bias pick 2 (0.5 + 5) then 0 (0.88); row 1: 2 (0.73 + 5), then 1
    # (0.62; expert 3's 0.95 - 5 loses). The weights are the scores without the bias.
    np.testing.assert_array_equal(e, [[2, 0], [2, 1]])
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    want = np.array([[s[0, 2], s[0, 0]], [s[1, 2], s[1, 1]]])
    np.testing.assert_allclose(w, 2.5 * want / want.sum(-1, keepdims=True), rtol=1e-6)
    # Without a bias the best scores win (expert 3 in row 1).
    np.testing.assert_array_equal(route(logits, 2, True, score="sigmoid")[1], [[0, 1], [3, 2]])


def _routed_counts(model, tokens) -> np.ndarray:
    """Each layer's top-k assignments per expert [layers, E], routing recomputed in numpy
    from each layer's router logits and bias."""
    c = model.config
    h, extras = model.embed_inputs(tokens)
    counts = []
    for layer in model.layers:
        x = layer.attn_residual(h, layer.attn(layer.attn_norm(h), extras["cos"],
                                              extras["sin"]))
        logits = np.asarray(layer.mlp_norm(x) @ layer.mlp.router[...], np.float32)
        picked = 1 / (1 + np.exp(-logits.reshape(-1, c.n_experts))) + np.asarray(
            layer.mlp.router_bias[...])
        top = np.argsort(-picked, axis=-1, kind="stable")[:, :c.top_k]
        counts.append(np.bincount(top.ravel(), minlength=c.n_experts))
        h = layer(h, extras["cos"], extras["sin"])[0]
    return np.array(counts, np.float32)


def test_bias_update_equals_numpy_from_the_routed_counts():
    c = dataclasses.replace(models.CONFIGS[MODEL], n_layers=2, router_bias_update=0.01)
    tx = optax.sgd(0.1)
    graphdef, state = init_train_state(c, tx)
    # A bias that already moves the choice: the update must count the biased routing.
    bias = [0.3 * jax.random.normal(jax.random.key(i), (c.n_experts,)) for i in range(2)]
    rest = nnx.merge(graphdef, state.params, state.rest)
    for layer, b in zip(rest.layers, bias):
        layer.mlp.router_bias[...] = b
    state = state._replace(rest=nnx.split(rest, nnx.Param, ...)[2])
    tokens = jax.random.randint(jax.random.key(5), (4, 17), 0, c.vocab_size)
    counts = _routed_counts(nnx.merge(graphdef, state.params, state.rest), tokens[:, :-1])
    # Two microbatches: the update counts the whole batch.
    step = jax.jit(lambda s, b: train_step(s, b, graphdef=graphdef, tx=tx, grad_accum=2))
    new, metrics = step(state, (tokens[:, :-1], tokens[:, 1:]))
    mean = counts.mean(-1, keepdims=True)
    want = np.stack(bias) + np.float32(0.01) * np.sign(mean - counts)
    np.testing.assert_array_equal(_bias(new.rest), want.astype(np.float32))
    assert np.any(counts != mean)  # some expert was off the mean: the bias moved
    np.testing.assert_array_equal(metrics["moe/expert_tokens"], counts.sum(0))
    np.testing.assert_allclose(metrics["moe/load_max_over_mean"],
                               np.mean(counts.max(-1) / counts.mean(-1)), rtol=1e-6)
    assert "moe/dropped_fraction" not in metrics  # dropless


def test_capacity_moe_reports_its_load_and_drops():
    c = dataclasses.replace(models.CONFIGS["llama-moe-tiny"], capacity_factor=0.5)
    moe = MoE(c, nnx.Rngs(0))
    moe.router[...] = 3.0 * jax.random.normal(jax.random.key(1), moe.router.shape)
    x = jax.random.normal(jax.random.key(2), (2, 8, c.dim))
    _, stats = moe(x)
    probs = jax.nn.softmax(x.reshape(-1, c.dim) @ moe.router[...])
    counts = np.bincount(np.asarray(jax.lax.top_k(probs, c.top_k)[1]).ravel(),
                         minlength=c.n_experts)
    np.testing.assert_array_equal(stats.expert_tokens, counts)
    # 4 slots per expert and row (0.5 x 8 x 2 / 4): what an expert gets over that is dropped.
    assert 0 < float(stats.dropped_fraction) < 1
    load = MoEStats(stats.loss, stats.expert_tokens[None], stats.dropped_fraction)
    metrics = balance.load_metrics(load, c)
    assert float(metrics["moe/dropped_fraction"]) == float(stats.dropped_fraction)
    assert float(metrics["moe/load_max_over_mean"]) == counts.max() / counts.mean()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run's steps on one device with no mesh (the plain program), batches as the run's."""
    prepared = prepare(TrainConfig(**{**TINY, "mesh": "dp=-1",
                                      "out": str(tmp_path_factory.mktemp("ref") / "run")}))
    run = prepared.run
    batches = [prepared.inputs.train.batch(i) for i in range(STEPS)]
    return train_one_device(run.model_config, run.tx, batches, seed=run.config.seed,
                            policy=run.policy, end_id=prepared.inputs.tokenizer.eos_id)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``shardax train --model llama-moe-aux-free-tiny --mesh dp=2,fsdp=4``, 5 SGD steps,
    checkpoints at 2, 4 and 5."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return out, train(TrainConfig(out=str(out), mesh="dp=2,fsdp=4", **TINY))


def _restore(out, step) -> dict:
    """The saved train state of ``step``: ``{"params.layers.0....": array}``."""
    with Checkpointer(out / "checkpoints") as ckpt:
        return ckpt.restore(step).state


def test_sharded_run_with_bias_equals_one_device(reference, straight):
    out, records = straight
    losses = [r["loss"] for r in records]
    np.testing.assert_allclose(losses, reference.losses, rtol=RTOL)
    assert losses[-1] < losses[0]
    saved = _restore(out, STEPS)  # flat: {"params.layers.0...": array}
    params = {k: v for k, v in saved.items() if k.startswith("params.")}
    assert_trained_alike(params, flat({"params": reference.state.params}),
                         flat({"params": reference.start}), steps=STEPS, optimizer="sgd")
    want = _bias(reference.state.rest)
    assert np.any(want != 0)  # the bias moved
    np.testing.assert_array_equal(_bias({k: v for k, v in saved.items()
                                         if k.startswith("rest.")}), want)


def test_resume_with_bias_is_bit_identical(straight, tmp_path):
    out, records = straight
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    for step_dir in (copy / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > 2:
            shutil.rmtree(step_dir)
    assert committed_steps(copy)[-1] == 2
    train(TrainConfig(out=str(copy), mesh="dp=2,fsdp=4", resume=True, **TINY))
    keys = ("loss", "grad_norm", "moe/expert_tokens", "moe/load_max_over_mean")
    for r, s in zip(read_metrics(copy), records, strict=True):
        assert {k: r[k] for k in keys} == {k: s[k] for k in keys}, r["step"]
    got, want = _restore(copy, STEPS), _restore(out, STEPS)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                            strict=True):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))
    assert _bias(got).shape == (models.CONFIGS[MODEL].n_layers, 4)


def test_load_metrics_in_metrics_jsonl(straight):
    out, _ = straight
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    c = models.CONFIGS[MODEL]
    batch_tokens = TINY["batch_size"] * TINY["seq_len"]
    for r in records:
        tokens = r["moe/expert_tokens"]
        assert len(tokens) == c.n_experts and all(isinstance(t, int) for t in tokens)
        # Every token reaches top_k experts in every layer: nothing dropped.
        assert sum(tokens) == batch_tokens * c.top_k * c.n_layers
        assert r["moe/load_max_over_mean"] >= 1.0
        assert "moe/dropped_fraction" not in r
