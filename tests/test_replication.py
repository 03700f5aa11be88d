"""Nothing is replicated silently: ``sjit`` warns once about large leaves its rules leave
replicated (``ReplicationWarning``), and a logical name that is a mesh axis means that axis.

The Flax "scale up" guide's model, annotated with mesh-axis names, is trained under a shardax
preset and compared with one device (SGD, 5 steps, rtol 1e-5).
"""

import contextlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import GuideMLP
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax
from shardax.layout import PRESETS
from shardax.rulecheck import rule_findings
from shardax.sharding import (
    FSDPShardingRule,
    LogicalAxisRules,
    MeshShardingHelper,
    ReplicationWarning,
)

RULES = LogicalAxisRules(PRESETS["fsdp_tp"])
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def data_model():
    """The Flax guide's mesh: 'data' x 'model'."""
    return MeshShardingHelper([2, 4], ["data", "model"])


def boxed(shape, names):
    return nn.LogicallyPartitioned(jnp.ones(shape, jnp.float32), names)


def total(params):
    return sum(jnp.sum(x) for x in jax.tree.leaves(params))


@contextlib.contextmanager
def no_replication_warning():
    """A block in which a ReplicationWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        yield


# ------------------------------------------------------------------- mesh-axis names as names


def test_a_mesh_axis_name_maps_to_its_axis_without_identity_rules(data_model):
    mesh = data_model.mesh
    assert RULES.spec_for((None, "model"), mesh) == P(None, "model")
    assert RULES.spec_for(("model", "embed"), mesh) == P("model", None)
    assert RULES.spec_for(("batch", "model"), mesh) == P(None, "model")  # batch: dp/fsdp absent
    # Rules that name it still win; an axis already taken stays taken.
    assert LogicalAxisRules([("model", None)]).spec_for((None, "model"), mesh) == P(None, None)
    assert LogicalAxisRules([("embed", "model")]).spec_for(("embed", "model"), mesh) == \
        P("model", None)
    assert RULES.spec_for(("model", "model"), mesh) == P("model", None)
    # A name the mesh does not have is still replicated; no mesh, no axes to map to.
    assert RULES.spec_for(("data", "model"), MeshShardingHelper([8], ["fsdp"]).mesh) == \
        P(None, None)
    assert RULES.spec_for((None, "model")) == P(None, None)


class DotReluDot(nnx.Module):
    """Flax's "Scale up on multiple devices" guide model, annotated with mesh-axis names."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)),
                            out_sharding=("model", None))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        return jnp.dot(y, self.w2[...])


def guide_step(model, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return model, loss


def test_flax_guide_model_is_sharded_on_its_mesh_axes_by_a_preset(data_model):
    """The guide's (None, 'model') / ('model', None) under PRESETS['fsdp_tp'], no identity
    rules: sharded as the guide shards it, the same numbers as one device, no warning."""
    x = np.random.RandomState(0).normal(size=(8, 16)).astype(np.float32)
    y = np.random.RandomState(1).normal(size=(8, 16)).astype(np.float32)
    with nnx.use_eager_sharding(False):
        ref_model = jax.jit(lambda: DotReluDot(16, nnx.Rngs(0)))()
    ref = jax.jit(guide_step)
    with no_replication_warning():
        model = data_model.sjit(lambda: DotReluDot(16, nnx.Rngs(0)), out_shardings=RULES,
                                warn_replicated_bytes=0)()
        step = data_model.sjit(guide_step, in_shardings=(RULES, P("data"), P("data")),
                               out_shardings=(RULES, None), warn_replicated_bytes=0)
        for _ in range(5):
            ref_model, ref_loss = ref(ref_model, x, y)
            model, loss = step(model, x, y)
            np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert model.dot1.kernel[...].sharding.spec == P(None, "model")
    assert model.w2[...].sharding.spec == P("model", None)
    assert model.w2[...].addressable_shards[0].data.shape == (4, 16)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
                 nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))


# ------------------------------------------------------------------- the replication warning


def test_unknown_logical_names_warn_once_naming_paths_names_and_rules(dp_fsdp_tp):
    params = {"emb": boxed((64, 32), ("vocabulary", "hidden")),  # names no rule knows
              "up": boxed((32, 64), ("embed", "mlp")),  # sharded: not reported
              "ln": boxed((32,), ("norm",))}  # replicated on purpose by a rule
    f = dp_fsdp_tp.sjit(total, in_shardings=(RULES,), warn_replicated_bytes=64)
    with pytest.warns(ReplicationWarning) as caught:
        f(params)
    (message,) = [str(w.message) for w in caught]
    assert "1 leaf of at least 64 B is replicated on all 8 devices" in message
    assert "params/emb/value (64x32 float32, 8.00 KiB)" in message
    assert ("logical names 'vocabulary' (dim 0) and 'hidden' (dim 1) of ('vocabulary', "
            "'hidden') are in no rule (the rules name 'batch', 'mlp', ") in message
    assert "are not mesh axes ('dp', 'fsdp', 'tp'): replicated" in message
    assert "up" not in re.sub(r"\(.*?\)", "", message.split("\n")[1])
    assert "warn_replicated_bytes=None" in message
    with no_replication_warning():  # once per function, a new signature included
        f(params)
        f(dict(params, emb=boxed((48, 32), ("vocabulary", "hidden"))))
    with pytest.warns(ReplicationWarning):  # another sjit function warns for itself
        dp_fsdp_tp.sjit(total, in_shardings=(RULES,), warn_replicated_bytes=64)(params)


def test_mesh_axis_names_the_mesh_lacks_warn(fsdp8):
    """Names written for a 'data' x 'model' mesh, run on an 'fsdp' mesh without rules for
    them: replicated, and said so."""
    params = {"w": boxed((16, 64), ("data", "model"))}
    f = fsdp8.sjit(total, in_shardings=(LogicalAxisRules([("embed", "fsdp")]),),
                   warn_replicated_bytes=1024)
    with pytest.warns(ReplicationWarning, match=r"params/w/value \(16x64 float32, 4\.00 KiB\)"
                      r": logical names 'data' \(dim 0\) and 'model' \(dim 1\) of .* are in no "
                      r"rule \(the rules name 'embed'\) and are not mesh axes \('fsdp',\)"):
        f(params)


def test_an_axis_that_divides_no_dim_warns_for_inputs_and_outputs(fsdp8):
    rule = FSDPShardingRule(min_fsdp_size=0)
    with pytest.warns(ReplicationWarning, match=r"params/odd \(9x7 float32, 252 B\): "
                      "FSDPShardingRule: no dim of shape \\(9, 7\\) divides by 'fsdp'"):
        fsdp8.sjit(total, in_shardings=(rule,), warn_replicated_bytes=200)(
            {"odd": np.ones((9, 7), np.float32), "ok": np.ones((8, 7), np.float32)})
    # An init function's outputs: the rules resolve against what it returns.
    init = fsdp8.sjit(lambda: {"odd": jnp.ones((9, 7))}, out_shardings=rule,
                      warn_replicated_bytes=200)
    with pytest.warns(ReplicationWarning, match="output/odd "):
        init()


def test_silencing_and_the_default_threshold(fsdp8):
    params = {"odd": np.ones((9, 7), np.float32)}
    rule = FSDPShardingRule(min_fsdp_size=0)
    with no_replication_warning():
        fsdp8.sjit(total, in_shardings=(rule,), warn_replicated_bytes=None)(params)
        fsdp8.sjit(total, in_shardings=(rule,))(params)  # 252 B: under the default 1 MiB
        fsdp8.sjit(total, in_shardings=(rule,), warn_replicated_bytes=253)(params)
        fsdp8.sjit(total, in_shardings=(P(),), warn_replicated_bytes=0)(params)  # asked for
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=shardax.ReplicationWarning)
        fsdp8.sjit(total, in_shardings=(rule,), warn_replicated_bytes=0)(params)
    assert not [w for w in caught if issubclass(w.category, ReplicationWarning)]


def test_a_correctly_ruled_nnx_model_does_not_warn(dp_fsdp_tp):
    with no_replication_warning():
        model = dp_fsdp_tp.sjit(lambda: GuideMLP(nnx.Rngs(0)), out_shardings=RULES,
                                warn_replicated_bytes=0)()
        dp_fsdp_tp.sjit(lambda m, x: m(x), in_shardings=(RULES, P(("dp", "fsdp"))),
                        warn_replicated_bytes=0).lower(model, np.ones((8, 32), np.float32))


def test_verify_reports_unknown_names_too(fsdp8):
    """The warning's findings are verify's: an unknown name is a finding of its own kind."""
    found = rule_findings(RULES, {"w": boxed((16, 64), ("embed", "hidden"))}, fsdp8.mesh)
    assert [(f.kind, f.leaf) for f in found] == [("unknown", 0)]
    assert "logical name 'hidden' (dim 1) of ('embed', 'hidden') is in no rule" in \
        found[0].message
