"""Sharded init: the compiled init never holds the full model on one device, and the same seed
gives bit-identical parameters on one device and on any mesh."""


import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from shardax import layout, models
from shardax.models._layers import make_layers
from shardax.models.llama import Block
from shardax.sharding import LogicalAxisRules, MeshShardingHelper, match_specs
from shardax.train.step import init_state

# 1.6M parameters (6.4 MB in float32): big enough that the layout shows in the memory numbers,
# two layers to keep compiles short.
CFG = models.get_config("llama-tiny", dim=256, mlp_dim=704, n_layers=2)
MESHES = {"fsdp=8": "fsdp", "dp=2,fsdp=2,tp=2": "fsdp_tp"}  # mesh -> rule preset


def create(cfg=CFG):
    return nnx.state(models.create(cfg, nnx.Rngs(0)))


def leaves(tree):
    return jax.tree.leaves(tree)


def per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in leaves(tree))


def assert_sharded_as_ruled(tree, rules, mesh):
    expected = leaves(match_specs(rules, tree, mesh.mesh))
    assert len(expected) == len(leaves(tree))
    for x, spec in zip(leaves(tree), expected):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh.mesh, spec), x.ndim), (
            x.sharding, spec)


@pytest.fixture(scope="module")
def reference():
    """Plain jax.jit with no mesh at all: everything on jax.devices()[0]."""
    state = jax.jit(create)()
    assert all(x.devices() == {jax.devices()[0]} for x in leaves(state))
    return state


@pytest.fixture(scope="module")
def fsdp_init():
    """The init compiled once for fsdp=8: (mesh, rules, compiled, state)."""
    mesh = MeshShardingHelper.from_string("fsdp=8")
    rules = LogicalAxisRules(layout.PRESETS["fsdp"])
    compiled = mesh.sjit(create, out_shardings=rules).lower().compile()
    return mesh, rules, compiled, compiled()


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_init_is_bit_identical_on_any_mesh(mesh_spec, reference, fsdp_init):
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.PRESETS[MESHES[mesh_spec]])
    if mesh_spec == "fsdp=8":
        mesh, rules, _, state = fsdp_init
    else:
        state = mesh.sjit(create, out_shardings=rules)()
    assert_sharded_as_ruled(state, rules, mesh)
    assert state["layers"]["mlp"]["w_up"][...].sharding.spec[1] == "fsdp"  # [layers, embed, mlp]
    for got, want in zip(leaves(state), leaves(reference), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_a_stack_holds_the_numbers_of_its_layers_built_one_by_one(reference):
    """Layers stacked under nnx.vmap keep their 'layers' axis (here split over 'dp') and hold,
    layer for layer, the numbers of the same layers built one by one into a list from the same
    keys (what the list layout of older runs held)."""
    mesh = MeshShardingHelper.from_string("dp=2,fsdp=2,tp=2")
    rules = LogicalAxisRules([("layers", "dp"), *layout.PRESETS["fsdp_tp"]])
    state = mesh.sjit(lambda: create(CFG), out_shardings=rules)()
    w_up = state["layers"]["mlp"]["w_up"]
    assert w_up.get_metadata("out_sharding") == ("layers", "embed", "mlp")
    assert w_up[...].sharding.spec == jax.sharding.PartitionSpec("dp", "fsdp", "tp")
    assert_sharded_as_ruled(state, rules, mesh)
    def build_list():
        rngs = nnx.Rngs(0)
        rngs.params()  # the embedding's key, drawn before the layers'
        return nnx.state(make_layers(lambda r: Block(CFG, r), CFG.n_layers, rngs,
                                     stacked=False))

    listed = jax.jit(build_list)()
    stacked = models.stack_states([listed[i] for i in range(CFG.n_layers)])
    got = nnx.to_pure_dict(state["layers"])
    for path, want in jax.tree.leaves_with_path(stacked):
        assert np.array_equal(np.asarray(_at(got, path)), np.asarray(want)), path
    assert np.array_equal(np.asarray(state["embed"][...]), np.asarray(reference["embed"][...]))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_sharded_init_memory_is_bounded(reference, fsdp_init):
    """Per device, the compiled init holds (temp + output) at most ~2.5x the final state.

    XLA:CPU keeps the random bits as temporaries about the size of the parameters (a layer
    stack's for all its layers at once), on one device as on many: parameters alone come to
    2.5x their size (the same factor as a plain single-device jax.jit of this init, checked
    below), a train state with Adam moments (zeros, no random bits) to 1.5x. Materialising the
    full model would be 8x.
    """
    mesh, rules, compiled, state = fsdp_init
    full = sum(x.nbytes for x in leaves(reference))
    memory = compiled.memory_analysis()
    state_bytes = per_device_bytes(state)
    held = memory.temp_size_in_bytes + memory.output_size_in_bytes
    assert state_bytes * 8 == pytest.approx(full, rel=0.01)
    assert held <= 2.55 * state_bytes, (held, state_bytes)
    assert held <= full / 3
    single = jax.jit(create).lower().compile().memory_analysis()
    single_ratio = (single.temp_size_in_bytes + single.output_size_in_bytes) / full
    assert held / state_bytes <= 1.05 * single_ratio, (held / state_bytes, single_ratio)

    # The train loop's path: shardax.train.step.init_state (model + Adam state) inside sjit.
    tx = optax.adamw(1e-3)
    init_train = mesh.sjit(lambda: init_state(lambda: models.create(CFG, nnx.Rngs(0)), tx)[1],
                           out_shardings=rules)
    compiled_train = init_train.lower().compile()
    memory, train_state = compiled_train.memory_analysis(), compiled_train()
    train_bytes = per_device_bytes(train_state)
    held = memory.temp_size_in_bytes + memory.output_size_in_bytes
    assert held <= 2.0 * train_bytes, (held, train_bytes)
    assert train_bytes == pytest.approx(3 * state_bytes, rel=0.01)  # params, mu, nu

    adam = train_state.opt_state[0]  # adamw = chain(scale_by_adam, ...)
    param_specs = [x.sharding.spec for x in leaves(train_state.params)]
    assert [x.sharding.spec for x in leaves(adam.mu)] == param_specs
    assert [x.sharding.spec for x in leaves(adam.nu)] == param_specs
    for got, want in zip(leaves(train_state.params), leaves(reference), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
