"""Explicit FSDP composed with the other axes: with rule-based tensor parallelism every parameter
moves over 'fsdp' alone (the compiled program's all-gathers and permute rings read from
`shardax.hlo`), and 5 SGD steps on HSDP x TP (dp=2, fsdp=2, tp=2) with gradient accumulation
on HSDP x CP (dp=2, fsdp=2, cp=2: the region manual over 'cp' too, ring attention inside) and
on HSDP x EP with the MoE llama (dp=2, fsdp=2, ep=2: manual over 'ep' too, each device gathering
its own experts over 'fsdp', the all-to-alls inside) and on FSDP x PP (pp=2, fsdp=4, circular:
each device gathers its stage's layers over 'fsdp' once per step, before the pipeline; gpipe
runs through the CLI in `test_parallel_train`) equal one device. On FSDP x PP the stage's layers
move once: an all-gather ring and a reduce-scatter ring over 'fsdp', no more.
Without remat the gathered layers are kept from forward to backward (no second gather), equal
to one device too, and the banner says so and why.

Tolerance: the suite's (`_reference`; losses rtol 2e-5, float32 summed in another order).
"""

import dataclasses
from functools import partial

import jax
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device

from shardax import layout, models
from shardax.hlo import hlo_collectives
from shardax.layout import Layout
from shardax.mesh import MeshShardingHelper
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train.config import TrainConfig, check
from shardax.train.resolve import fsdp_recompute, resolve
from shardax.train.step import train_step

STEPS = 5
# Every model here is built with its layers stacked (scan_layers=True).
CONFIG = dataclasses.replace(models.CONFIGS["llama-tiny"], n_layers=2)
MOE = dataclasses.replace(models.CONFIGS["llama-moe-tiny"], n_layers=2)
# Circular, 2 virtual stages: each stage gathers its layers, moved between stages per trip.
PIPED = dataclasses.replace(CONFIG, n_layers=4)
CIRCULAR = Layout(pp_schedule="circular", pp_virtual_stages=2, pp_microbatches=2)


def _batches():
    tokens = jax.random.randint(jax.random.key(3), (STEPS, 16, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.fixture(scope="module")
def references():
    """Per model config: its one-device run on `_batches` (SGD), made on first use."""
    runs = {}

    def get(config):
        if config not in runs:
            runs[config] = train_one_device(config, optax.sgd(0.1), _batches(),
                                            scan_layers=True)
        return runs[config]

    return get


def _step(mesh_spec, config, grad_accum=1, recompute=True, lay=None):
    tx = optax.sgd(0.1)
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.presets.resolve(layout.PRESETS["fsdp_tp"], mesh.shape))
    graphdef, state = init_train_state(config, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             grad_accum=grad_accum,
                             layout=dataclasses.replace(lay or Layout(), fsdp_mode="explicit",
                                                        fsdp_recompute=recompute,
                                                        scan_layers=True)),
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


# No accumulation with experts: the load-balancing loss of two microbatches is not the batch's.
@pytest.mark.parametrize("mesh_spec,config,grad_accum,lay",
                         [("dp=2,fsdp=2,tp=2", CONFIG, 2, Layout()),
                          ("dp=2,fsdp=2,cp=2", CONFIG, 1, Layout()),
                          ("dp=2,fsdp=2,ep=2", MOE, 1, Layout()),
                          ("pp=2,fsdp=4", PIPED, 1, CIRCULAR)],
                         ids=["tp", "cp", "ep", "pp"])
def test_hsdp_composed_equals_one_device(references, mesh_spec, config, grad_accum, lay):
    want = references(config)
    step, state, _ = _step(mesh_spec, config, grad_accum=grad_accum, lay=lay)
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=2e-5, atol=0)
    assert_trained_alike(state.params, want.state.params, want.start, steps=STEPS,
                         optimizer="sgd")


def test_explicit_fsdp_with_pp_moves_each_stage_once():
    """Each device gathers its stage's layers once per step and reduce-scatters their gradient
    once: the bytes moved over 'fsdp' are those two passes over the stage and the rest of the
    model, not one per pipeline step (which cost 1.76x ZeRO-3's bytes at fsdp=4,pp=2)."""
    step, state, mesh = _step("pp=2,fsdp=4", PIPED, lay=CIRCULAR)
    hlo = step.lower(state, _batches()[0]).compile().as_text()
    fsdp_groups = _groups_along(mesh, "fsdp")
    over_fsdp = sum(c.bytes for c in hlo_collectives(hlo)
                    if c.kind in ("all-gather", "reduce-scatter", "collective-permute")
                    and {tuple(sorted(g)) for g in c.groups} <= fsdp_groups)
    layers = models.param_count(PIPED) - PIPED.vocab_size * PIPED.dim  # tied embeddings
    stage = (layers - PIPED.dim) / 2 + PIPED.vocab_size * PIPED.dim + PIPED.dim  # f32 values
    assert over_fsdp <= 2 * 4 * stage, (over_fsdp, 2 * 4 * stage)


def _gathered_bytes(step, state):
    hlo = step.lower(state, _batches()[0]).compile().as_text()
    return sum(c.bytes for c in hlo_collectives(hlo) if c.kind == "all-gather")


def test_kept_gathered_layers_gather_once_and_equal_one_device(references):
    want = references(CONFIG)
    step, state, _ = _step("fsdp=8", CONFIG, recompute=False)
    regather, _, _ = _step("fsdp=8", CONFIG, recompute=True)
    kept, again = _gathered_bytes(step, state), _gathered_bytes(regather, state)
    layers = models.param_count(CONFIG) - 2 * CONFIG.vocab_size * CONFIG.dim  # f32, whole
    assert again - kept >= 0.9 * 4 * layers, (kept, again)  # the backward's second gather
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=2e-5, atol=0)
    assert_trained_alike(state.params, want.state.params, want.start, steps=STEPS,
                         optimizer="sgd")


def test_recompute_choice_and_banner():
    c = models.CONFIGS["llama-tiny"]
    full = models.param_count(c) * 4
    assert fsdp_recompute(TrainConfig(remat="full"), {}, c, Policy(), None) == \
        (True, "--remat full")
    assert not fsdp_recompute(TrainConfig(), {}, c, Policy(), None)[0]
    assert not fsdp_recompute(TrainConfig(), {}, c, Policy(), 4 * full)[0]
    assert fsdp_recompute(TrainConfig(), {}, c, Policy(), 2 * full)[0]
    assert not fsdp_recompute(TrainConfig(), {"tp": 2}, c, Policy(), 2 * full)[0]  # tp shards
    # auto: xla where explicit would keep its gathered layers (the same memory, a faster step)
    for mesh, model in (("fsdp=8", "llama-tiny"), ("fsdp=4,cp=2", "llama-tiny"),
                        ("fsdp=4,ep=2", "llama-moe-tiny")):
        line = resolve(check(TrainConfig(mesh=mesh, model=model, batch_size=8))).fsdp_summary()
        assert line.startswith("fsdp: xla") and "auto: xla holds what explicit would" in line, \
            line
        # explicit where it re-gathers (remat) or reduce-scatters into a sharded accumulator:
        # over a loop of layers it holds less; over scanned ones it moves less
        for scan, why in ((False, "auto: explicit re-gathers"),
                          (True, "auto: over scanned layers both modes gather one layer")):
            line = resolve(check(TrainConfig(mesh=mesh, model=model, batch_size=8,
                                             remat="full", scan_layers=scan))).fsdp_summary()
            assert line.startswith("fsdp: explicit") and why in line, line
            assert "forward recomputed" in line, line
        for scan, why in ((False, "auto: explicit reduce-scatters each microbatch's gradient"),
                          (True, "auto: over scanned layers both modes gather one layer")):
            line = resolve(check(TrainConfig(mesh=mesh, model=model, batch_size=16,
                                             grad_accum=2, scan_layers=scan))).fsdp_summary()
            assert line.startswith("fsdp: explicit") and "kept from forward to backward" in line, \
                line
            assert why in line, line
    # where the gathered layers would not fit, explicit re-gathers them (the memory decides)
    line = resolve(check(TrainConfig(mesh="fsdp=8", batch_size=8)),
                   device_memory=2 * full).fsdp_summary()
    assert line.startswith("fsdp: explicit") and "forward recomputed" in line, line
    assert "exceed 25% of device memory" in line, line
    line = resolve(check(TrainConfig(mesh="fsdp=8", batch_size=8,
                                     fsdp_mode="explicit"))).fsdp_summary()
    assert line.startswith("fsdp: explicit") and "kept from forward to backward" in line, line
    assert "why: --fsdp-mode explicit; no --remat" in line, line
    # a 'pp' axis: explicit gathers each stage's layers once per step and holds less, except
    # with --grad-accum (it gathers per microbatch) or where the stage would not fit
    for remat in ("none", "full"):
        line = resolve(check(TrainConfig(mesh="fsdp=4,pp=2", batch_size=8,
                                         remat=remat))).fsdp_summary()
        assert line.startswith("fsdp: explicit (each stage's layers gathered once per step"), line
        assert "auto: explicit holds less than the partitioner's FSDP on a 'pp' axis" in line, \
            line
    line = resolve(check(TrainConfig(mesh="fsdp=4,pp=2", batch_size=16,
                                     grad_accum=2))).fsdp_summary()
    assert line.startswith("fsdp: xla") and "auto: with --grad-accum on a 'pp' axis" in line, \
        line
    line = resolve(check(TrainConfig(mesh="fsdp=4,pp=2", batch_size=8)),
                   device_memory=full).fsdp_summary()  # the stage's half of it: > 25%
    assert line.startswith("fsdp: xla") and "the stage's gathered layers" in line, line
    line = resolve(check(TrainConfig(mesh="fsdp=4,pp=2", batch_size=8,
                                     fsdp_mode="explicit"))).fsdp_summary()
    assert line.startswith("fsdp: explicit (each stage's layers gathered once") and \
        "why: --fsdp-mode explicit; the stage's gathered layers" in line, line
