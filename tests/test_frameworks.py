"""Flax NNX, Flax linen and Equinox models (and their optimizer states) through sjit + rules.

Every sharded run is compared with the same program on one device: plain SGD for 3 steps,
rtol 1e-5 / atol 1e-6 (sharded f32 reductions sum in another order; nothing else differs).
"""

from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import GuideMLP
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

from shardax.frameworks import linen as linen_rules
from shardax.layout import PRESETS
from shardax.sharding import (
    FSDPShardingRule,
    LogicalAxisRules,
    MeshShardingHelper,
    TreePathShardingRule,
)

TOL = dict(rtol=1e-5, atol=1e-6)
RULES = LogicalAxisRules(PRESETS["fsdp_tp"])
BATCH = P(("dp", "fsdp"))
X = np.random.RandomState(0).normal(size=(16, 32)).astype(np.float32)
Y = np.random.RandomState(1).normal(size=(16, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def mesh3d():
    return MeshShardingHelper.from_string("dp=2,fsdp=2,tp=2")


def specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


def one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def assert_close(actual, expected):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
                 actual, expected)


# ---------------------------------------------------------------------------------- Flax NNX




def nnx_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, optimizer, loss


def nnx_create(tx):
    model = GuideMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_guide_model_needs_a_mesh_outside_shardax():
    """The premise: Flax shards such a model eagerly, so building it bare fails..."""
    with pytest.raises(ValueError, match="mesh"):
        GuideMLP(nnx.Rngs(0))


def test_nnx_model_and_optimizer_created_sharded_inside_sjit(mesh3d):
    """...while inside sjit it needs no ceremony, and Adam's moments get the params' specs."""
    model, optimizer = mesh3d.sjit(lambda: nnx_create(optax.adam(1e-3)), out_shardings=RULES)()
    params = nnx.state(model, nnx.Param)
    assert specs(params)["up"]["kernel"] == P("fsdp", "tp")
    assert specs(params)["up"]["bias"] == P("tp")
    assert specs(params)["down"]["kernel"] == P("tp", "fsdp")
    assert specs(params)["down"]["bias"] == P("fsdp")
    adam = optimizer.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert specs(moment) == specs(params)
    assert adam.count[...].sharding.spec == P()
    # Each device holds a quarter of the kernel (fsdp x tp), not all of it.
    assert model.up.kernel[...].addressable_shards[0].data.shape == (16, 32)


def test_nnx_sgd_steps_match_one_device(mesh3d):
    tx = optax.sgd(0.1)
    with nnx.use_eager_sharding(False):  # the reference: same model, built bare on one device
        ref_model, ref_opt = jax.jit(lambda: nnx_create(tx))()
    assert ref_model.up.kernel[...].devices() == {jax.devices()[0]}
    ref = jax.jit(nnx_step)
    model, optimizer = mesh3d.sjit(lambda: nnx_create(tx), out_shardings=RULES)()
    step = mesh3d.sjit(nnx_step, in_shardings=(RULES, RULES, BATCH, BATCH),
                       out_shardings=(RULES, RULES, None), donate_argnums=(0, 1))
    for _ in range(3):
        ref_model, ref_opt, ref_loss = ref(ref_model, ref_opt, one_device(X), one_device(Y))
        model, optimizer, loss = step(model, optimizer, X, Y)
        np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    assert model.up.kernel[...].sharding.spec == P("fsdp", "tp")
    assert int(optimizer.step[...]) == 3


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                 ("embed", "mlp"))(rngs.params(), (32, 32)))

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...])


class Stack(nnx.Module):
    """A layer stack as the Flax guide builds it: nnx.vmap to create, nnx.scan to run."""

    def __init__(self, n: int, rngs: nnx.Rngs):
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def build(key):
            return Layer(nnx.Rngs(params=key))

        self.layers = build(jax.random.split(rngs.params(), n))

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(layer, h):
            return layer(h)

        return run(self.layers, x)


def test_nnx_scan_stack_keeps_layers_names(mesh3d):
    rules = LogicalAxisRules([("layers", "dp"), *PRESETS["fsdp_tp"]])
    model = mesh3d.sjit(lambda: Stack(4, nnx.Rngs(0)), out_shardings=rules)()
    w = model.layers.w
    assert w.get_metadata("out_sharding") == ("layers", "embed", "mlp")
    assert w[...].shape == (4, 32, 32) and w[...].sharding.spec == P("dp", "fsdp", "tp")

    def grads(model, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)

    g = mesh3d.sjit(grads, in_shardings=(rules, BATCH), out_shardings=rules)(model, X)
    # Gradients (and so optimizer state) keep the names through nnx.scan.
    assert g.layers.w.get_metadata("out_sharding") == ("layers", "embed", "mlp")
    assert g.layers.w[...].sharding.spec == P("dp", "fsdp", "tp")


# ---------------------------------------------------------------------------------- Flax linen


class LinenBlock(nn.Module):
    """Seed 004's LogicalDotReluDot: logical names on params and on the hidden activation."""

    depth: int = 64

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_normal()
        y = nn.Dense(self.depth, use_bias=False,
                     kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        y = nn.with_logical_constraint(jax.nn.relu(y), ("batch", "mlp"))
        w2 = self.param("W2", nn.with_logical_partitioning(init, ("mlp", "embed")),
                        (self.depth, x.shape[-1]))
        return nn.with_logical_constraint(y @ w2, ("batch", "embed"))


def linen_create(x):
    model = LinenBlock()
    params = model.init(jax.random.key(0), x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def linen_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_linen_train_state_with_logical_boxes_matches_one_device(mesh3d):
    ref_state = jax.jit(linen_create)(one_device(X))
    assert len(ref_state.step.devices()) == 1
    state = mesh3d.sjit(linen_create, out_shardings=RULES)(X)
    kernel = state.params["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == ("embed", "mlp")
    assert kernel.value.sharding.spec == P("fsdp", "tp")
    assert state.params["W2"].value.sharding.spec == P("tp", "fsdp")
    assert state.step.sharding.spec == P()

    step = mesh3d.sjit(linen_step, in_shardings=(RULES, BATCH, BATCH),
                       out_shardings=(RULES, None))
    hlo = step.lower(state, X, Y).as_text()  # sjit sets Flax's rules from its LogicalAxisRules
    for _ in range(3):
        ref_state, ref_loss = jax.jit(linen_step)(ref_state, one_device(X), one_device(Y))
        state, loss = step(state, X, Y)
        np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_close(nn.meta.unbox(state.params), nn.meta.unbox(ref_state.params))
    assert state.params["W2"].value.sharding.spec == P("tp", "fsdp")
    # nn.with_logical_constraint became real constraints, with 'batch' on ('dp', 'fsdp').
    assert hlo.count("sharding_constraint") >= 2
    assert '{"dp", "fsdp"}, {"tp"}' in hlo


def test_linen_constraints_are_no_ops_outside_shardax(mesh3d):
    state = jax.jit(linen_create)(one_device(X))
    assert "sharding_constraint" not in jax.jit(linen_step).lower(state, X, Y).as_text()


def test_linen_constraints_need_logical_rules_in_the_sjit(mesh3d):
    spec_only = mesh3d.sjit(linen_step, in_shardings=(None, BATCH, BATCH))
    state = mesh3d.sjit(linen_create, out_shardings=RULES)(X)
    assert "sharding_constraint" not in spec_only.lower(state, X, Y).as_text()
    explicit = mesh3d.sjit(linen_step, in_shardings=(None, BATCH, BATCH), logical_axis_rules=RULES)
    assert '{"dp", "fsdp"}, {"tp"}' in explicit.lower(state, X, Y).as_text()


def test_linen_axis_rules_drop_axes_the_mesh_lacks():
    fsdp_only = MeshShardingHelper([-1], ["fsdp"]).mesh
    rules = [("batch", ("dp", "fsdp")), ("mlp", "tp"), ("mlp", None), ("embed", "fsdp")]
    assert linen_rules.axis_rules(rules, fsdp_only) == (
        ("batch", "fsdp"), ("mlp", None), ("embed", "fsdp"), ("fsdp", "fsdp"))
    # Flax then resolves exactly as LogicalAxisRules does (a mesh axis's own name included).
    flax_rules = linen_rules.axis_rules(rules, fsdp_only)
    for names in [("batch", "mlp"), ("embed", "mlp"), ("batch", "embed"), ("mlp", "fsdp"),
                  ("embed", "fsdp")]:
        assert nn.logical_to_mesh_axes(names, flax_rules) == \
            LogicalAxisRules(rules).spec_for(names, fsdp_only)


# ---------------------------------------------------------------------------------- Equinox


def eqx_step(params, opt_state, static, x, y, tx):
    """Only arrays cross the jit boundary; the module's functions ride in ``static``."""

    def loss_fn(params):
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def test_equinox_mlp_fsdp_matches_one_device():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    model = eqx.nn.MLP(32, 32, 64, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(0.1)
    fsdp = FSDPShardingRule(min_fsdp_size=256)
    # Path rules see Equinox attribute names: layers/0/weight, layers/0/bias...
    paths = TreePathShardingRule(("bias", P()), ("weight", fsdp))
    assert mesh.match_sharding_rule(paths, params).layers[0].weight.spec == P("fsdp", None)

    step = mesh.sjit(eqx_step, in_shardings=(fsdp, fsdp, P("fsdp"), P("fsdp")),
                     out_shardings=(fsdp, fsdp, None), static_argnums=(2, 5))
    ref = jax.jit(eqx_step, static_argnums=(2, 5))
    sharded = mesh.sjit(lambda p: p, out_shardings=fsdp)(params)
    opt_state, ref_params, ref_opt = tx.init(sharded), one_device(params), tx.init(params)
    for _ in range(3):
        ref_params, ref_opt, ref_loss = ref(ref_params, ref_opt, static, one_device(X),
                                            one_device(Y), tx)
        sharded, opt_state, loss = step(sharded, opt_state, static, X, Y, tx)
        np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_close(sharded, ref_params)
    assert sharded.layers[1].weight.sharding.spec == P("fsdp", None)
    assert sharded.layers[0].weight.sharding.spec == P("fsdp", None)
    assert sharded.layers[1].bias.sharding.spec == P()  # 64 elements < min_fsdp_size


class FieldsModel(eqx.Module):
    """An Equinox model with Python fields of every kind next to its arrays."""

    layers: list  # a list field: a pytree node of Linear modules
    activation: Callable  # a function leaf
    residual: bool  # a Python bool leaf (a plain field, as Dropout.inference is)
    scale: int  # a Python int leaf
    sizes: list = eqx.field(static=True)  # a list in a static field (unhashable)

    def __call__(self, x):
        for layer in self.layers:
            h = self.activation(layer(x))
            x = x + h if self.residual else h
        return x * self.scale / len(self.sizes)


def whole_model_step(model, x, y):
    """The Equinox way: the module passed whole, its Python fields filtered by Equinox."""
    loss, grads = eqx.filter_value_and_grad(
        lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss


def test_equinox_model_with_python_fields_passed_whole_matches_one_device(fsdp8):
    keys = jax.random.split(jax.random.key(0), 2)
    model = FieldsModel([eqx.nn.Linear(32, 32, key=k) for k in keys], jax.nn.gelu, True, 2,
                        [32, 32])
    fsdp = FSDPShardingRule(min_fsdp_size=256)
    step = fsdp8.sjit(whole_model_step, in_shardings=(fsdp, P("fsdp"), P("fsdp")),
                      out_shardings=(fsdp, None))
    ref_step = eqx.filter_jit(whole_model_step)
    arrays, python = eqx.partition(model, eqx.is_array)
    sharded, ref = model, eqx.combine(one_device(arrays), python)
    for _ in range(5):
        ref, ref_loss = ref_step(ref, one_device(X), one_device(Y))
        sharded, loss = step(sharded, X, Y)
        np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_close(eqx.filter(sharded, eqx.is_array), eqx.filter(ref, eqx.is_array))
    assert sharded.layers[0].weight.sharding.spec == P("fsdp", None)
    # Python fields come back as the same objects (as eqx.filter_jit returns them)
    assert sharded.activation is jax.nn.gelu and sharded.residual is True
    assert type(sharded.scale) is int and sharded.sizes == [32, 32]


def test_equinox_unhashable_python_leaf_names_its_path(fsdp8):
    model = FieldsModel([eqx.nn.Linear(4, 4, key=jax.random.key(0))], jax.nn.relu, True,
                        {"not": "hashable"}.keys(), [4])  # dict keys: a leaf, unhashable
    with pytest.raises(TypeError, match=r"'m/scale' of type dict_keys .* not hashable"):
        fsdp8.sjit(lambda m: m, in_shardings=FSDPShardingRule())(model)


def test_equinox_adam_state_sharded_like_params():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    params = eqx.filter(eqx.nn.MLP(32, 32, 64, 2, key=jax.random.key(0)), eqx.is_array)
    fsdp = FSDPShardingRule(min_fsdp_size=256)
    tx = optax.adamw(1e-3)
    opt_state = mesh.sjit(tx.init, out_shardings=fsdp)(params)
    adam = opt_state[0]
    assert specs(adam.mu) == specs(adam.nu) == jax.tree.map(
        lambda s: s.spec, mesh.match_sharding_rule(fsdp, params))
