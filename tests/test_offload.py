"""Optimizer state in host memory (``HostOffloadRule``, ``--offload-optimizer``): the same
training, bit for bit, with the state placed in ``pinned_host``; checkpoints save and resume
it; ``shardax plan`` counts it as host memory, not in the device peak."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import TINY_TRAIN
from jax.sharding import PartitionSpec as P

from shardax.mesh import MeshShardingHelper
from shardax.plan.estimate import compile_config
from shardax.rules import FSDPShardingRule, HostOffloadRule
from shardax.train.config import check
from shardax.train.loop import TrainConfig, train
from shardax.train.resolve import resolve
from shardax.train.run import fingerprint
from shardax.train.run.fingerprint import fingerprints

MESH = "fsdp=4,tp=2"


def _config(out, **overrides) -> TrainConfig:
    return TrainConfig(out=str(out), **{**TINY_TRAIN, "mesh": MESH, "optimizer": "adamw",
                                        "steps": 5, **overrides})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 5-step AdamW run with the optimizer state on the device and on the host."""
    root = tmp_path_factory.mktemp("offload")
    return {off: (train(check(_config(root / str(off), offload_optimizer=off))),
                  root / str(off))
            for off in (False, True)}


def test_host_offload_rule_places_leaves_in_pinned_host():
    mesh = MeshShardingHelper([8], ["fsdp"])
    tree = {"w": jnp.zeros((16, 4)), "m": jnp.zeros((16, 4))}
    rules = {"w": FSDPShardingRule(min_fsdp_size=0),
             "m": HostOffloadRule(FSDPShardingRule(min_fsdp_size=0))}
    shardings = mesh.match_sharding_rule(rules, tree)
    assert shardings["m"].memory_kind == "pinned_host" and shardings["m"].spec == P("fsdp", None)
    assert shardings["w"].memory_kind in (None, "device")
    out = mesh.sjit(lambda t: jax.tree.map(lambda x: x + 1, t), out_shardings=rules)(tree)
    assert out["m"].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(out["m"], np.ones((16, 4)))


def test_offloaded_optimizer_trains_bit_identically(runs):
    (on_device, _), (on_host, _) = runs[False], runs[True]
    losses = [[r["loss"] for r in records if "loss" in r] for records in (on_device, on_host)]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def test_offloaded_optimizer_is_host_memory_in_the_run_plan(runs):
    plans = {off: json.loads((out / "plan.json").read_text()) for off, (_, out) in runs.items()}
    host = plans[True]["memory"]["host_argument_size_in_bytes"]
    opt_rows = [r for r in plans[True]["rows"] if r["kind"] == "input"
                and r["path"].startswith("state/opt_state")]
    assert opt_rows and all(r["memory_kind"] == "pinned_host" for r in opt_rows)
    assert host == sum(r["bytes_per_device"] for r in opt_rows) > 0
    device = {off: p["memory"]["argument_size_in_bytes"] for off, p in plans.items()}
    assert device[False] - device[True] == host


def test_offloaded_run_resumes_bit_identically(runs, tmp_path):
    """The host-offloaded run stopped after its step-2 checkpoint (the checkpoint holds the
    host state) and resumed equals the straight run."""
    straight, out = runs[True]
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy)
    for step_dir in (copy / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > 2:
            shutil.rmtree(step_dir)
    resumed = train(check(_config(copy, offload_optimizer=True, resume=True)))
    by_step = [{r["step"]: r["loss"] for r in rec if "loss" in r} for rec in (straight, resumed)]
    assert [by_step[1][k] for k in (3, 4, 5)] == [by_step[0][k] for k in (3, 4, 5)]


def test_plan_subtracts_offloaded_state_from_the_device_peak():
    base = _config(Path("unused"), steps=1)
    peaks = {}
    for off in (False, True):
        compiled = compile_config(resolve(check(_config(Path("unused"), steps=1,
                                                        offload_optimizer=off))))
        peaks[off] = (compiled.peak_bytes, compiled.memory.get("host_argument_size_in_bytes", 0))
    assert base.optimizer == "adamw"
    assert peaks[True][1] > 0 and peaks[False][1] == 0
    assert peaks[False][0] - peaks[True][0] >= peaks[True][1]  # arguments and outputs alike


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float64"])
def test_numpy_fingerprint_equals_the_compiled_one(dtype):
    """A checkpoint's leaf fingerprints are the same whichever way a leaf is hashed: with numpy
    from this process's shards (leaves in host memory, small leaves on CPU) or by the compiled
    program (device leaves), sharded or replicated."""
    mesh = MeshShardingHelper([4, 2], ["fsdp", "tp"])
    values = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32) * 100
    x = jnp.asarray(values, dtype=jnp.dtype(dtype)) if dtype != "float64" else values
    device = jax.sharding.NamedSharding(mesh.mesh, P("fsdp", "tp"))
    tree = {"a": jax.device_put(x, device), "b": jax.device_put(x[:, :1], device.with_memory_kind(
        "device").update(spec=P("fsdp")))}
    on_host = jax.tree.map(lambda v: jax.device_put(v, v.sharding.with_memory_kind(
        "pinned_host")), tree)
    compiled = {k: fingerprint._compiled_sum(v) for k, v in tree.items()}
    assert {k: fingerprint._local_sum(v) for k, v in tree.items()} == compiled
    assert fingerprints(on_host) == fingerprints(tree) == compiled
