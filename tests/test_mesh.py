"""``MeshShardingHelper``: mesh shapes, DCN layouts, contexts, global arrays, shard/gather fns.

Everything here is exact: device layouts, specs and array values are compared with ``==``.
"""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as PS

from shardax.sharding import (
    FSDPShardingRule,
    Mesh,
    MeshShardingHelper,
    get_global_annotation_shardings,
    get_global_mesh,
    get_global_mesh_helper,
    with_sharding_annotation,
    with_sharding_constraint,
)


def _ids(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(mesh.devices)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "dims, names, shape",
    [
        ([-1], ["fsdp"], {"fsdp": 8}),
        ([2, -1], ["dp", "fsdp"], {"dp": 2, "fsdp": 4}),
        ([1, -1, 2], ["dp", "fsdp", "tp"], {"dp": 1, "fsdp": 4, "tp": 2}),
        ([2, 2, 2], ["dp", "fsdp", "tp"], {"dp": 2, "fsdp": 2, "tp": 2}),
        ([-1, 8], ["dp", "tp"], {"dp": 1, "tp": 8}),
    ],
)
def test_minus_one_is_inferred_and_axes_are_auto(dims, names, shape):
    helper = MeshShardingHelper(dims, names)
    assert helper.shape == shape
    assert isinstance(helper.mesh, Mesh)
    assert dict(helper.mesh.shape) == shape
    assert tuple(helper.mesh.axis_names) == tuple(names)
    assert helper.mesh.axis_types == (AxisType.Auto,) * len(names)
    assert sorted(_ids(helper.mesh).ravel()) == list(range(8))


@pytest.mark.parametrize(
    "dims, names",
    [
        ([3], ["fsdp"]),  # 3 != 8
        ([2, 2], ["dp", "fsdp"]),  # 4 != 8
        ([4, 4], ["dp", "fsdp"]),  # 16 != 8
        ([3, -1], ["dp", "fsdp"]),  # 3 does not divide 8
    ],
)
def test_shape_that_cannot_fill_the_devices_names_the_device_count(dims, names):
    with pytest.raises(ValueError, match=r"device count (is )?8"):
        MeshShardingHelper(dims, names)


@pytest.mark.parametrize("dims", [[-1, -1], [0, -1], [-2, 4]])
def test_invalid_dims_are_value_errors(dims):
    with pytest.raises(ValueError, match=r"-1|positive"):
        MeshShardingHelper(dims, ["a", "b"])


def test_names_that_do_not_match_dims_are_a_value_error():
    with pytest.raises(ValueError, match=r"2 dims .* 1 axis names"):
        MeshShardingHelper([2, 4], ["dp"])
    with pytest.raises(ValueError, match="unique"):
        MeshShardingHelper([2, 4], ["dp", "dp"])


def test_names_dims_mismatch_message_names_the_device_count():
    # Issue 2: "A shape that cannot fill the device count, or names that do not match dims,
    # raise ValueError saying the device count."
    with pytest.raises(ValueError, match="8"):
        MeshShardingHelper([-1, 2], ["dp"])


def test_from_string():
    helper = MeshShardingHelper.from_string("dp=1,fsdp=-1,tp=2")
    assert helper.shape == {"dp": 1, "fsdp": 4, "tp": 2}
    assert MeshShardingHelper.from_string(" dp = 2 , fsdp=-1 ").shape == {"dp": 2, "fsdp": 4}
    assert MeshShardingHelper.from_string("fsdp=8").shape == {"fsdp": 8}
    with pytest.raises(ValueError, match=r"device count (is )?8"):
        MeshShardingHelper.from_string("dp=3")


@pytest.mark.parametrize("text", ["", "dp", "dp=x", "=2", "dp=2;tp=4", "dp=2,,tp=4", "d p=2"])
def test_from_string_malformed(text):
    with pytest.raises(ValueError, match=r"name=size"):
        MeshShardingHelper.from_string(text)


def test_mesh_axis_splitting_lays_devices_out_in_plain_order():
    helper = MeshShardingHelper([2, 2, 2], ["dp", "fsdp", "tp"], mesh_axis_splitting=True)
    np.testing.assert_array_equal(_ids(helper.mesh), np.arange(8).reshape(2, 2, 2))


# ----------------------------------------------------------------------------- DCN


@pytest.mark.parametrize(
    "ici, dcn, shape",
    [
        ([2, 2], [2, 1], {"dp": 4, "fsdp": 2}),
        ([-1, 2], [2, 1], {"dp": 4, "fsdp": 2}),
        ([4, 1], [1, 2], {"dp": 4, "fsdp": 2}),
        ([1, 2], [2, 2], {"dp": 2, "fsdp": 4}),
    ],
)
def test_dcn_mesh_is_ici_times_dcn_with_each_slice_contiguous(ici, dcn, shape):
    helper = MeshShardingHelper(ici, ["dp", "fsdp"], dcn_axis_dims=dcn)
    assert helper.shape == shape
    ids = _ids(helper.mesh)
    assert sorted(ids.ravel()) == list(range(8))
    # The emulated devices form 2 or 4 "slices" of consecutive ids. Along each axis the mesh is
    # dcn (outer) x ici (inner): the block at slice index (s0, s1) holds one whole slice.
    ici_shape = [shape[n] // d for n, d in zip(("dp", "fsdp"), dcn)]
    per_slice = int(np.prod(ici_shape))
    slices = set()
    for s0 in range(dcn[0]):
        for s1 in range(dcn[1]):
            block = ids[
                s0 * ici_shape[0] : (s0 + 1) * ici_shape[0],
                s1 * ici_shape[1] : (s1 + 1) * ici_shape[1],
            ]
            slice_ids = {int(i) // per_slice for i in block.ravel()}
            assert len(slice_ids) == 1, f"block {(s0, s1)} mixes slices: {block}"
            slices |= slice_ids
    assert len(slices) == int(np.prod(dcn))


def test_dcn_errors_name_the_device_count():
    with pytest.raises(ValueError, match="8"):
        MeshShardingHelper([1, -1], ["dp", "fsdp"], dcn_axis_dims=[3, 1])
    with pytest.raises(ValueError, match="dcn_axis_dims"):
        MeshShardingHelper([2, -1], ["dp", "fsdp"], dcn_axis_dims=[2])
    with pytest.raises(ValueError, match=r"device count (is )?4"):  # one slice holds 8 / 2 devices
        MeshShardingHelper([4, 2], ["dp", "fsdp"], dcn_axis_dims=[2, 1])


# ----------------------------------------------------------------------------- contexts


def test_global_getters_are_none_outside_any_context():
    assert get_global_mesh_helper() is None
    assert get_global_mesh() is None
    assert get_global_annotation_shardings() is None


def test_get_context_sets_globals_and_jax_mesh_innermost_wins():
    outer = MeshShardingHelper([-1], ["fsdp"])
    inner = MeshShardingHelper([2, -1], ["dp", "tp"])
    annotations = {"act": PS("fsdp")}
    with outer.get_context(annotations):
        assert get_global_mesh_helper() is outer
        assert get_global_mesh() is outer.mesh
        assert get_global_annotation_shardings() == annotations
        assert tuple(jax.sharding.get_abstract_mesh().axis_names) == ("fsdp",)
        with inner.get_context():
            assert get_global_mesh_helper() is inner
            assert get_global_annotation_shardings() is None  # as scalax: none given
            assert tuple(jax.sharding.get_abstract_mesh().axis_names) == ("dp", "tp")
        assert get_global_mesh_helper() is outer
        assert tuple(jax.sharding.get_abstract_mesh().axis_names) == ("fsdp",)
    assert get_global_mesh_helper() is None
    assert jax.sharding.get_abstract_mesh().empty


def test_contexts_are_thread_local():
    helper = MeshShardingHelper([-1], ["fsdp"])
    seen = {}
    x = np.ones((8, 2), np.float32)

    def other_thread():
        seen["helper"] = get_global_mesh_helper()
        seen["mesh"] = get_global_mesh()
        seen["annotations"] = get_global_annotation_shardings()
        seen["constraint_is_noop"] = with_sharding_constraint(x, PS("fsdp")) is x
        seen["annotation_is_noop"] = with_sharding_annotation(x, "act") is x

    with helper.get_context({"act": PS("fsdp")}):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert get_global_mesh_helper() is helper
    assert seen == {
        "helper": None,
        "mesh": None,
        "annotations": None,
        "constraint_is_noop": True,
        "annotation_is_noop": True,
    }


# ----------------------------------------------------------------------------- rule matching


def test_match_sharding_rule_gives_named_shardings_and_keeps_none():
    helper = MeshShardingHelper([2, -1], ["dp", "fsdp"])
    tree = ({"w": np.zeros((16, 4)), "b": np.zeros(4)}, {"x": np.zeros((8, 3))})
    rule = (FSDPShardingRule(min_fsdp_size=0), None)
    shardings = helper.match_sharding_rule(rule, tree)
    assert shardings[0]["w"] == NamedSharding(helper.mesh, PS("fsdp", None))
    assert shardings[0]["b"] == NamedSharding(helper.mesh, PS("fsdp"))
    assert shardings[1] == {"x": None}


# ----------------------------------------------------------------------------- global arrays


@pytest.mark.parametrize(
    "subset, spec_axes, shard_rows",
    [(None, ("dp", "fsdp"), 2), ("dp", ("dp",), 8), (("fsdp",), ("fsdp",), 4)],
)
def test_local_data_to_global_array_keeps_row_order(subset, spec_axes, shard_rows):
    helper = MeshShardingHelper([2, 4], ["dp", "fsdp"])
    local = {
        "x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3),
        "y": np.arange(16, dtype=np.int32),
    }
    out = helper.local_data_to_global_array(local, mesh_axis_subset=subset)
    for key in local:
        array = out[key]
        assert isinstance(array, jax.Array)
        np.testing.assert_array_equal(np.asarray(array), local[key])
        assert array.sharding == NamedSharding(helper.mesh, PS(spec_axes))
        for shard in array.addressable_shards:
            assert shard.data.shape[0] == shard_rows
            np.testing.assert_array_equal(np.asarray(shard.data), local[key][shard.index])


def test_local_data_to_global_array_batch_axis_1():
    helper = MeshShardingHelper([-1], ["dp"])
    local = np.arange(3 * 16, dtype=np.float32).reshape(3, 16)
    out = helper.local_data_to_global_array(local, batch_axis=1)
    np.testing.assert_array_equal(np.asarray(out), local)
    assert out.sharding.spec == PS(None, ("dp",))
    assert out.addressable_shards[0].data.shape == (3, 2)


def test_local_data_to_global_array_errors():
    helper = MeshShardingHelper([2, 4], ["dp", "fsdp"])
    with pytest.raises(ValueError, match=r"'x'.*\(6, 3\).*8"):
        helper.local_data_to_global_array({"x": np.zeros((6, 3))})
    with pytest.raises(ValueError, match=r"'tp'.*dp"):
        helper.local_data_to_global_array({"x": np.zeros((8, 3))}, mesh_axis_subset="tp")
    with pytest.raises(ValueError, match=r"batch axis 1"):
        helper.local_data_to_global_array({"x": np.zeros(8)}, batch_axis=1)


# ----------------------------------------------------------------------------- shard / gather


def test_make_shard_and_gather_fns_round_trip():
    helper = MeshShardingHelper([2, -1], ["dp", "fsdp"])
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((16, 4)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
        "step": np.array(7, np.int32),
    }
    shard_fns, gather_fns = helper.make_shard_and_gather_fns(
        params, FSDPShardingRule(min_fsdp_size=0)
    )
    sharded = helper.apply_shard_and_gather_fns(shard_fns, params)
    assert sharded["w"].sharding == NamedSharding(helper.mesh, PS("fsdp", None))
    assert sharded["b"].sharding.is_fully_replicated  # 3 is not divisible by 4
    assert sharded["step"].sharding.is_fully_replicated
    gathered = helper.apply_shard_and_gather_fns(gather_fns, sharded)
    for key, value in params.items():
        assert isinstance(gathered[key], np.ndarray)
        assert gathered[key].dtype == value.dtype
        np.testing.assert_array_equal(gathered[key], value)


def test_make_shard_and_gather_fns_with_a_spec_and_with_none():
    helper = MeshShardingHelper([2, -1], ["dp", "fsdp"])
    tree = {"a": np.arange(8, dtype=np.float32), "b": np.arange(4, dtype=np.float32)}
    shard_fns, gather_fns = helper.make_shard_and_gather_fns(tree, {"a": PS("dp"), "b": None})
    sharded = helper.apply_shard_and_gather_fns(shard_fns, tree)
    assert sharded["a"].sharding.spec == PS("dp")
    assert sharded["b"].sharding.is_fully_replicated  # None: no rule, so replicated
    gathered = helper.apply_shard_and_gather_fns(gather_fns, sharded)
    jax.tree.map(np.testing.assert_array_equal, gathered, tree)
