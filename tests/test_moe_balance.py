"""Auxiliary-loss-free balancing (DeepSeek-V3's router bias) and the expert load metrics.

One `shardax train` run of ``llama-moe-aux-free-tiny`` (two microbatches a step) on
dp=2,fsdp=4 is checked against the same steps on one device (bias included); the one-device
run's last bias update against numpy with the routing recomputed from the router logits; its
resume against the straight run (bit-identical); its metrics.jsonl. The sigmoid router against
a hand-computed case, the capacity MoE's load and drops against a recount.
"""

import dataclasses
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import assert_one_line_error, committed_steps, read_metrics, run_cli
from _reference import TINY_TRAIN, assert_trained_alike, init_train_state, train_one_device
from flax import nnx

from shardax import models
from shardax.data import packing
from shardax.models.llama_moe import MoE
from shardax.models.moe import route
from shardax.models.protocol import MoEStats
from shardax.train import balance
from shardax.train.loop import TrainConfig, prepare, train
from shardax.train.run.checkpoint import Checkpointer, flat

MODEL = "llama-moe-aux-free-tiny"
STEPS = 5
# Two microbatches: the load (and so the bias update) sums over them. Stacked layers: one
# [layers, E] bias, and one layer body to compile.
TINY = {**TINY_TRAIN, "model": MODEL, "steps": STEPS, "lr": 0.05, "eval_every": 0,
        "batch_size": 16, "grad_accum": 2, "scan_layers": True}
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


def _grouped_route_numpy(logits, bias, top_k, n_group, topk_group, scale):
    """transformers' DeepseekV3TopkRouter in numpy (float64): group score = the sum of its 2
    best biased scores, the topk_group best groups kept, the top-k of their experts."""
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = s + bias
    t, n = choice.shape
    grouped = choice.reshape(t, n_group, n // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    masked = np.where(np.repeat(mask, n // n_group, axis=-1), choice, -np.inf)
    experts = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s, experts, axis=-1)
    return scale * w / w.sum(-1, keepdims=True), experts


def test_group_limited_routing_picks_from_the_best_groups_only():
    # 6 experts in 3 groups of 2, keep 1 group, top 2. Row 0: groups score 0.9+0.1 | 0.8+0.7
    # | 0.6+0.5 (as sigmoids), so group 1 wins though expert 0 is the best single one.
    p = np.array([[0.9, 0.1, 0.8, 0.7, 0.6, 0.5], [0.2, 0.3, 0.4, 0.1, 0.9, 0.95]])
    logits = jnp.asarray(np.log(p / (1 - p)), jnp.float32)
    w, e, _ = route(logits, 2, True, score="sigmoid", bias=jnp.zeros(6), n_group=3,
                    topk_group=1)
    np.testing.assert_array_equal(np.sort(e, axis=-1), [[2, 3], [4, 5]])
    np.testing.assert_allclose(w[0], np.array([0.8, 0.7]) / 1.5, rtol=1e-6)
    # Ungrouped, row 0 would take experts 0 and 2.
    np.testing.assert_array_equal(route(logits, 2, True, score="sigmoid")[1][0], [0, 2])
    # DeepSeek-V3's shape of routing (groups of 8 scaled down): 32 experts in 8 groups, the
    # best 4 groups, top 4, with a bias; random logits against the numpy reference.
    logits = 2 * jax.random.normal(jax.random.key(0), (64, 32))
    bias = 0.3 * jax.random.normal(jax.random.key(1), (32,))
    w, e, _ = route(logits, 4, True, score="sigmoid", bias=bias, scale=2.5, n_group=8,
                    topk_group=4)
    want_w, want_e = _grouped_route_numpy(np.asarray(logits), np.asarray(bias, np.float64), 4,
                                          8, 4, 2.5)
    order = np.argsort(np.asarray(e), axis=-1)  # top-k order is not part of the contract
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1),
                                  np.sort(want_e, axis=-1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(want_w, np.argsort(want_e, -1), -1),
                               rtol=1e-5)
    ungrouped = route(logits, 4, True, score="sigmoid", bias=bias)[1]
    assert (np.sort(ungrouped, -1) != np.sort(want_e, -1)).any(axis=-1).sum() > 10


@nnx.jit
def _router_inputs(model, tokens, end_id):
    """Each layer's router logits [layers, tokens, E] and bias [layers, E] for packed
    documents (ending in ``end_id``), through the model's own (stacked) layers."""
    segments, positions, _ = packing.documents(tokens, end_id)
    h, extras = model.embed_inputs(tokens, positions, segments)
    cos, sin = extras["cos"], extras["sin"]
    logits, bias = [], []
    graphdef, stacked = nnx.split(model.layers)
    for i in range(model.config.n_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
        x = layer.attn_residual(h, layer.attn(layer.attn_norm(h), cos, sin, segments))
        logits.append((layer.mlp_norm(x) @ layer.mlp.router[...]).reshape(-1, 4))
        bias.append(layer.mlp.router_bias[...])
        h = layer(h, cos, sin, segments)[0]
    return jnp.stack(logits), jnp.stack(bias)


def _routed_counts(model, tokens, end_id) -> np.ndarray:
    """Each layer's top-k assignments per expert [layers, E], the routing recomputed in numpy
    from the router logits: sigmoid scores plus the bias, top-k."""
    logits, bias = (np.asarray(a, np.float32) for a in _router_inputs(model, tokens, end_id))
    picked = 1 / (1 + np.exp(-logits)) + bias[:, None, :]
    top = np.argsort(-picked, axis=-1, kind="stable")[..., :model.config.top_k]
    n = model.config.n_experts
    return np.array([np.bincount(t.ravel(), minlength=n) for t in top], np.float32)


def test_bias_update_equals_numpy_from_the_routed_counts(reference, straight):
    """The last step of the one-device reference (two microbatches): the bias after it is
    the bias before it plus 0.001 * sign(mean - load), load counted in numpy."""
    run = reference.run
    before = run.before_last
    model = nnx.merge(reference.graphdef, before.params, before.rest)
    counts = _routed_counts(model, jnp.asarray(reference.batches[-1][0]), reference.end_id)
    mean = counts.mean(-1, keepdims=True)
    assert np.any(counts != mean)  # some expert was off the mean: the bias moved
    rate = np.float32(models.CONFIGS[MODEL].router_bias_update)
    want = _bias(before.rest) + rate * np.sign(mean - counts)
    np.testing.assert_array_equal(_bias(run.state.rest), want)
    # The sharded run's last step routed the same: its logged load is this one.
    last = straight[1][-1]
    assert last["moe/expert_tokens"] == counts.sum(0).astype(int).tolist()
    np.testing.assert_allclose(last["moe/load_max_over_mean"],
                               np.mean(counts.max(-1) / counts.mean(-1)), rtol=1e-6)


def test_capacity_moe_reports_its_load_and_drops():
    c = dataclasses.replace(models.CONFIGS["llama-moe-tiny"], capacity_factor=0.5)
    moe = MoE(c, nnx.Rngs(0))
    moe.router[...] = 3.0 * jax.random.normal(jax.random.key(1), moe.router.shape)
    x = jax.random.normal(jax.random.key(2), (2, 8, c.dim))
    _, stats = nnx.jit(lambda m, x: m(x))(moe, x)
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


class Reference(NamedTuple):
    run: Any  # OneDeviceRun
    graphdef: Any
    batches: list
    end_id: int


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run's steps on one device with no mesh (the plain program), batches as the run's."""
    prepared = prepare(TrainConfig(**{**TINY, "mesh": "dp=-1",
                                      "out": str(tmp_path_factory.mktemp("ref") / "run")}))
    run, end_id = prepared.run, prepared.inputs.tokenizer.eos_id
    batches = [prepared.inputs.train.batch(i) for i in range(STEPS)]
    one = train_one_device(run.model_config, run.tx, batches, seed=run.config.seed,
                           policy=run.policy, end_id=end_id, grad_accum=TINY["grad_accum"],
                           scan_layers=True)
    graphdef = init_train_state(run.model_config, run.tx, abstract=True)[0]
    return Reference(one, graphdef, batches, end_id)


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
    reference = reference.run
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


def test_bias_on_a_pipeline_is_refused(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--model", MODEL, "--mesh", "pp=2,fsdp=4", "--batch-size", "8",
                   "--steps", "1", "--out", out)
    assert_one_line_error(proc, "train", f"--model {MODEL}", "'pp'")
    assert not out.exists()
