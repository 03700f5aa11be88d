"""Explicit FSDP composed with rule-based tensor parallelism: every parameter moves over 'fsdp'
alone (the compiled program's all-gathers and permute rings read from `shardax.hlo`), and
5 SGD steps on HSDP x TP (dp=2, fsdp=2, tp=2) with gradient accumulation equal one device.

Tolerance: the suite's (`_reference`; losses rtol 2e-5, float32 summed in another order).
"""

import dataclasses
from functools import partial

import jax
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device

from shardax import models
from shardax.hlo import hlo_collectives
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.step import train_step

STEPS = 5
CONFIG = dataclasses.replace(models.CONFIGS["llama-tiny"], n_layers=2, scan_layers=True)


def _batches():
    tokens = jax.random.randint(jax.random.key(3), (STEPS, 16, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _step(mesh_spec, config, grad_accum=1):
    tx = optax.sgd(0.1)
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(models.PRESETS["fsdp_tp"])
    graphdef, state = init_train_state(config, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             fsdp_mode="explicit", grad_accum=grad_accum),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    return step, state, mesh.mesh


def _groups_along(mesh, axis):
    """The device-id groups that differ only in their ``axis`` coordinate."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    ids = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
    return {tuple(sorted(g)) for g in ids.reshape(-1, mesh.shape[axis]).tolist()}


@pytest.mark.parametrize("tied", [False, True])
def test_explicit_fsdp_with_tp_moves_parameters_over_fsdp_only(tied):
    step, state, mesh = _step("fsdp=4,tp=2", dataclasses.replace(CONFIG, tie_embeddings=tied))
    hlo = step.lower(state, _batches()[0]).compile().as_text()
    fsdp_groups = _groups_along(mesh, "fsdp")
    moves = [c for c in hlo_collectives(hlo)
             if c.kind in ("all-gather", "collective-permute", "reduce-scatter")]
    assert any(c.kind == "collective-permute" for c in moves), moves  # the tp-sharded weights
    wrong = [c for c in moves if {tuple(sorted(g)) for g in c.groups} != fsdp_groups]
    assert not wrong, wrong  # nothing gathered or scattered over 'tp'


def test_hsdp_with_tp_and_accumulation_equals_one_device():
    want = train_one_device(CONFIG, optax.sgd(0.1), _batches())
    step, state, _ = _step("dp=2,fsdp=2,tp=2", CONFIG, grad_accum=2)
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=2e-5, atol=0)
    assert_trained_alike(state.params, want.state.params, want.start, steps=STEPS,
                         optimizer="sgd")
