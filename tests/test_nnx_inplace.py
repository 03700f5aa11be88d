"""Flax NNX train steps written in place (``optimizer.update(model, grads)``, nothing returned)
train under ``mesh.sjit`` exactly as under ``nnx.jit`` on one device.

The reference is ``nnx.jit`` on one device with plain SGD; the sharded run is the same program
on fsdp=4 x tp=2 with logical rules, so only the order of f32 sums differs (rtol 1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _reference import GuideMLP
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardax.layout import PRESETS
from shardax.sharding import LogicalAxisRules, MeshShardingHelper

RULES = LogicalAxisRules(PRESETS["fsdp_tp"])
TOL = dict(rtol=1e-6, atol=1e-7)
X = np.random.RandomState(0).normal(size=(16, 32)).astype(np.float32)
Y = np.random.RandomState(1).normal(size=(16, 32)).astype(np.float32)
STEPS = 5




def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


# The Flax NNX guide's train steps, unchanged.
def train_step(model, optimizer, metrics, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    metrics.update(loss=loss)
    optimizer.update(model, grads)


def train_step_with_loss(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def create():
    model = GuideMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.fixture(scope="module")
def mesh():
    return MeshShardingHelper.from_string("fsdp=4,tp=2")


@pytest.fixture(scope="module")
def reference():
    """Losses and final parameters of STEPS steps under nnx.jit on one device."""
    with nnx.use_eager_sharding(False):
        model, optimizer = create()
    assert model.up.kernel[...].devices() == {jax.devices()[0]}
    step = nnx.jit(train_step_with_loss)
    losses = [float(step(model, optimizer, (X, Y))) for _ in range(STEPS)]
    return losses, nnx.state(model, nnx.Param)


def params_equal(model, expected):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
                 nnx.state(model, nnx.Param), expected)


def test_in_place_step_with_no_return_trains_as_nnx_jit(mesh, reference):
    losses, expected = reference
    model, optimizer = mesh.sjit(create, out_shardings=RULES)()
    metrics = nnx.metrics.Average("loss")
    step = mesh.sjit(train_step, in_shardings=(RULES, RULES, None, P("fsdp")))
    before = model.up.kernel[...]
    for loss in losses:
        metrics.reset()
        assert step(model, optimizer, metrics, (X, Y)) is None
        np.testing.assert_allclose(float(metrics.compute()), loss, **TOL)
    assert not np.array_equal(np.asarray(before), np.asarray(model.up.kernel[...]))
    params_equal(model, expected)
    assert int(optimizer.step[...]) == STEPS
    # The parameters keep the shardings their rules gave them.
    assert model.up.kernel[...].sharding.spec == P("fsdp", "tp")
    assert model.down.kernel[...].sharding.spec == P("tp", "fsdp")
    assert model.up.bias[...].sharding.spec == P("tp")
    assert model.up.kernel[...].addressable_shards[0].data.shape == (8, 32)


def test_in_place_step_returning_the_loss(mesh, reference):
    losses, expected = reference
    model, optimizer = mesh.sjit(create, out_shardings=RULES)()
    step = mesh.sjit(train_step_with_loss, in_shardings=(RULES, RULES, P("fsdp")))
    got = [float(step(model, optimizer, (X, Y))) for _ in range(STEPS)]
    np.testing.assert_allclose(got, losses, **TOL)
    params_equal(model, expected)
    assert model.up.kernel[...].sharding.spec == P("fsdp", "tp")


def test_keyword_static_and_donated_arguments_are_written_back(mesh, reference):
    losses, expected = reference
    model, optimizer = mesh.sjit(create, out_shardings=RULES)()

    def step(model, optimizer, batch, scale):
        return train_step_with_loss(model, optimizer, batch) * scale

    sharded = mesh.sjit(step, in_shardings=(RULES, RULES), static_argnums=(3,),
                        donate_argnums=(0, 1))
    got = [float(sharded(model, optimizer, batch=(X, Y), scale=1.0)) for _ in range(STEPS)]
    np.testing.assert_allclose(got, losses, **TOL)
    params_equal(model, expected)


def test_a_step_that_only_reads_returns_the_same_program_outputs(mesh):
    model, _ = mesh.sjit(create, out_shardings=RULES)()
    evaluate = mesh.sjit(loss_fn, in_shardings=(RULES, P("fsdp")))
    kernel = model.up.kernel[...]
    evaluate(model, (X, Y))
    assert model.up.kernel[...] is kernel  # nothing written back
    jitted = evaluate.get_jitted_function_by_args(model, (X, Y))
    np.testing.assert_allclose(jitted(model, (X, Y)), evaluate(model, (X, Y)), rtol=1e-6)


def test_a_structural_change_is_an_error(mesh):
    model, _ = mesh.sjit(create, out_shardings=RULES)()

    def grow(model):
        model.extra = nnx.Param(jnp.zeros(2))

    with pytest.raises(ValueError, match=r"changed the structure .*added \['model/extra'\]"):
        mesh.sjit(grow)(model)
    assert not hasattr(model, "extra")


def test_an_updated_shared_variable_is_an_error(mesh):
    model, optimizer = mesh.sjit(create, out_shardings=RULES)()
    kernel = model.up.kernel[...]
    step = mesh.sjit(lambda a, b, opt: train_step_with_loss(a, opt, (X, Y)))
    with pytest.raises(ValueError, match=r"Variables at \['a/down/bias', .*several places"):
        step(model, model, optimizer)
    assert model.up.kernel[...] is kernel


def test_a_jitted_function_cannot_write_back(mesh):
    model, optimizer = mesh.sjit(create, out_shardings=RULES)()
    step = mesh.sjit(train_step_with_loss, in_shardings=(RULES, RULES, P("fsdp")))
    with pytest.raises(ValueError, match="updates NNX Variables .* in place"):
        step.get_jitted_function_by_args(model, optimizer, (X, Y))


def test_a_step_returning_new_objects_carries_no_second_copy(mesh):
    """A functional step that donates its model and returns a new one writes nothing back: the
    program's outputs are the new model alone (no pass-through of the donated old one)."""
    model, _ = mesh.sjit(create, out_shardings=RULES)()
    step = mesh.sjit(lambda m: jax.tree.map(lambda x: x + 1, m), in_shardings=RULES,
                     out_shardings=RULES, donate_argnums=0)
    n = len(jax.tree.leaves(model))
    assert len(jax.tree.leaves(step.lower(model).out_info)) == n
    kernel = np.asarray(model.up.kernel[...])
    new = step(model)
    np.testing.assert_array_equal(np.asarray(new.up.kernel[...]), kernel + 1)
    assert model.up.kernel[...].is_deleted()  # donated and left behind, as under jax.jit
