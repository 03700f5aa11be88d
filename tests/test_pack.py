"""Packed documents (``--pack documents``): the segment ids, positions and loss mask of token
rows, and a packed batch's loss and gradients through the train step against each document
computed alone, on one device and sharded; ``--pack concat`` is the step as it was; a packed
run resumed from a checkpoint is bit-identical to a straight one.

The gradients come out of the train step through an optimizer that keeps them as its state
(`_KEEP_GRADS`), so nothing is subtracted back out of updated parameters.
"""

import dataclasses
import json
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import TINY_TRAIN, documents_alone_loss, init_train_state
from flax import nnx

from shardax import layout, models
from shardax.data.packing import documents, loss_weights
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train import build
from shardax.train.config import check
from shardax.train.generate import generate
from shardax.train.loop import TrainConfig, train
from shardax.train.resolve import resolve
from shardax.train.rundir import load_run_config
from shardax.train.step import eval_loss, train_step
from shardax.utils import tree_path_to_string

END = 0  # the byte tokenizer's end-of-text id
B, S = 8, 16
RTOL = 1e-5  # float32, the same sums in another order (and chunked per document)
CONFIG = dataclasses.replace(models.CONFIGS["llama-tiny"], max_seq_len=S)

# The optimizer state is the last gradient (the parameters stay): gradients exactly as the
# step computed them.
_KEEP_GRADS = optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _rows(seed: int = 0) -> np.ndarray:
    """[B, S + 1] token rows with documents of 1 to 9 tokens (ids 1..255) each ending in END;
    some rows start or end mid-document, one has no END at all."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, 256, (B, S + 1))
    for r in range(B - 1):
        at = 0
        while True:
            at += int(rng.integers(1, 10))
            if at >= S + 1:
                break
            rows[r, at] = END
    rows[1, 0] = END  # a row that starts with an end-of-text
    return rows


def test_documents_segments_positions_and_mask():
    rows = jnp.array([[3, 0, 0, 4, 5, 0], [1, 2, 3, 4, 5, 6]])
    segs, pos, mask = documents(rows, END)
    np.testing.assert_array_equal(segs, [[0, 0, 1, 2, 2, 2], [0] * 6])
    np.testing.assert_array_equal(pos, [[0, 1, 0, 0, 1, 2], list(range(6))])
    np.testing.assert_array_equal(mask, [[True, False, False, True, True, False], [True] * 6])
    weights = loss_weights(mask)
    np.testing.assert_allclose(float(weights.mean()), 1.0, rtol=1e-6)
    assert float(weights[0, 1]) == 0.0


def _documents(rows: np.ndarray) -> list:
    """Each document of each row as ``(inputs, targets, keep)``: the targets that stay within
    their document (an end-of-text's target is the next document's first token)."""
    docs = []
    for row in rows:
        inputs, targets = row[:-1], row[1:]
        start = 0
        for end in [*(np.flatnonzero(inputs == END) + 1), S]:
            if end > start:
                docs.append((inputs[start:end], targets[start:end], inputs[start:end] != END))
            start = end
    return docs


@pytest.fixture(scope="module")
def reference():
    """``(graphdef, state, rows, loss, grads)`` of the per-document computation."""
    graphdef, state = init_train_state(CONFIG, _KEEP_GRADS)
    rows = _rows()
    loss, grads = jax.value_and_grad(documents_alone_loss)(state.params, state.rest, graphdef,
                                                           _documents(rows), S)
    return graphdef, state, rows, float(loss), grads


def _assert_matches(got_loss, got_grads, want_loss, want_grads):
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=RTOL)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(got_grads)),
                            jax.tree.leaves(want_grads), strict=True):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, path  # a gradient that is zero could not show a wrong mask
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=RTOL * scale,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_packed_step_equals_per_document_on_one_device(reference, grad_accum):
    graphdef, state, rows, loss, grads = reference
    step = jax.jit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, end_id=END,
                           grad_accum=grad_accum))
    batch = (jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]))
    new, metrics = step(state, batch)
    _assert_matches(metrics["loss"], new.opt_state, loss, grads)
    evaluated = jax.jit(partial(eval_loss, graphdef=graphdef, end_id=END))(state, batch)
    np.testing.assert_allclose(float(evaluated), loss, rtol=RTOL)


@pytest.mark.parametrize("mesh_spec,fsdp_mode", [
    ("fsdp=4,tp=2", "xla"),
    ("fsdp=8", "explicit"),
    ("fsdp=4,cp=2", "explicit"),  # what auto picks with 'cp'
])
def test_packed_step_equals_per_document_sharded(reference, mesh_spec, fsdp_mode):
    graphdef, state, rows, loss, grads = reference
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp_tp"], mesh.shape, heads=CONFIG.n_heads, kv_heads=CONFIG.n_kv_heads))
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, end_id=END,
                             param_rules=rules,
                             layout=layout.Layout(fsdp_mode=fsdp_mode)),
                     in_shardings=(rules, batch_spec), out_shardings=(rules, None))
    batch = (jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]))
    new, metrics = step(state, batch)
    _assert_matches(metrics["loss"], new.opt_state, loss, grads)


def test_concat_is_the_unpacked_step(reference):
    """Without ``end_id`` the step is the one-stream step: exactly the model's own loss of the
    rows as given (positions 0.., attention across end-of-text tokens)."""
    graphdef, state, rows, _, _ = reference
    batch = (jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]))
    _, metrics = jax.jit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS))(state, batch)

    def plain(params):
        return nnx.merge(graphdef, params, state.rest).training_loss(*batch)[0]

    assert float(metrics["loss"]) == float(jax.jit(plain)(state.params))


def test_concat_and_documents_runs(tmp_path, capsys):
    """On data whose windows cross documents, ``--pack documents`` and ``--pack concat``
    train differently (the flag reaches the step)."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "document {i} says {"ab" * (i % 7)}"}}\n'
                            for i in range(400)))
    common = {**TINY_TRAIN, "steps": 2, "data": [str(data)], "mesh": "fsdp=-1"}
    concat = train(TrainConfig(out=str(tmp_path / "c"), pack="concat", **common))
    packed = train(TrainConfig(out=str(tmp_path / "d"), pack="documents", **common))
    assert [r["loss"] for r in concat] != [r["loss"] for r in packed]
    # The banner names the attention that runs (auto resolved: xla at 32 tokens on CPU).
    banner = capsys.readouterr().out
    assert "attention: xla (--attention auto); pack: concat" in banner
    assert "attention: xla (--attention auto); pack: documents" in banner


def test_documents_resume_is_bit_identical(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "document {i} says {"xy" * (i % 5)}"}}\n'
                            for i in range(400)))
    common = {**TINY_TRAIN, "data": [str(data)], "mesh": "fsdp=-1", "pack": "documents"}
    straight = train(TrainConfig(out=str(tmp_path / "a"), **common))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    resumed = train(TrainConfig(out=str(tmp_path / "b"), resume=True, **common))
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in straight if "loss" in r}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in resumed if "loss" in r}
    assert got == want
    # The run samples alike with any attention implementation (greedy, same tokens).
    texts = {impl: generate(str(tmp_path / "b"), "document 3", 6, temperature=0,
                            attention=impl) for impl in ("einsum", "blockwise", None)}
    assert len(set(texts.values())) == 1, texts


def test_a_run_from_before_pack_loads_as_concat(tmp_path):
    """A config.json written before ``--pack`` and ``--attention`` existed still loads; its
    rows were one stream, and stay so."""
    old = TrainConfig(remat="save_dots").to_json()
    del old["pack"], old["attention"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    saved = load_run_config(tmp_path)
    assert (saved.pack, saved.attention, saved.remat) == ("concat", "auto", "save_dots")


def test_a_run_from_before_the_layout_held_remat_and_attention_resolves(tmp_path):
    """A run's config.json from when ``--remat`` / ``--attention`` went into the model config
    still loads and resolves: its flags now go to the `Layout`, and the model config holds
    the architecture alone (the checkpointed parameters are the same)."""
    old = TrainConfig(remat="save_dots", attention="blockwise").to_json()
    (tmp_path / "config.json").write_text(json.dumps(old))
    run = resolve(check(load_run_config(tmp_path)))
    assert (run.layout.remat, run.layout.attention) == ("save_dots", "blockwise")
    assert not {"remat", "attention"} & {f.name for f in dataclasses.fields(run.model_config)}


@pytest.mark.parametrize("flags, scan", [({"scan_layers": False}, False), ({}, True),
                                         ({"scan_layers": False, "mesh": "pp=2,fsdp=4"}, False)],
                         ids=["loop", "scan-layers", "pp"])
def test_a_run_from_before_the_layout_held_scan_layers_resolves(tmp_path, flags, scan):
    """A run's config.json from when ``--scan-layers`` went into the model config resolves:
    the flag goes to `Layout.scan_layers` (scan or loop) and the model config holds no
    ``scan_layers``. The parameter tree is the stack ``layers/...`` ``[L, ...]`` either way
    (checkpoints written with a list ``layers/0/...`` are stacked on restore:
    tests/test_old_checkpoints.py)."""
    old = TrainConfig(**flags).to_json()
    (tmp_path / "config.json").write_text(json.dumps(old))
    run = resolve(check(load_run_config(tmp_path)))
    assert run.layout.scan_layers == scan
    assert "scan_layers" not in {f.name for f in dataclasses.fields(run.model_config)}
    _, shapes = build.abstract(run.model_config, run.tx, 0, run.mesh)
    got = {tree_path_to_string(path, sep="/").removesuffix("/value"): leaf.shape
           for path, leaf in jax.tree_util.tree_flatten_with_path(shapes.params)[0]}
    c = run.model_config
    n, wq = c.n_layers, (c.dim, c.n_heads, c.head_dim)
    assert {k: v for k, v in got.items() if k.endswith("attn/wq")} == {"layers/attn/wq": (n, *wq)}


def test_a_run_from_before_scan_layers_existed_keeps_its_loop_over_layers(tmp_path):
    """Layers are scanned by default now; a config.json without ``scan_layers`` (written
    before the flag existed) belongs to a run that looped over its layers, so it loads as
    ``scan_layers=False`` and resumes running them as it did (its list checkpoint is stacked
    on restore)."""
    old = TrainConfig().to_json()
    del old["scan_layers"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert load_run_config(tmp_path).scan_layers is False
    assert TrainConfig().scan_layers is True


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_packed_pipeline_loss_equals_per_document(reference, schedule):
    """Under a 'pp' pipeline (2 microbatches) the segment ids travel with each microbatch and
    the loss weights keep the mean over the whole batch: the per-document loss."""
    _, _, rows, loss, _ = reference
    config = CONFIG
    mesh = MeshShardingHelper.from_string("pp=2,fsdp=4")
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp"], mesh.shape, heads=config.n_heads, kv_heads=config.n_kv_heads))
    graphdef, state = init_train_state(config, _KEEP_GRADS)  # the same numbers, stacked
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, end_id=END,
                             param_rules=rules,
                             layout=layout.Layout(pp_schedule=schedule, pp_microbatches=2,
                                                  scan_layers=True)),
                     in_shardings=(rules, rules.spec_for(("batch", "length"), mesh.mesh)),
                     out_shardings=(rules, None))
    _, metrics = step(state, (jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])))
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=RTOL)
