"""Haliax named-tensor models (seed 003, the Levanter design) through sjit with shardax rules.

The GPT-2 of ``examples/haliax_gpt2.py`` (embeddings, ``Stacked`` blocks with dropout,
attention, MLP, tied head) is passed to ``sjit`` whole and trained with SGD (momentum, so the
optimizer state is sharded too) for 5 steps on a data=4 x model=2 mesh; losses and parameters
equal the same training under ``eqx.filter_jit`` on one device (rtol 1e-5), and every array of
the model and its optimizer state has the layout ``haliax.partitioning.infer_resource_partitions``
gives with the same mapping.
"""

import dataclasses
import importlib.util
import os
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shardax import ReplicationWarning
from shardax.sharding import LogicalAxisRules, MeshShardingHelper

hax = pytest.importorskip("haliax")

STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-6)
TX = optax.sgd(0.5, momentum=0.9)


def _load_example():
    """examples/haliax_gpt2.py as a module (its XLA_FLAGS line is for scripts: undone)."""
    flags = os.environ.get("XLA_FLAGS")
    path = Path(__file__).resolve().parents[1] / "examples" / "haliax_gpt2.py"
    spec = importlib.util.spec_from_file_location("haliax_gpt2_example", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags
    return module


gpt2 = _load_example()
CONFIG = gpt2.Gpt2Config(seq_len=8, vocab_size=32, hidden_dim=16, num_heads=4, num_layers=2,
                         mlp_scale=2)


@pytest.fixture(scope="module")
def mesh():
    return MeshShardingHelper([-1, 2], ["data", "model"])


@pytest.fixture(scope="module")
def reference():
    """Model, optimizer state and losses of the training on one device."""
    return gpt2.train_one_device(CONFIG, TX, STEPS)


def _normal(spec):
    """A spec without trailing Nones, single mesh axes unwrapped from 1-tuples."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _assert_haliax_layout(tree, mapping, mesh):
    expected = hax.partitioning.infer_resource_partitions(tree, mapping, mesh=mesh.mesh)
    shardings = jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, NamedSharding))
    arrays = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert len(arrays) == len(shardings) > 0  # Haliax gives Python bools a sharding too
    for (path, array), sharding in zip(arrays, shardings):
        if eqx.is_array(array):
            where = jax.tree_util.keystr(path)
            assert _normal(array.sharding.spec) == _normal(sharding.spec), where


def _assert_matches_reference(run, reference):
    model, opt_state, losses = run
    ref_model, ref_opt_state, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert losses[-1] < losses[0]
    for actual, expected in [(model, ref_model), (opt_state, ref_opt_state)]:
        actual = jax.tree.leaves(eqx.filter(actual, eqx.is_array))
        expected = jax.tree.leaves(eqx.filter(expected, eqx.is_array))
        assert len(actual) == len(expected)
        for a, b in zip(actual, expected):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


# The example itself runs LogicalAxisRules with the blocks' hax.auto_sharded calls and a compute
# mapping (tests/test_examples.py); these two cover the other halves.
def test_gpt2_whole_with_logical_rules_gets_haliax_layout(mesh, reference):
    # No hax.auto_sharded in the blocks and no compute mapping: Haliax's mapping inside the step
    # is the parameter rules' (as under named_jit(axis_resources=param_mapping)), which only
    # Linear's own auto_sharded calls read.
    config = dataclasses.replace(CONFIG, shard_activations=False)
    run = gpt2.train_sharded(mesh, config, TX, STEPS,
                             params=LogicalAxisRules(gpt2.param_mapping), compute=None)
    _assert_matches_reference(run, reference)
    model, opt_state, _ = run
    _assert_haliax_layout(model, gpt2.param_mapping, mesh)
    _assert_haliax_layout(opt_state, gpt2.param_mapping, mesh)
    assert model.blocks.stacked.mlp.c_fc.weight.array.sharding.spec == PartitionSpec(
        None, "model", "data")
    assert model.blocks.stacked.attn.dropout.inference is False  # a Python bool still


def test_gpt2_whole_with_a_resource_mapping_dict_and_hax_shard(mesh, reference):
    # Haliax's own dict as the rule (a tuple of mesh axes included), the blocks' hax.auto_sharded
    # calls under the compute mapping.
    mapping = {"embed": "data", "mlp": "model", "heads": ("model",)}
    run = gpt2.train_sharded(mesh, CONFIG, TX, STEPS, params=mapping, compute=gpt2.compute_mapping)
    _assert_matches_reference(run, reference)
    _assert_haliax_layout(run[0], mapping, mesh)
    _assert_haliax_layout(run[1], mapping, mesh)


def test_haliax_axis_mapping_is_the_compute_mapping_while_tracing(mesh):
    seen = []

    def probe(x):
        seen.append(hax.partitioning.current_thread_local_mapping())
        return hax.auto_sharded(x)

    x = hax.ones((hax.Axis("batch", 8), hax.Axis("mlp", 4)))
    rules = {"batch": ("replica", "data"), "mlp": "model"}  # 'replica' is not in the mesh
    y = mesh.sjit(probe, logical_axis_rules=rules)(x)
    # (each mesh axis's own name maps to it, as in LogicalAxisRules)
    expected = {"batch": "data", "mlp": "model", "data": "data", "model": "model"}
    assert seen and all(m == expected for m in seen)
    assert y.array.sharding.spec == PartitionSpec("data", "model")
    assert hax.partitioning.current_thread_local_mapping() is None  # restored after the trace


def test_replication_warning_names_haliax_axes_the_rules_do_not_know(mesh):
    w = hax.ones((hax.Axis("mlp", 64), hax.Axis("heads", 4)))
    with pytest.warns(ReplicationWarning, match=r"'mlp' \(dim 0\)"):
        mesh.sjit(lambda w: w * 2, in_shardings=LogicalAxisRules([("embed", "data")]),
                  warn_replicated_bytes=0)(w)
