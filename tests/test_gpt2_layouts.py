"""GPT-2 runs every layout through the model protocol (`shardax.layout.forward`): five SGD steps
on 8 devices give the one-device losses and parameters, for tensor parallelism (sync and
async), each pipeline schedule, ring attention over 'cp' and explicit FSDP."""

import dataclasses
from functools import partial

import jax
import numpy as np
import optax
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device
from flax import nnx

from shardax import layout, models
from shardax.layout import Layout
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.step import train_step

STEPS = 5
# Four stacked layers: circular runs 2 stages x 2 virtual stages of one layer each.
CONFIG = dataclasses.replace(models.CONFIGS["gpt2-tiny"], vocab_size=128, dim=32, n_heads=2,
                             mlp_dim=64, max_seq_len=16)
TX = optax.sgd(0.2)

# Every case stacks the layers (Layout.scan_layers, the model built so).
CASES = {
    "tp-sync": ("fsdp=4,tp=2", Layout(tp_mode="sync", scan_layers=True)),
    "tp-async": ("fsdp=4,tp=2", Layout(tp_mode="async", scan_layers=True)),
    "pp-gpipe": ("pp=2,fsdp=4", Layout(pp_microbatches=2, scan_layers=True)),
    "pp-circular": ("pp=2,fsdp=4", Layout(pp_schedule="circular", pp_microbatches=2,
                                          pp_virtual_stages=2, scan_layers=True)),
    "pp-1f1b": ("pp=2,fsdp=4", Layout(pp_schedule="1f1b", pp_microbatches=2, scan_layers=True)),
    "cp": ("cp=2,fsdp=4", Layout(scan_layers=True)),
    "fsdp-explicit": ("fsdp=8", Layout(fsdp_mode="explicit", scan_layers=True)),
}


def _batches():
    """One batch, STEPS times: the loss falls, so a wrong gradient shows."""
    t = jax.random.randint(jax.random.key(3), (8, 17), 0, CONFIG.vocab_size)
    return [(t[:, :-1], t[:, 1:])] * STEPS


@pytest.fixture(scope="module")
def reference():
    return train_one_device(CONFIG, TX, _batches(), scan_layers=True)


@pytest.mark.parametrize("case", list(CASES))
def test_gpt2_layout_equals_one_device(reference, case):
    mesh_spec, lay = CASES[case]
    mesh = MeshShardingHelper.from_string(mesh_spec)
    layout.check_mesh(CONFIG, lay, mesh.shape, batch_size=8, seq_len=16)
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp_tp"], mesh.shape, heads=CONFIG.n_heads, kv_heads=CONFIG.n_heads,
        sequence_parallel=lay.sp))
    graphdef, state = init_train_state(CONFIG, TX)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=TX, param_rules=rules,
                             layout=lay),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference.losses, rtol=2e-5, atol=0)
    assert reference.losses[-1] < reference.losses[0]
    got, want, start = (_without_key_bias(p) for p in (state.params, reference.state.params,
                                                       reference.start))
    assert_trained_alike(got, want, start, steps=STEPS, optimizer="sgd")
    # The key bias adds q . b_k to every score of a query alike: softmax drops it, so its
    # gradient is 0 by construction and both runs move it by rounding noise only.
    bk = np.asarray(state.params["layers"]["attn"]["bk"][...])
    assert np.max(np.abs(bk)) < 1e-9


def _without_key_bias(params):
    pure = nnx.to_pure_dict(jax.device_get(params))
    del pure["layers"]["attn"]["bk"]
    return pure
