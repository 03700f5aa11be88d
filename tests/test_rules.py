"""Sharding rules: FSDP, tree paths, policies, logical axis names (plain, Flax NNX, Flax linen).

Rules are pure functions of the tree and the mesh, so every expectation here is exact.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from shardax.sharding import (
    FSDPShardingRule,
    LogicalAxisRules,
    MeshShardingHelper,
    PolicyShardingRule,
    ShardingRule,
    TreePathShardingRule,
    match_specs,
)


def z(*shape):
    return np.zeros(shape, np.float32)


# ----------------------------------------------------------------------------- FSDP


@pytest.mark.parametrize(
    "shape, size, spec",
    [
        ((16, 8), 8, PS("fsdp", None)),  # largest dim
        ((8, 16), 8, PS(None, "fsdp")),
        ((8, 12), 4, PS(None, "fsdp")),  # largest divisible dim, not the first
        ((12, 8), 8, PS(None, "fsdp")),  # largest dim 12 not divisible: next one
        ((8, 8), 4, PS("fsdp", None)),  # ties: first index
        ((2, 8, 8), 4, PS(None, "fsdp", None)),
        ((3, 5), 4, PS()),  # none divisible: replicated
        ((4,), 8, PS()),  # smaller than the axis: replicated
        ((16, 4, 2), 8, PS("fsdp", None, None)),  # full rank
        ((), 8, PS()),  # scalar
    ],
)
def test_fsdp_picks_the_largest_divisible_dim(shape, size, spec):
    rule = FSDPShardingRule(fsdp_axis_size=size, min_fsdp_size=0)
    out = rule.apply(z(*shape))
    assert out == spec
    assert len(out) == (len(shape) if spec != PS() else 0)


def test_fsdp_min_size_replicates_small_leaves():
    rule = FSDPShardingRule(fsdp_axis_size=4, min_fsdp_size=64)
    specs = rule.apply({"big": z(8, 8), "small": z(7, 9), "edge": z(4, 16), "tiny": z(4)})
    assert specs == {"big": PS("fsdp", None), "small": PS(), "edge": PS(None, "fsdp"),
                     "tiny": PS()}
    assert FSDPShardingRule().min_fsdp_size == 1048576
    assert FSDPShardingRule().apply(z(8, 1024)) == PS()  # default: 8192 < 2**20 elements


def test_fsdp_axis_size_comes_from_the_active_mesh(fsdp8, dp2_fsdp4):
    small = dp2_fsdp4  # fsdp = 4
    rule = FSDPShardingRule(min_fsdp_size=0)
    tree = {"a": z(12, 8), "b": z(6, 4)}
    with fsdp8.get_context():
        assert rule.apply(tree) == {"a": PS(None, "fsdp"), "b": PS()}
    with small.get_context():
        assert rule.apply(tree) == {"a": PS("fsdp", None), "b": PS(None, "fsdp")}
    # match_specs with an explicit mesh needs no context.
    assert match_specs(rule, tree, fsdp8.mesh) == {"a": PS(None, "fsdp"), "b": PS()}
    assert match_specs(rule, tree, small.mesh) == {"a": PS("fsdp", None), "b": PS(None, "fsdp")}


def test_fsdp_tuple_axis_name_uses_the_product_of_sizes():
    helper = MeshShardingHelper([2, 4], ["dp", "fsdp"])
    rule = FSDPShardingRule(("dp", "fsdp"), min_fsdp_size=0)
    tree = {"a": z(12, 8), "b": z(12, 4), "c": z(16, 32)}
    expected = {"a": PS(None, ("dp", "fsdp")), "b": PS(), "c": PS(None, ("dp", "fsdp"))}
    with helper.get_context():
        assert rule.apply(tree) == expected
    assert match_specs(rule, tree, helper.mesh) == expected


def test_fsdp_on_a_mesh_without_the_axis_fails_loudly(dp8):
    with pytest.raises(ValueError, match=r"'fsdp'.*\('dp',\)"):
        match_specs(FSDPShardingRule(fsdp_axis_size=8, min_fsdp_size=0), z(16), dp8.mesh)


# ----------------------------------------------------------------------------- tree paths


def _params():
    return {
        "embed": z(16, 8),
        "layers": [{"w": z(8, 16), "norm": z(8)}, {"w": z(8, 16), "norm": z(8)}],
        "head": {"kernel": z(8, 4), "scale": np.float32(1.0), "one": z(1, 1)},
    }


def test_tree_path_first_match_wins_and_paths_use_slashes():
    rule = TreePathShardingRule(
        ("layers/0/w", PS(None, "tp")),
        ("layers/.*/w", PS("fsdp", None)),
        ("w$", PS("never")),
        ("norm", PS()),
        ("embed|kernel", PS("fsdp")),
    )
    specs = rule.apply(_params())
    assert specs["layers"][0]["w"] == PS(None, "tp")
    assert specs["layers"][1]["w"] == PS("fsdp", None)
    assert specs["layers"][1]["norm"] == PS()
    assert specs["embed"] == PS("fsdp")
    assert specs["head"]["kernel"] == PS("fsdp")
    # Scalars and size-1 leaves are replicated without consulting the rules.
    assert specs["head"]["scale"] == PS()
    assert specs["head"]["one"] == PS()


def test_tree_path_uses_search_not_match():
    rule = TreePathShardingRule(("kernel", PS("tp")), (".*", PS()))
    assert rule.apply({"head": {"kernel": z(4, 8)}}) == {"head": {"kernel": PS("tp")}}


def test_tree_path_strict_names_the_unmatched_path():
    rule = TreePathShardingRule(("layers", PS()))
    with pytest.raises(ValueError, match=r"'embed'.*\(16, 8\)"):
        rule.apply(_params())
    lenient = TreePathShardingRule(("layers", PS("fsdp")), strict=False)
    specs = lenient.apply(_params())
    assert specs["embed"] == PS()
    assert specs["layers"][0]["norm"] == PS("fsdp")


def test_tree_path_values_may_be_rules():
    rule = TreePathShardingRule(
        ("norm", PS()),
        ("head", PolicyShardingRule(lambda path, x: PS(None, "tp"))),
        (".*", FSDPShardingRule(fsdp_axis_size=8, min_fsdp_size=0)),
    )
    specs = rule.apply(_params())
    assert specs["embed"] == PS("fsdp", None)
    assert specs["layers"][0]["w"] == PS(None, "fsdp")
    assert specs["layers"][0]["norm"] == PS()
    assert specs["head"]["kernel"] == PS(None, "tp")


def test_tree_path_nested_rule_reads_the_active_mesh(dp_fsdp_tp):
    rule = TreePathShardingRule(("norm", PS()), (".*", FSDPShardingRule(min_fsdp_size=0)))
    specs = match_specs(rule, _params(), dp_fsdp_tp.mesh)  # fsdp = 2
    assert specs["embed"] == PS("fsdp", None)
    assert specs["layers"][1]["w"] == PS(None, "fsdp")


def test_tree_path_spec_longer_than_rank_names_the_path():
    rule = TreePathShardingRule(("norm", PS("fsdp", None)), (".*", PS()))
    with pytest.raises(ValueError, match=r"'layers/0/norm'.*\(8,\)"):
        rule.apply(_params())


def test_tree_path_bad_arguments():
    with pytest.raises(ValueError, match="regex"):
        TreePathShardingRule(("(unclosed", PS()))
    with pytest.raises(ValueError, match="PartitionSpec or ShardingRule"):
        TreePathShardingRule(("w", "fsdp"))
    with pytest.raises(ValueError, match="pair"):
        TreePathShardingRule("w")


# ----------------------------------------------------------------------------- policy


def test_policy_rule_gets_path_and_leaf():
    seen = []

    def policy(path, leaf):
        seen.append((path, np.shape(leaf)))
        return PS("tp") if path.endswith("w") and np.ndim(leaf) == 2 else PS()

    specs = PolicyShardingRule(policy).apply(_params())
    assert specs["layers"][1]["w"] == PS("tp")
    assert specs["layers"][1]["norm"] == PS()
    assert ("layers/1/w", (8, 16)) in seen
    assert ("head/scale", ()) in seen
    assert isinstance(PolicyShardingRule(policy), ShardingRule)


# ----------------------------------------------------------------------------- logical axes

RULES = LogicalAxisRules(
    [
        ("batch", ("dp", "fsdp")),
        ("embed", "fsdp"),
        ("embed", "tp"),  # fallback when fsdp is taken
        ("mlp", "tp"),
        ("heads", "tp"),
        ("vocab", None),
    ]
)


@pytest.mark.parametrize(
    "names, spec",
    [
        (("embed", "mlp"), PS("fsdp", "tp")),
        (("batch", "embed"), PS(("dp", "fsdp"), "tp")),  # fsdp used once: embed falls back
        (("batch", "embed", "mlp"), PS(("dp", "fsdp"), "tp", None)),  # tp used by embed
        (("mlp", "heads"), PS("tp", None)),
        (("embed", "embed"), PS("fsdp", "tp")),
        (("vocab", "embed"), PS(None, "fsdp")),
        (("unknown", None, "mlp"), PS(None, None, "tp")),
    ],
)
def test_logical_spec_for_priority_and_fallbacks(dp_fsdp_tp, names, spec):
    assert RULES.spec_for(names, dp_fsdp_tp.mesh) == spec
    with dp_fsdp_tp.get_context():  # the active mesh is used when none is passed
        assert RULES.spec_for(names) == spec


def test_logical_axes_absent_from_the_mesh_are_dropped(fsdp8):
    assert RULES.spec_for(("batch", "mlp"), fsdp8.mesh) == PS("fsdp", None)
    assert RULES.spec_for(("embed", "heads"), fsdp8.mesh) == PS("fsdp", None)
    dp_tp = MeshShardingHelper([2, -1], ["dp", "tp"])
    assert RULES.spec_for(("batch", "embed"), dp_tp.mesh) == PS("dp", "tp")


def test_logical_rules_accept_a_mapping_and_reject_bad_items():
    rules = LogicalAxisRules({"embed": "fsdp", "mlp": ["tp"]})
    assert list(rules) == [("embed", "fsdp"), ("mlp", ("tp",))]
    assert len(rules) == 2
    with pytest.raises(ValueError, match="pair"):
        LogicalAxisRules([("embed",)])
    with pytest.raises(ValueError, match="pair"):
        LogicalAxisRules([(1, "fsdp")])


def test_logical_apply_on_plain_arrays_is_replicated(dp_fsdp_tp):
    assert match_specs(RULES, {"w": z(4, 4)}, dp_fsdp_tp.mesh) == {"w": PS()}


def _nnx_model():
    init = nnx.initializers.lecun_normal()
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(
            8,
            4,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=nnx.Rngs(0),
        )
        model.extra = nnx.Param(jnp.ones((4, 2)))  # no names: replicated
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return model, optimizer


def test_logical_apply_reads_nnx_metadata_and_optimizer_moments(dp_fsdp_tp):
    model, optimizer = _nnx_model()
    params = nnx.state(model, nnx.Param)
    with dp_fsdp_tp.get_context():
        specs = RULES.apply(params)
    assert specs["kernel"] == PS("fsdp", "tp")
    assert specs["bias"] == PS("tp")
    assert specs["extra"] == PS()

    opt_state = nnx.state(optimizer)
    with dp_fsdp_tp.get_context():
        opt_specs = RULES.apply(opt_state)
    adam = opt_specs["opt_state"][0]
    for moment in ("mu", "nu"):
        assert adam[moment]["kernel"] == PS("fsdp", "tp")
        assert adam[moment]["bias"] == PS("tp")
        assert adam[moment]["extra"] == PS()
    assert adam["count"] == PS()

    # Through match_sharding_rule: NamedShardings line up with the flattened arrays.
    shardings = dp_fsdp_tp.match_sharding_rule(RULES, opt_state)
    flat = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
    }
    mu_kernel = [s for k, s in flat.items() if "mu" in k and "kernel" in k]
    assert mu_kernel == [NamedSharding(dp_fsdp_tp.mesh, PS("fsdp", "tp"))]
    assert len(flat) == len(jax.tree_util.tree_leaves(opt_state))


def test_logical_apply_reads_linen_logical_partitioning(dp_fsdp_tp):
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel_init = nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")
            )
            x = nn.Dense(16, kernel_init=kernel_init, name="up")(x)
            return nn.Dense(4, name="plain")(x)

    variables = Layer().init(jax.random.key(0), jnp.ones((1, 8)))
    with dp_fsdp_tp.get_context():
        specs = RULES.apply(variables)
    assert specs["params"]["up"]["kernel"] == PS("fsdp", "tp")
    assert specs["params"]["up"]["bias"] == PS()
    assert specs["params"]["plain"]["kernel"] == PS()
    # match_specs keeps the tree structure (the box is a pytree node around its one array), so
    # its result can be handed to jax.jit for the boxed tree as is.
    matched = match_specs(RULES, variables, dp_fsdp_tp.mesh)
    assert jax.tree_util.tree_structure(matched, is_leaf=lambda x: isinstance(x, PS)) == (
        jax.tree_util.tree_structure(variables)
    )
    assert jax.tree.leaves(matched["params"]["up"]["kernel"],
                           is_leaf=lambda x: isinstance(x, PS)) == [PS("fsdp", "tp")]


def test_logical_name_count_must_match_rank(dp_fsdp_tp):
    with nnx.use_eager_sharding(False):
        bad = {"w": nnx.Param(jnp.ones((4, 4)), out_sharding=("embed",))}
    with pytest.raises(ValueError, match=r"'w'.*\(4, 4\)"):
        match_specs(RULES, bad, dp_fsdp_tp.mesh)


# ----------------------------------------------------------------------------- match_specs


def test_match_specs_prefix_trees_and_none(fsdp8):
    tree = ({"w": z(16, 8), "b": z(8)}, {"x": z(8, 2), "y": z(8)})
    rules = ({"w": PS("fsdp"), "b": None}, PS("fsdp"))
    assert match_specs(rules, tree, fsdp8.mesh) == (
        {"w": PS("fsdp"), "b": None},
        {"x": PS("fsdp"), "y": PS("fsdp")},
    )
    assert match_specs(None, tree, fsdp8.mesh) == ({"w": None, "b": None}, {"x": None, "y": None})


def test_match_specs_indivisible_names_path_shape_spec_and_mesh(fsdp8):
    with pytest.raises(ValueError, match=r"'1/x'.*\(6, 2\).*'fsdp'.*\{'fsdp': 8\}"):
        match_specs((None, PS("fsdp")), ({"w": z(16)}, {"x": z(6, 2)}), fsdp8.mesh)


def test_match_specs_unknown_axis_lists_mesh_axes(dp_fsdp_tp):
    with pytest.raises(ValueError, match=r"'model'.*\('dp', 'fsdp', 'tp'\)"):
        match_specs({"w": PS("model")}, {"w": z(8)}, dp_fsdp_tp.mesh)


def test_match_specs_other_errors(fsdp8):
    with pytest.raises(ValueError, match=r"'w'.*rank"):
        match_specs(PS("fsdp", None), {"w": z(8)}, fsdp8.mesh)
    with pytest.raises(ValueError, match="tree prefix"):
        match_specs((PS(), PS()), (z(8),), fsdp8.mesh)
    with pytest.raises(ValueError, match="more than one"):
        match_specs(PS("fsdp", "fsdp"), z(8, 8), fsdp8.mesh)
    with pytest.raises(ValueError, match="needs a mesh"):
        match_specs(PS(), z(8))
