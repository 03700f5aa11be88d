"""``ShardingPlan``: per-leaf rows, bytes per device, HLO collectives, compiled memory.

Bytes are checked exactly against hand computations from the shard shapes and against the
textbook collective sizes (FSDP all-gathers the full weight; data parallelism all-reduces the
full gradient). The HLO parser is also checked on hand-written HLO text.
"""

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from shardax.hlo import COLLECTIVE_KINDS, hlo_collectives, summarize_collectives
from shardax.sharding import FSDPShardingRule, ShardingPlan, match_specs


def ones(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


def loss(w, x):
    return jnp.sum((x @ w) ** 2)


# ----------------------------------------------------------------------------- rows and bytes


def test_rows_cover_every_input_and_output_leaf(dp2_fsdp4):
    helper = dp2_fsdp4
    state = {"w": ones(16, 8), "b": ones(8, dtype=np.int32), "step": np.array(0, np.int32)}
    batch = {"x": ones(4, 16, dtype=np.float16)}

    def step(state, batch):
        h = batch["x"].astype(jnp.float32) @ state["w"] + state["b"]
        return dict(state, step=state["step"] + 1), {"h": h, "mean": h.mean()}

    f = helper.sjit(
        step,
        in_shardings=(FSDPShardingRule(min_fsdp_size=0), PS("dp")),
        out_shardings=(FSDPShardingRule(min_fsdp_size=0), {"h": PS("dp", "fsdp"), "mean": PS()}),
    )
    plan = f.plan(state, batch)
    assert isinstance(plan, ShardingPlan)
    assert plan.mesh_shape == {"dp": 2, "fsdp": 4}
    inputs = {r.path: r for r in plan.rows if r.kind == "input"}
    outputs = {r.path: r for r in plan.rows if r.kind == "output"}
    assert set(inputs) == {"state/w", "state/b", "state/step", "batch/x"}
    assert len(outputs) == 5 and all(p.startswith("output") for p in outputs)
    assert any(p.endswith("h") for p in outputs) and any(p.endswith("mean") for p in outputs)

    w, b, step_row, x = (inputs[p] for p in ("state/w", "state/b", "state/step", "batch/x"))
    assert (w.shape, w.dtype, w.bytes_per_device) == ((16, 8), "float32", 16 // 4 * 8 * 4)
    assert "fsdp" in w.spec
    assert (b.shape, b.dtype, b.bytes_per_device) == ((8,), "int32", 8 // 4 * 4)
    assert (step_row.shape, step_row.bytes_per_device) == ((), 4)
    assert (x.shape, x.dtype, x.bytes_per_device) == ((4, 16), "float16", 4 // 2 * 16 * 2)
    assert "dp" in x.spec
    (h,) = [r for p, r in outputs.items() if p.endswith("h")]
    assert (h.shape, h.bytes_per_device) == ((4, 8), 4 * 8 * 4 // 8)

    # Argument bytes are the sum over inputs of what one device holds, from the shard shapes.
    shardings = [
        NamedSharding(helper.mesh, PS("fsdp", None)),
        NamedSharding(helper.mesh, PS("fsdp")),
        NamedSharding(helper.mesh, PS()),
        NamedSharding(helper.mesh, PS("dp")),
    ]
    arrays = [state["w"], state["b"], state["step"], batch["x"]]
    by_hand = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize for s, a in zip(shardings, arrays)
    )
    assert plan.argument_bytes_per_device == by_hand == 128 + 8 + 4 + 64
    assert plan.output_bytes_per_device == sum(outputs[p].bytes_per_device for p in outputs)
    assert plan.memory["argument_size_in_bytes"] == plan.argument_bytes_per_device

    text = str(plan)
    for path in inputs:
        assert path in text
    assert "dp=2" in text and "fsdp=4" in text
    data = json.loads(plan.to_json())
    assert data["argument_bytes_per_device"] == by_hand
    assert len(data["rows"]) == 9


def test_plan_accepts_kwargs_and_shape_structs(fsdp8):
    f = fsdp8.sjit(lambda x, *, scale: x * scale, in_shardings=(PS("fsdp"),))
    plan = f.plan(jax.ShapeDtypeStruct((16, 2), jnp.float32), scale=ones(2))
    rows = {r.path: r for r in plan.rows if r.kind == "input"}
    assert rows["x"].bytes_per_device == 2 * 2 * 4
    assert rows["scale"].bytes_per_device == 2 * 4


def test_host_float64_inputs_are_counted_as_what_the_device_holds(fsdp8):
    f = fsdp8.sjit(lambda x, s: x * s, in_shardings=(PS("fsdp"), None))
    plan = f.plan(np.ones(8, np.float64), 2.0)
    rows = {r.path: r for r in plan.rows if r.kind == "input"}
    assert rows["x"].dtype == "float32" and rows["x"].bytes_per_device == 4
    assert rows["s"].bytes_per_device == 4
    assert plan.argument_bytes_per_device == plan.memory["argument_size_in_bytes"]


# ----------------------------------------------------------------------------- collectives


def test_fsdp_matmul_all_gathers_the_full_weight(fsdp8):
    w, x = ones(16, 8), ones(8, 16)  # w: 512 bytes, 64 per device
    f = fsdp8.sjit(
        lambda w, x: x @ w, in_shardings=(PS("fsdp", None), PS("fsdp")), out_shardings=PS("fsdp")
    )
    plan = f.plan(w, x)
    assert set(plan.collectives) == set(COLLECTIVE_KINDS)
    gather = plan.collectives["all-gather"]
    assert gather.count == 1
    assert gather.bytes == w.nbytes
    assert "all-gather" in str(plan)
    np.testing.assert_array_equal(f(w, x), x @ w)


def test_data_parallel_gradient_all_reduces_the_gradient(dp8):
    w, x = ones(16, 8), ones(8, 16)
    f = dp8.sjit(jax.grad(loss), in_shardings=(PS(), PS("dp")), out_shardings=PS())
    plan = f.plan(w, x)
    reduce = plan.collectives["all-reduce"]
    assert reduce.count == 1
    assert reduce.bytes == w.nbytes  # the full float32 gradient of w
    assert plan.collectives["all-gather"].count == 0
    np.testing.assert_allclose(f(w, x), jax.jit(jax.grad(loss))(w, x), rtol=1e-6)


@pytest.mark.parametrize("kind, steps", [("fori_loop", 5), ("scan", 3)])
def test_collectives_in_a_loop_are_counted_per_iteration(dp8, kind, steps):
    def descend(w, x):
        update = lambda c: c - 1e-3 * jax.grad(loss)(c, x)  # the carry feeds the all-reduce
        if kind == "fori_loop":
            return jax.lax.fori_loop(0, steps, lambda i, c: update(c), w)
        return jax.lax.scan(lambda c, _: (update(c), None), w, None, length=steps)[0]

    w, x = ones(16, 8), ones(8, 16) / 16
    f = dp8.sjit(descend, in_shardings=(PS(), PS("dp")), out_shardings=PS())
    plan = f.plan(w, x)
    reduce = plan.collectives["all-reduce"]
    assert reduce.count == steps
    assert reduce.bytes == steps * w.nbytes
    assert [op.multiplier for op in plan.collective_ops] == [steps]
    np.testing.assert_allclose(f(w, x), jax.jit(descend)(w, x), rtol=1e-5)


# ----------------------------------------------------------------------------- the HLO parser

HLO = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[32,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], f32[32,8])) -> (s32[], f32[32,8]) {
  %p = (s32[], f32[32,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[32,8]{1,0} get-tuple-element(%p), index=1
  %ar = f32[32,8]{1,0} all-reduce(%v), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %cp = f32[32,8]{1,0} collective-permute(%ar), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[32,8]{1,0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[32,8])) -> pred[] {
  %p = (s32[], f32[32,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (w: f32[4,8]) -> f32[32,8] {
  %w = f32[4,8]{1,0} parameter(0)
  %ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%w), dimensions={0}
  %agd = f32[32,8]{1,0} all-gather-done(%ags)
  %rs = f32[4,8]{1,0} reduce-scatter(%agd), dimensions={0}, to_apply=%add
  %z = s32[] constant(0)
  %init = (s32[], f32[32,8]{1,0}) tuple(%z, %agd)
  %loop = (s32[], f32[32,8]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = f32[32,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_hlo_parser_counts_async_pairs_once_and_multiplies_loop_bodies():
    ops = hlo_collectives(HLO)
    stats = summarize_collectives(ops)
    full = 32 * 8 * 4
    assert stats["all-gather"].count == 1 and stats["all-gather"].bytes == full
    assert stats["reduce-scatter"].count == 1 and stats["reduce-scatter"].bytes == full
    assert stats["all-reduce"].count == 7 and stats["all-reduce"].bytes == 7 * full
    assert stats["collective-permute"].count == 7
    assert stats["collective-permute"].bytes == 7 * full
    assert stats["all-to-all"].count == 0 and stats["all-to-all"].bytes == 0


def test_hlo_parser_without_trip_count_counts_once():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
    assert "known_trip_count" not in text
    stats = summarize_collectives(hlo_collectives(text))
    assert stats["all-reduce"].count == 1


def test_unused_inputs_are_rows_with_no_bytes(fsdp8):
    """jax.jit prunes unused arguments; the plan keeps every row aligned with its input."""
    f = fsdp8.sjit(lambda state, x: x * 2, in_shardings=(FSDPShardingRule(min_fsdp_size=0), None))
    state = {"a": np.ones((8, 4), np.float32), "b": np.ones((16,), np.float32)}
    plan = f.plan(state, np.ones((8, 2), np.float32))
    rows = {r.path: r for r in plan.rows if r.kind == "input"}
    assert rows["state/a"].spec == "unused" and rows["state/a"].bytes_per_device == 0
    assert rows["state/b"].spec == "unused"
    assert rows["x"].shape == (8, 2) and rows["x"].bytes_per_device > 0
    assert plan.argument_bytes_per_device == plan.memory["argument_size_in_bytes"]


def _eqx_params():
    import equinox as eqx

    class Layer(eqx.Module):
        weight: np.ndarray
        activation: Any  # a function: None in the array half
        width: int  # a Python int: None in the array half (eqx.is_array)

    layers = [Layer(ones(3), jnp.tanh, 3), Layer(ones(16, 8), jax.nn.relu, 8)]
    return eqx.partition(layers, eqx.is_array)[0]


@pytest.mark.parametrize("params", [
    {"a": None, "b": ones(16, 8), "c": ones(3)},  # None first (the rows used to shift)
    {"a": ones(16, 8), "b": None, "c": ones(3)},  # None in the middle
    {"a": ones(3), "b": ones(16, 8), "c": None},  # None last (rows used to stop short)
    {"a": {}, "b": (), "c": [], "d": ones(16, 8), "e": [ones(3), ()]},  # empty containers
    "eqx.partition",  # nested None subtrees: an Equinox module's non-array half
    {"lr": 0.5, "w": ones(16, 8)},  # a Python number: a dynamic scalar leaf
], ids=["none-first", "none-middle", "none-last", "empty", "eqx-partition", "python-number"])
def test_plan_rows_line_up_with_every_input_leaf(fsdp8, params):
    """One row per array leaf, in order, with that leaf's own shape and rule-given spec,
    whatever None subtrees or empty containers sit between the leaves."""
    params = _eqx_params() if params == "eqx.partition" else params
    rule = FSDPShardingRule(min_fsdp_size=0)

    def step(p, x):
        return x * sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(p))

    x = ones(8)
    plan = fsdp8.sjit(step, in_shardings=(rule, None)).plan(params, x)
    leaves = jax.tree_util.tree_leaves((params, x))
    want_specs = jax.tree_util.tree_leaves(match_specs((rule, PS()), (params, x), fsdp8.mesh),
                                           is_leaf=lambda s: isinstance(s, PS))
    rows = [r for r in plan.rows if r.kind == "input"]
    assert [r.shape for r in rows] == [np.shape(leaf) for leaf in leaves]
    assert [r.path for r in rows][-1] == "x"
    assert [r.spec for r in rows] == [
        "replicated" if not any(s) else str(tuple(s) + (None,) * (len(r.shape) - len(s)))
        for s, r in zip(want_specs, rows)]
    assert plan.argument_bytes_per_device == plan.memory["argument_size_in_bytes"]
