"""Every public name of ``scalax.sharding`` / ``scalax.utils`` 0.2.6 exists in shardax with
scalax's call forms: class/static methods, ``MeshShardingContext``, ``SJITCompiledFunction``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax.sharding as sharding
import shardax.utils as utils
from shardax.sharding import (
    FSDPShardingRule,
    MeshShardingContext,
    MeshShardingHelper,
    NamedSharding,
    PartitionSpec,
    SJITCompiledFunction,
)

# The module-level names of scalax 0.2.6 (scalax/sharding.py, scalax/utils.py), minus the
# third-party modules and typing names they import.
SCALAX_SHARDING = [
    "ShardingRule", "FSDPShardingRule", "TreePathShardingRule", "PolicyShardingRule",
    "MeshShardingHelper", "SJITCompiledFunction", "MeshShardingContext",
    "get_global_mesh_helper", "get_global_mesh", "get_global_annotation_shardings",
    "with_sharding_constraint", "with_sharding_annotation",
    "PartitionSpec", "Mesh", "NamedSharding", "named_tree_map",
]
SCALAX_UTILS = [
    "JaxRNG", "get_float_dtype_by_name", "float_tensor_to_dtype", "float_to_dtype",
    "tree_path_to_string", "flatten_tree", "named_tree_map", "print_pytree_structure",
]
SCALAX_HELPER_METHODS = [
    "mesh", "get_context", "get_global_mesh_helper", "get_global_mesh",
    "get_global_annotation_shardings", "match_sharding_rule", "sjit", "with_sharding_constraint",
    "with_sharding_annotation", "make_shard_and_gather_fns", "apply_shard_and_gather_fns",
    "local_data_to_global_array",
]


@pytest.mark.parametrize("name", SCALAX_SHARDING)
def test_sharding_names(name):
    assert hasattr(sharding, name)


@pytest.mark.parametrize("name", SCALAX_UTILS)
def test_utils_names(name):
    assert callable(getattr(utils, name))


@pytest.mark.parametrize("name", SCALAX_HELPER_METHODS)
def test_helper_methods(name):
    assert hasattr(MeshShardingHelper, name)


def test_class_level_getters_follow_the_context():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    assert MeshShardingHelper.get_global_mesh() is None
    assert MeshShardingHelper.get_global_mesh_helper() is None
    assert MeshShardingHelper.get_global_annotation_shardings() is None
    with mesh.get_context(annotation_shardings={"a": PartitionSpec()}) as context:
        assert MeshShardingHelper.get_global_mesh() is mesh.mesh
        assert MeshShardingHelper.get_global_mesh_helper() is mesh
        assert MeshShardingHelper.get_global_annotation_shardings() == {"a": PartitionSpec()}
        assert MeshShardingContext.get_global_context() is context
        assert isinstance(context, MeshShardingContext)
    assert MeshShardingContext.get_global_context() is None


def test_class_level_constraints_and_scalax_style_context():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    x = jnp.arange(16.0)
    assert MeshShardingHelper.with_sharding_constraint(x, PartitionSpec("fsdp")) is x

    def f(x):
        y = MeshShardingHelper.with_sharding_constraint(x * 2.0, PartitionSpec("fsdp"))
        return MeshShardingHelper.with_sharding_annotation(y, "out")

    def g(x):
        return MeshShardingHelper.with_sharding_constraint(x * 2.0, PartitionSpec("fsdp"))

    with MeshShardingContext(mesh_helper=mesh, annotation_shardings={"out": PartitionSpec()}):
        out = jax.jit(f)(x)
        sharded = jax.jit(g)(x)
        lowered = jax.jit(f).lower(x).as_text()
    np.testing.assert_array_equal(out, x * 2.0)
    # The constraint and the annotation both took effect: out ends replicated over the mesh...
    assert out.sharding == NamedSharding(mesh.mesh, PartitionSpec())
    assert lowered.count("sdy.sharding_constraint") == 2
    # ...and the constraint alone leaves it sharded along fsdp.
    assert sharded.sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
    np.testing.assert_array_equal(sharded, x * 2.0)


def test_sjit_compiled_function_and_jitted_function_by_args():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    step = mesh.sjit(lambda x, k: x * k, static_argnums=(1,), in_shardings=(PartitionSpec("fsdp"),),
                     out_shardings=PartitionSpec("fsdp"))
    assert isinstance(step, SJITCompiledFunction) and step.mesh is mesh
    x = jnp.arange(16.0)
    jitted = step.get_jitted_function_by_args(x, 3)
    out = jitted(x, 3)
    np.testing.assert_array_equal(out, x * 3)
    assert out.sharding.spec == PartitionSpec("fsdp")
    assert "sharding" in jitted.lower(x, 3).as_text()
    assert step.get_jitted_function_by_args(x, 3) is jitted  # one jax.jit per signature


def test_largest_power_of_two_divisor():
    rule = FSDPShardingRule()
    assert [rule.largest_power_of_two_divisor(n) for n in (1, 6, 8, 24, 7)] == [1, 2, 8, 8, 1]
    assert FSDPShardingRule.largest_power_of_two_divisor(96) == 32


# ----------------------------------------------------------------------------- scalax's sjit


def test_positional_sjit_signature():
    """scalax's sjit(fun, in_shardings, out_shardings, static_argnums, args_sharding_constraint,
    annotation_shardings)."""
    mesh = MeshShardingHelper([-1], ["fsdp"])
    x = jnp.arange(16.0)
    out = mesh.sjit(lambda x: x * 2, PartitionSpec("fsdp"))(x)
    assert out.sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
    np.testing.assert_array_equal(out, x * 2)

    scale = mesh.sjit(lambda x, k: x * k, None, None, (1,))
    np.testing.assert_array_equal(scale(x, 3), x * 3)
    assert scale.static_argnums == (1,)

    full = mesh.sjit(lambda x: x + 1, PartitionSpec("fsdp"), PartitionSpec(), None,
                     PartitionSpec("fsdp"))
    assert full(x).sharding == NamedSharding(mesh.mesh, PartitionSpec())
    annotated = mesh.sjit(lambda x: sharding.with_sharding_annotation(x + 1, "a"), None,
                          None, None, None, {"a": PartitionSpec("fsdp")})
    assert annotated(x).sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
    # The keyword and decorator forms still work.
    decorated = mesh.sjit(in_shardings=PartitionSpec("fsdp"))(lambda x: x - 1)
    assert decorated(x).sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))


def test_compiled_function_fields_are_scalax_s():
    """call_fn, lower_fn and jit_fn_by_static_args_fn are the functions behind __call__,
    lower and get_jitted_function_by_args, as in scalax's SJITCompiledFunction dataclass."""
    mesh = MeshShardingHelper([-1], ["fsdp"])
    step = mesh.sjit(lambda x, k: x * k, PartitionSpec("fsdp"), PartitionSpec("fsdp"), (1,))
    x = jnp.arange(16.0)
    out = step.call_fn(x, 3)
    np.testing.assert_array_equal(out, x * 3)
    assert out.sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
    lowered = step.lower_fn(x, 3)
    assert isinstance(lowered, jax.stages.Lowered)
    assert lowered.as_text() == step.lower(x, 3).as_text()
    jitted = step.jit_fn_by_static_args_fn(x, 3)
    assert jitted is step.get_jitted_function_by_args(x, 3)
    np.testing.assert_array_equal(jitted(x, 3), x * 3)


def test_rule_less_sjit_places_outputs_as_jax_jit():
    """No in/out shardings: the output stays where jax.jit puts it (one device for
    single-device inputs), not replicated over the mesh."""
    mesh = MeshShardingHelper([-1], ["fsdp"])
    x = jnp.arange(16.0)

    def f(x):
        return (x * 2).reshape(4, 4).sum(0) + jnp.arange(4.0)

    out = mesh.sjit(f)(x)
    expected = jax.jit(f)(x)
    assert isinstance(out.sharding, jax.sharding.SingleDeviceSharding)
    assert out.sharding == expected.sharding
    np.testing.assert_array_equal(out, expected)
    # A program that names the mesh inside (a constraint) runs on the mesh's devices.
    constrained = mesh.sjit(lambda x: sharding.with_sharding_constraint(x * 2,
                                                                        PartitionSpec("fsdp")))
    assert constrained(x).sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
    bare = mesh.sjit(lambda x: jax.lax.with_sharding_constraint(x * 2, PartitionSpec("fsdp")))
    assert bare(x).sharding == NamedSharding(mesh.mesh, PartitionSpec("fsdp"))
