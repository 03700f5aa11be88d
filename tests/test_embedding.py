"""The embedding lookup moves activations, never the table (`shardax.models.embedding`):
values and gradients equal one device, and no all-gather in the compiled program has the
table's shape, under XLA's FSDP (`jax.jit` with the rules) and under explicit FSDP.

Tolerance: the lookup is exact (copies and sums with zeros: equal bit for bit); the test's
scalar sums 512 terms in another order (rtol 1e-5), the gradient is a scatter-add of the same
few terms per row in another order (rtol 1e-6). Training steps:
the suite's rules (`_reference`), rtol 2e-5 on losses.
"""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device
from jax.sharding import AxisType, NamedSharding

from shardax import layout, models
from shardax.logical import use_logical_rules
from shardax.mesh import MeshShardingHelper
from shardax.models import embedding
from shardax.rules import LogicalAxisRules
from shardax.train.step import train_step

V, D = 64, 16
STEPS = 5
CONFIG = dataclasses.replace(models.CONFIGS["llama-tiny"], n_layers=2, tie_embeddings=False)
SCAN = True  # the models here stack their layers


def _table_gathers(hlo: str, shape: tuple[int, int]) -> list[str]:
    """The all-gathers whose result has the table's shape (any dtype)."""
    dims = ",".join(map(str, shape))
    return [line for line in hlo.splitlines()
            if re.search(r"all-gather(-start)?\(", line) and re.search(rf"\[{dims}\]", line)]


@pytest.mark.parametrize("shape,names,preset", [
    ((8,), ("fsdp",), "fsdp"),                        # columns over fsdp: all-to-all
    ((2, 2, 2), ("dp", "fsdp", "tp"), "fsdp_tp"),     # + rows over tp: masked psum
    ((2, 4), ("fsdp", "tp"), "tp"),                   # rows only
])
def test_lookup_equals_one_device_and_gathers_no_table(shape, names, preset):
    table = jax.random.normal(jax.random.key(0), (V, D))
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, V)
    w = jax.random.normal(jax.random.key(2), (8, 4, D))

    def f(t, tok):
        return jnp.sum(jnp.sin(embedding.lookup(t, tok)) * w)

    want_x = jnp.take(table, tokens, axis=0)
    want = jax.jit(jax.value_and_grad(f))(table, tokens)
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    rules = LogicalAxisRules(layout.PRESETS[preset])
    with jax.set_mesh(mesh), use_logical_rules(rules):
        t = jax.device_put(table, NamedSharding(mesh, rules.spec_for(("vocab", "embed"))))
        tok = jax.device_put(tokens, NamedSharding(mesh, rules.spec_for(("batch", "length"))))
        step = jax.jit(jax.value_and_grad(f))
        hlo = step.lower(t, tok).compile().as_text()
        got = step(t, tok)
        x = jax.jit(embedding.lookup)(t, tok)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[1].sharding.spec == t.sharding.spec  # the gradient arrives sharded
    assert not _table_gathers(hlo, (V, D)), _table_gathers(hlo, (V, D))


def _batches():
    tokens = jax.random.randint(jax.random.key(1), (STEPS, 16, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.fixture(scope="module")
def reference():
    return train_one_device(CONFIG, optax.sgd(0.1), _batches(), scan_layers=SCAN)


@pytest.mark.parametrize("mode", ["xla", "explicit"])
@pytest.mark.parametrize("mesh_spec", ["fsdp=8", "fsdp=4,tp=2"])
def test_llama_step_moves_no_table_and_equals_one_device(reference, mode, mesh_spec):
    """An untied llama, 5 SGD steps: no all-gather of the [vocab, dim] table in the step."""
    tx = optax.sgd(0.1)
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    graphdef, state = init_train_state(CONFIG, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             layout=layout.Layout(fsdp_mode=mode, scan_layers=SCAN)),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    hlo = step.lower(state, _batches()[0]).compile().as_text()
    table = (CONFIG.vocab_size, CONFIG.dim)
    assert not _table_gathers(hlo, table), _table_gathers(hlo, table)
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference.losses, rtol=2e-5, atol=0)
    assert_trained_alike(state.params, reference.state.params, reference.start, steps=STEPS,
                         optimizer="sgd")
