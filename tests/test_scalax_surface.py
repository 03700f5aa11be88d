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

    with MeshShardingContext(mesh_helper=mesh, annotation_shardings={"out": PartitionSpec()}):
        out = jax.jit(f)(x)
    np.testing.assert_array_equal(out, x * 2.0)


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
