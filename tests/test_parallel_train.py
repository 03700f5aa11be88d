"""`shardax train` with explicit parallelism: every strategy trains like one device.

Each case runs `train(TrainConfig(...))` in-process on 8 devices with plain SGD (a wrong
gradient shows in the next loss) and compares its first losses with the same model trained on
one device: `train_step` jitted without a mesh on `jax.devices()[0]`, where every
`shardax.parallel` block falls back to single-device math. The dense reference is the plain
`llama-tiny` (no parallelism options at all), so the check is "the parallel program equals the
ordinary model". The compiled step of each run (recorded from `sjit.plan`) is then read for
the collectives its strategy must produce. Bad flag combinations exit with code 2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import TINY_TRAIN, train_one_device
from flax import nnx

from shardax import layout, models
from shardax.cli import main
from shardax.jit import ShardedFunction
from shardax.train.loop import TrainConfig, prepare, train

STEPS = 5  # issue 4: the first 5 losses match one device
TINY = {**TINY_TRAIN, "steps": STEPS, "lr": 0.05, "ckpt_every": 100}
# float32, same math in another reduction order (row-parallel sums, ring softmax, pipeline).
RTOL = 2e-5


def _config(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / "run"), **{**TINY, **overrides})


def _reference_losses(model: str, tmp_path) -> list[float]:
    """SGD losses of ``model`` trained on one device with no mesh: the plain program (packed
    documents, as ``--pack documents``, the default, trains)."""
    prepared = prepare(TrainConfig(**{**TINY, "model": model, "mesh": "dp=-1",
                                      "out": str(tmp_path / "ref")}))
    run = prepared.run
    batches = [prepared.inputs.train.batch(i) for i in range(STEPS)]
    return train_one_device(run.model_config, run.tx, batches, seed=run.config.seed,
                            policy=run.policy, end_id=prepared.inputs.tokenizer.eos_id).losses


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    return _reference_losses("llama-tiny", tmp_path_factory.mktemp("dense_ref"))


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _reference_losses("llama-moe-tiny", tmp_path_factory.mktemp("moe_ref"))


def _train(tmp_path, monkeypatch, **overrides):
    """Losses of a real `train` run, and the `ShardingPlan` of its compiled train step."""
    plans = []
    plan = ShardedFunction.plan

    def record(self, *args, **kwargs):
        plans.append(plan(self, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(ShardedFunction, "plan", record)
    records = train(_config(tmp_path, **overrides))
    losses = [r["loss"] for r in records if "loss" in r][:STEPS]
    assert len(losses) == STEPS and len(plans) == 1
    return losses, plans[0]


def _ops(plan, kind, shape=None):
    """Collectives of one kind, optionally only those whose HLO result type has ``shape``."""
    ops = [op for op in plan.collective_ops if op.kind == kind]
    if shape is None:
        return ops
    return [op for op in ops if _has_shape(plan.hlo, op.name, shape)]


def _has_shape(hlo: str, name: str, shape: tuple[int, ...]) -> bool:
    return f"[{','.join(map(str, shape))}]" in _result_types(hlo).get(name, "")


@functools.cache
def _result_types(hlo: str) -> dict[str, str]:
    """Each named HLO instruction's result type: ``%name = TYPE op(...)`` -> ``{name: TYPE}``."""
    types = {}
    for line in hlo.splitlines():
        name, eq, rest = line.strip().removeprefix("ROOT ").partition(" = ")
        if eq and name.startswith("%"):
            types.setdefault(name[1:], rest.split("(", 1)[0])
    return types


def _count(ops) -> int:
    return sum(op.multiplier for op in ops)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)


# ----------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_pipeline_fsdp_tp_matches_one_device(schedule, dense_reference, tmp_path, monkeypatch,
                                            capsys):
    extra = dict(virtual_stages=2) if schedule == "circular" else {}
    losses, plan = _train(tmp_path, monkeypatch, mesh="pp=2,fsdp=2,tp=2", pp_schedule=schedule,
                          microbatches=2, **extra)
    _close(losses, dense_reference)
    # The run reports its schedule's bubble: (P-1)/(M+P-1), or (P-1)/(V*M+P-1) for circular.
    bubble = "20.0%" if schedule == "circular" else "33.3%"
    out = capsys.readouterr().out
    assert f"pipeline: {schedule} over 2 stages, 2 microbatches" in out
    assert f"bubble {bubble} of each step" in out
    # Stage to stage: one permute per pipeline step forward and one backward, of one
    # microbatch's activations [stage, B/M/fsdp, s, dim] = [1, 2, 32, 64] (plus its RoPE tables).
    # 1f1b sends as many, interleaved: forwards in M + P - 1 steps, backwards in M + P - 1.
    v = 2 if schedule == "circular" else 1
    steps = v * 2 + 2 - 1
    permutes = _ops(plan, "collective-permute", (1, 2, 32, 64))
    # (1f1b's very last backward send, from stage 1 to nobody, is dead code XLA removes.)
    want = 2 * steps - (schedule == "1f1b")
    assert _count(permutes) == want, [(op.name, op.multiplier) for op in permutes]


# Explicit blocks inside the pipeline: each stage runs K = 2 of the 4 layers per step for
# M + P - 1 = 3 steps (6 layer steps), each three times (forward, recomputed forward, backward).
PP_LAYER_RUNS = 6 * 3


def test_pipeline_with_async_tensor_parallel(dense_reference, tmp_path, monkeypatch):
    losses, plan = _train(tmp_path, monkeypatch, mesh="pp=2,fsdp=2,tp=2", tp_mode="async",
                          microbatches=2)
    _close(losses, dense_reference)
    # Collective matmul inside each stage: per layer run 4 rings of tp - 1 = 1 hop of a
    # [stage, B/M/fsdp, s/tp, dim] = [1, 2, 16, 64] chunk.
    assert _count(_ops(plan, "collective-permute", (1, 2, 16, 64))) == PP_LAYER_RUNS * 4


def test_pipeline_with_sequence_parallel_circular(dense_reference, tmp_path, monkeypatch):
    losses, _ = _train(tmp_path, monkeypatch, mesh="pp=2,fsdp=2,tp=2", tp_mode="sync",
                       sequence_parallel=True, pp_schedule="circular", virtual_stages=2,
                       microbatches=2)
    _close(losses, dense_reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_with_ring_attention(schedule, dense_reference, tmp_path, monkeypatch):
    losses, plan = _train(tmp_path, monkeypatch, mesh="pp=2,cp=2,fsdp=2", microbatches=2,
                          pp_schedule=schedule)
    _close(losses, dense_reference)
    # Ring attention inside each stage, blocks [stage, B/M/fsdp, s/cp, kv_heads, head_dim] =
    # [1, 2, 16, 2, 16]; per layer and step cp - 1 = 1 hop of K and V in the forward and again
    # in the recomputed forward, and in the backward one hop of K, V, dK, dV plus dK, dV home.
    # 1f1b runs the same layer passes (M + P - 1 forward steps, M + P - 1 backward steps), but
    # its recomputed forward sits next to the backward with no remat barrier between them, so
    # XLA shares the first K, V hop between the two (as in the unpipelined case).
    per_layer_step = 2 + 2 + 6 if schedule == "gpipe" else 2 + 6
    assert _count(_ops(plan, "collective-permute", (1, 2, 16, 2, 16))) == 6 * per_layer_step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_with_experts(schedule, moe_reference, tmp_path, monkeypatch):
    # One microbatch: the load-balancing loss and expert capacity see the whole batch, as in
    # the reference (with M > 1 they are per microbatch, like gradient accumulation). Under
    # 1f1b the pipeline differentiates cross-entropy + weight x load-balancing loss per
    # microbatch and reports the cross-entropy beside it (Llama.training_loss).
    losses, plan = _train(tmp_path, monkeypatch, model="llama-moe-tiny", mesh="pp=2,ep=2,fsdp=2",
                          microbatches=1, pp_schedule=schedule)
    _close(losses, moe_reference)
    # Dispatch and combine all-to-all per layer run (forward, recomputed forward, backward:
    # 3 x 2) for each of a stage's 2 layers in M + P - 1 = 2 steps; the same for both schedules;
    # plus the embedding lookup's two (forward and backward: rows move over 'fsdp', not the
    # table; shardax.models.embedding).
    assert _count(_ops(plan, "all-to-all")) == 2 * 2 * 3 * 2 + 2


def test_async_tensor_parallel_matches_one_device(dense_reference, tmp_path, monkeypatch):
    # 4 heads / 2 kv heads on tp=8: each head is repeated on tp/heads devices.
    losses, plan = _train(tmp_path, monkeypatch, mesh="tp=8", tp_mode="async")
    _close(losses, dense_reference)
    # Collective matmul: per layer 4 rings (QKV and MLP-in all-gather, out and MLP-out
    # reduce-scatter) of tp - 1 = 7 hops of a [b, s/tp, dim] = [8, 4, 64] chunk, forward and
    # backward: 4 layers x 4 x 7 x 2 = 224; plus, packing documents (--pack documents) on a
    # sequence split over 'tp', one hop of the end-of-text flags (pred) to the next device: a
    # document starts after an end-of-text that may sit on the previous device.
    permutes = _ops(plan, "collective-permute")
    assert _count(permutes) == 224 + 1
    assert [op.dtype for op in permutes if op.dtype == "pred"] == ["pred"]
    assert _count(_ops(plan, "collective-permute", (8, 4, 64))) == 224
    # No all-gather of the activations inside the layers (the full [b, s, dim] gathers are
    # the final norm's output going into the vocabulary-parallel head, as in Megatron-SP, and
    # the vocabulary-parallel embedding's backward: its forward reduce-scatters the looked-up
    # rows over the sequence split, so the rows' gradient is all-gathered back;
    # shardax.models.embedding).
    assert _count(_ops(plan, "all-gather", (8, 32, 64))) <= 2


def test_sequence_parallel_matches_one_device(dense_reference, tmp_path, monkeypatch):
    losses, plan = _train(tmp_path, monkeypatch, mesh="fsdp=4,tp=2", sequence_parallel=True)
    _close(losses, dense_reference)
    # Megatron-SP: per layer 2 all-gathers of [b/fsdp, s, dim] = [2, 32, 64] in front of the
    # column-parallel matmuls and 2 reduce-scatters to [2, s/tp, dim] = [2, 16, 64] after the
    # row-parallel ones; the backward swaps them. The CPU backend emits reduce-scatter only
    # when asked to, so every one of them is a TP block's: 4 layers x (2 + 2) = 16, plus the
    # vocabulary-parallel embedding's (its looked-up rows reduce-scattered onto the sequence
    # split; shardax.models.embedding). One more all-gather takes the final norm's output into
    # the vocabulary-parallel head, one the embedding's row gradient back (its backward).
    assert _count(_ops(plan, "reduce-scatter")) == 16 + 1
    assert _count(_ops(plan, "reduce-scatter", (2, 16, 64))) == 16 + 1
    assert _count(_ops(plan, "all-gather", (2, 32, 64))) == 16 + 1 + 1


def test_context_parallel_matches_one_device(dense_reference, tmp_path, monkeypatch):
    losses, plan = _train(tmp_path, monkeypatch, mesh="cp=4,fsdp=2")
    _close(losses, dense_reference)
    # Ring attention, per layer: forward cp - 1 = 3 hops of a K and a V block
    # [b/fsdp, s/cp, kv_heads, d] = [4, 8, 2, 16] (6); backward (custom VJP) 3 hops of K, V,
    # dK, dV and one more of dK, dV to their owner (14). The layers are scanned (the
    # default), so the backward's loop cannot share its first K, V send with the forward's
    # (an unrolled stack does: 4 x (6 + 12) = 72): 4 layers x (6 + 14) = 80.
    assert _count(_ops(plan, "collective-permute", (4, 8, 2, 16))) == 80


def test_moe_expert_parallel_matches_one_device(moe_reference, tmp_path, monkeypatch):
    losses, plan = _train(tmp_path, monkeypatch, model="llama-moe-tiny", mesh="ep=4,fsdp=2")
    _close(losses, moe_reference)
    # Dispatch and combine all-to-all per layer, forward and backward: 4 layers x 4 = 16; plus
    # the embedding lookup's two (forward and backward: the rows move over 'fsdp', not the
    # table; shardax.models.embedding).
    assert _count(_ops(plan, "all-to-all")) == 16 + 2


def test_sync_tensor_parallel_block_is_megatron():
    """One decoder layer, tp_mode='sync' on (dp=4, tp=2): the same values and gradients as
    on one device, and exactly Megatron's 2 all-reduces forward (attention out, MLP out) and 2
    more backward (the gradients of the column-parallel inputs)."""
    from jax.sharding import AxisType

    from shardax.layout.blocks import llama_block
    from shardax.models.attention import attention
    from shardax.models.llama import Block, rope_tables
    from shardax.rules import LogicalAxisRules

    cfg = models.get_config("llama-tiny")
    block = Block(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.dim))
    cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(16), (8, 16)), cfg.head_dim, 1e4)

    def plain(block, x):
        y, _ = block(x, cos, sin)
        return jnp.sum(jnp.sin(y))

    def loss(block, x):
        y, _ = llama_block(block, x, {"cos": cos, "sin": sin}, attention,
                           layout.Layout(tp_mode="sync"))
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))
    (want, (want_block, want_x)) = grad(block, x)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    with jax.set_mesh(mesh), models.use_logical_rules(rules):
        fresh = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        got, (got_block, got_x) = fresh(block, x)
        hlo = fresh.lower(block, x).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(got_block)), jax.tree.leaves(nnx.state(want_block))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    activation_reduces = [line for line in hlo.splitlines()
                          if " all-reduce(" in line and "[2,16,64]" in line.split("=", 1)[1][:40]]
    assert len(activation_reduces) == 4, activation_reduces


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "pp=3,fsdp=-1"], "pp=3"),
    (["--mesh", "pp=2,fsdp=4", "--pp-schedule", "circular", "--virtual-stages", "4"],
     "n_layers=4 is not divisible by 'pp' size 2 x virtual stages 4"),
    (["--mesh", "fsdp=8", "--tp-mode", "async"], "needs a 'tp' mesh axis"),
    (["--mesh", "pp=2,fsdp=4", "--microbatches", "3"], "not divisible by 3 microbatches"),
    (["--mesh", "pp=2,fsdp=4", "--microbatches", "4"], "times --microbatches 4"),
    (["--model", "llama-moe-tiny", "--mesh", "ep=8"], "n_experts=4 is not divisible by 'ep'"),
    (["--mesh", "ep=8"], "needs a mixture-of-experts model"),
    (["--mesh", "pp=2,fsdp=4", "--pp-schedule", "1f1b", "--virtual-stages", "2"],
     "needs pp_schedule='circular' (1f1b has one stage per device)"),
    (["--mesh", "cp=8", "--seq-len", "24"], "2 x 'cp' size 8"),
    (["--mesh", "fsdp=4,cp=2", "--sequence-parallel"], "needs a 'tp' mesh axis"),
    (["--mesh", "fsdp=8", "--microbatches", "2"], "need a 'pp' mesh axis"),
    (["--mesh", "xy=8"], "unknown axes ['xy']"),
    (["--model", "gpt2-tiny", "--mesh", "ep=2,fsdp=4"], "needs a mixture-of-experts model"),
])
def test_bad_combinations_exit_2(flags, message, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--batch-size", "8", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_check_mesh_and_presets():
    cfg = models.get_config("llama-tiny")
    with pytest.raises(ValueError, match="n_heads=4 and 'tp' size 3"):
        layout.check_mesh(cfg, layout.Layout(tp_mode="sync"), {"tp": 3}, batch_size=8,
                          seq_len=30)
    rules = layout.presets.resolve(layout.PRESETS["fsdp_tp"], {"tp": 8}, heads=4, kv_heads=2)
    names = [name for name, _ in rules]
    assert "heads" not in names and "kv_heads" not in names
    nd = layout.presets.resolve(layout.PRESETS["fsdp_tp"], {"tp": 2}, heads=4, kv_heads=2,
                                sequence_parallel=True)
    from shardax.rules import LogicalAxisRules

    spec = LogicalAxisRules(nd).spec_for
    mesh = {"ep": 2, "pp": 2, "cp": 2, "dp": 1, "fsdp": 2, "tp": 2}
    jmesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
    P = jax.sharding.PartitionSpec
    assert spec(("batch", "length", "embed"), jmesh) == P(("ep", "dp", "fsdp"), ("cp", "tp"), None)
    assert spec(("batch", "length", "mlp"), jmesh) == P(("ep", "dp", "fsdp"), "cp", "tp")
    assert spec(("layers", "embed", "mlp"), jmesh) == P("pp", "fsdp", "tp")
    assert spec(("expert", "embed", "mlp"), jmesh) == P("ep", "fsdp", "tp")


def test_moe_cross_entropy_alone_is_refused_under_1f1b():
    """Under 1f1b the pipeline differentiates one scalar per microbatch, so an MoE model's
    separate (cross-entropy, aux) cannot both carry gradients: `loss` says to use
    `training_loss`, which returns the objective (differentiable) and the cross-entropy."""
    config = models.get_config("llama-moe-tiny")
    lay = layout.Layout(pp_schedule="1f1b", pp_microbatches=2, scan_layers=True)
    mesh = jax.make_mesh((2, 4), ("pp", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = jnp.zeros((4, 16), jnp.int32)
    model = models.create(config, nnx.Rngs(0))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="use training_loss"):
            jax.eval_shape(lambda: layout.forward.loss(model, lay, tokens, tokens))
        objective, ce = jax.eval_shape(
            lambda: layout.forward.training_loss(model, lay, tokens, tokens))
    assert objective.shape == ce.shape == ()
