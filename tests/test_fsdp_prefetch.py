"""Explicit FSDP's prefetched layer loop (`shardax.parallel.fsdp.loop_layers(prefetch=True)`,
full remat): the compiled program gathers layer i + 1 before layer i computes (forward) and
re-gathers layer i - 1 before layer i's backward, and the loss and gradients equal one device;
5 SGD steps of the llama train step with list layers and ``remat='full'`` (the CLI's path,
which does not prefetch) equal one device too.

The layers have different widths, so the shapes in the compiled HLO name the layer of each
dot, and of each all-gather by its size (a layer's split weights move in one all-gather of their
shards flattened: 2·D·width/8 elements per device); the scheduled HLO lists the entry
computation in execution order.
Tolerances: as `test_parallel_fsdp` (the same math, summed in another order).
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
from jax.sharding import PartitionSpec as P

from shardax import layout, models
from shardax.mesh import MeshShardingHelper
from shardax.parallel import fsdp
from shardax.rules import LogicalAxisRules
from shardax.train.config import TrainConfig, check
from shardax.train.resolve import resolve
from shardax.train.step import train_step

D, V, B, S = 16, 32, 16, 8
WIDTHS = (24, 40, 56)  # one per layer: no other dim of the program has these sizes
BUCKETS = tuple(2 * D * h // 8 for h in WIDTHS)  # a layer's gathered shards: 96, 160, 224


def _toy(tp=False):
    k = jax.random.split(jax.random.key(0), 3 + 2 * len(WIDTHS))
    layers = [{"w1": jax.random.normal(k[3 + 2 * i], (D, h)) * 0.3, "b": jnp.zeros((h,)),
               "w2": jax.random.normal(k[4 + 2 * i], (h, D)) * 0.3}
              for i, h in enumerate(WIDTHS)]
    params = {"embed": jax.random.normal(k[0], (V, D)) * 0.3, "layers": layers}
    # With 'tp': a tensor-parallel weight, which moves over 'fsdp' alone (in permute rings).
    specs = {"embed": P(None, "fsdp"),
             "layers": [{"w1": P("tp" if tp else None, "fsdp"), "b": P(),
                         "w2": P("fsdp", None)} for _ in WIDTHS]}
    tokens = jax.random.randint(k[1], (B, S), 0, V)
    targets = jax.random.randint(k[2], (B, S), 0, V)
    return params, specs, tokens, targets


@pytest.fixture(scope="module")
def one_device():
    params, specs, tokens, targets = _toy()
    with jax.default_device(jax.devices()[0]):  # no 'fsdp' axis: the plain value and grad
        return jax.jit(lambda p, a, b: fsdp.value_and_grad(_loss, p, specs, a, b))(
            params, tokens, targets)


def _sharded(shape, names):
    params, specs, tokens, targets = _toy(tp="tp" in names)
    fn = jax.jit(lambda p, a, b: fsdp.value_and_grad(_loss, p, specs, a, b))
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    with jax.set_mesh(mesh):
        compiled = fn.lower(params, tokens, targets).compile()
        return compiled(params, tokens, targets), compiled.as_text()


def _assert_equal(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), got[1], want[1])


def _loss(gather, params, tokens, targets):
    table = gather(params["embed"])
    scale = jnp.arange(S, dtype=jnp.float32) / S  # a traced value the layers close over
    x = fsdp.loop_layers(
        gather, lambda p, h: h + jnp.tanh(h @ p["w1"] + p["b"]) @ p["w2"] * scale[:, None],
        params["layers"], table[tokens], prefetch=True)
    logits = x @ table.T
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def _entry_order(hlo: str) -> list[tuple[str, int]]:
    """The entry computation's all-gathers and dot-holding instructions in scheduled order,
    as ``(kind, layer)``: the layer read from the widths among the shapes involved."""
    bodies = {m.group(1): m.group(2) for m in
              re.finditer(r"^%?([\w.\-]+) .*\{\n(.*?)\n\}", hlo, re.M | re.S)}
    entry = re.search(r"^ENTRY .*\{\n(.*?)\n\}", hlo, re.M | re.S).group(1)
    out = []
    for line in entry.splitlines():
        called = "".join(bodies.get(c, "") for c in re.findall(r"calls=%?([\w.\-]+)", line))
        text = line + called
        kind = "gather" if " all-gather(" in line else "dot" if " dot(" in text else None
        dims = {int(d) for shape in re.findall(r"\[([\d,]+)\]", text) for d in shape.split(",")}
        sizes = BUCKETS if kind == "gather" else WIDTHS
        layers = [i for i, h in enumerate(sizes) if h in dims]
        if kind and len(layers) == 1:
            out.append((kind, layers[0]))
    return out


def test_gathers_are_prefetched_and_values_equal_one_device(one_device):
    got, hlo = _sharded((8,), ("fsdp",))
    _assert_equal(got, one_device)
    order = _entry_order(hlo)
    gathers = {i: [k for k, e in enumerate(order) if e == ("gather", i)] for i in range(3)}
    dots = {i: [k for k, e in enumerate(order) if e == ("dot", i)] for i in range(3)}
    # A layer's two split weights in one all-gather: in the forward and in the backward.
    assert all(len(g) == 2 for g in gathers.values()), order
    for i in range(2):  # forward: layer i + 1 gathered before layer i's first dot
        assert gathers[i + 1][0] < dots[i][0], order
    for i in (1, 2):  # backward: layer i - 1 re-gathered before layer i's backward dots
        backward = [k for k in dots[i] if k > gathers[i][1]]
        assert backward and gathers[i - 1][1] < backward[0], order


def test_prefetched_loop_with_hsdp_and_tp_equals_one_device(one_device):
    _assert_equal(_sharded((2, 2, 2), ("dp", "fsdp", "tp"))[0], one_device)


def test_llama_list_layers_full_remat_five_sgd_steps_equal_one_device():
    config = dataclasses.replace(models.CONFIGS["llama-tiny"], n_layers=2)
    # A loop over the stack's slices (`fsdp.loop_layers`); the default layout scans them.
    full = layout.Layout(remat="full", scan_layers=False)
    tokens = jax.random.randint(jax.random.key(3), (5, 16, 17), 0, config.vocab_size)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    tx = optax.sgd(0.1)
    want = train_one_device(config, tx, batches, layout=full)
    mesh = MeshShardingHelper.from_string("fsdp=8")
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    graphdef, state = init_train_state(config, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             layout=dataclasses.replace(full, fsdp_mode="explicit")),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=2e-5, atol=0)
    assert_trained_alike(state.params, want.state.params, want.start, steps=5,
                         optimizer="sgd")


def test_banner_states_what_the_cli_runs():
    run = resolve(check(TrainConfig(mesh="fsdp=8", batch_size=8, remat="full")))
    assert "forward recomputed in the backward pass (each layer re-gathered)" in \
        run.fsdp_summary(), run.fsdp_summary()
    assert "prefetched" not in run.fsdp_summary()  # the CLI does not prefetch
    kept = resolve(check(TrainConfig(mesh="fsdp=8", batch_size=8,
                                     fsdp_mode="explicit"))).fsdp_summary()
    assert "prefetched" not in kept and "kept from forward to backward" in kept, kept
