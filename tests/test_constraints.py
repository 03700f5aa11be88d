"""``with_sharding_constraint`` / ``with_sharding_annotation`` and the sjit context.

The seed's constraint and annotation examples run as written (apart from the import) and are
compared with plain ``jax.jit`` on one device after 3 SGD steps (losses at atol = rtol = 1e-6,
parameters by `_reference.assert_trained_alike`); all other checks are exact.
"""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import assert_trained_alike
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from shardax.sharding import (
    FSDPShardingRule,
    MeshShardingHelper,
    get_global_annotation_shardings,
    get_global_mesh,
    get_global_mesh_helper,
    with_sharding_annotation,
    with_sharding_constraint,
)

TOL = dict(atol=1e-6, rtol=1e-6)
LR = 1e-3


def arange(*shape):
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def constraints_in(lowered) -> list[str]:
    """The sharding-constraint lines of a lowered function's StableHLO."""
    return [line for line in lowered.as_text().splitlines() if "sharding_constraint" in line]


# ----------------------------------------------------------------------------- outside


def test_outside_any_context_both_return_the_same_object():
    x = arange(8, 4)
    tree = {"a": x, "b": [jnp.ones(3)]}
    assert with_sharding_constraint(x, PS("fsdp")) is x
    assert with_sharding_constraint(tree, FSDPShardingRule(min_fsdp_size=0)) is tree
    assert with_sharding_constraint(tree, PS("no_such_axis", "x", "y")) is tree
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about unknown names outside a context
        assert with_sharding_annotation(x, "anything") is x
        assert with_sharding_annotation(tree, "weights") is tree


def test_same_model_code_runs_under_plain_jax_jit():
    def fn(x):
        x = with_sharding_constraint(x * 2, PS("fsdp"))
        return with_sharding_annotation(x + 1, "activations")

    np.testing.assert_array_equal(jax.jit(fn)(arange(8)), arange(8) * 2 + 1)


# ----------------------------------------------------------------------------- inside


def test_constraint_inside_a_context_reshards_eagerly(dp2_fsdp4):
    with dp2_fsdp4.get_context():
        y = with_sharding_constraint(jnp.asarray(arange(8, 4)), PS("fsdp"))
        tree = with_sharding_constraint(
            {"w": jnp.asarray(arange(8, 4)), "b": jnp.asarray(arange(3))},
            FSDPShardingRule(min_fsdp_size=0),
        )
    assert y.sharding == NamedSharding(dp2_fsdp4.mesh, PS("fsdp"))
    np.testing.assert_array_equal(y, arange(8, 4))
    assert tree["w"].sharding == NamedSharding(dp2_fsdp4.mesh, PS("fsdp", None))
    assert tree["b"].sharding.is_fully_replicated


def test_constraint_rules_and_prefix_trees_inside_sjit(dp2_fsdp4):
    def fn(params, x):
        params = with_sharding_constraint(params, FSDPShardingRule(min_fsdp_size=0))
        h = x @ params["w"] + params["b"]
        h = with_sharding_constraint({"h": h, "z": h * 0}, {"h": PS("dp", "fsdp"), "z": None})
        return h["h"]

    f = dp2_fsdp4.sjit(fn)
    params = {"w": arange(4, 8), "b": arange(8)}
    x = arange(8, 4)
    np.testing.assert_array_equal(f(params, x), x @ params["w"] + params["b"])
    lines = constraints_in(f.lower(params, x))
    assert len(lines) == 3  # b, w, h; None leaves get no constraint
    assert sum('[{"fsdp"}]' in line for line in lines) == 1  # b (8,)
    assert sum('[{}, {"fsdp"}]' in line for line in lines) == 1  # w (4, 8): dim 1
    assert sum('[{"dp"}, {"fsdp"}]' in line for line in lines) == 1  # h


def test_indivisible_constraint_names_path_shape_spec_and_mesh(dp2_fsdp4):
    def fn(x):
        return with_sharding_constraint({"act": x}, PS("fsdp"))["act"]

    with pytest.raises(ValueError, match=r"'act'.*\(6, 2\).*'fsdp'.*\{'dp': 2, 'fsdp': 4\}"):
        dp2_fsdp4.sjit(fn)(arange(6, 2))


def test_unknown_axis_in_a_constraint_lists_the_mesh_axes(dp2_fsdp4):
    def fn(x):
        return with_sharding_constraint(x, PS("tp"))

    with pytest.raises(ValueError, match=r"'tp'.*\('dp', 'fsdp'\)"):
        dp2_fsdp4.sjit(fn)(arange(8))


def test_spec_longer_than_rank_in_a_constraint(fsdp8):
    with pytest.raises(ValueError, match=r"\(8,\).*rank"):
        fsdp8.sjit(lambda x: with_sharding_constraint(x, PS("fsdp", None)))(arange(8))


def test_globals_inside_the_sjit_trace(dp2_fsdp4):
    seen = {}
    annotations = {"act": PS("fsdp")}

    def fn(x):
        seen["helper"] = get_global_mesh_helper()
        seen["mesh"] = get_global_mesh()
        seen["annotations"] = get_global_annotation_shardings()
        seen["abstract_axes"] = tuple(jax.sharding.get_abstract_mesh().axis_names)
        return x + 1

    dp2_fsdp4.sjit(fn, annotation_shardings=annotations)(arange(8))
    assert seen == {
        "helper": dp2_fsdp4,
        "mesh": dp2_fsdp4.mesh,
        "annotations": annotations,
        "abstract_axes": ("dp", "fsdp"),
    }
    assert get_global_mesh_helper() is None  # and gone afterwards


# ----------------------------------------------------------------------------- annotations


def test_known_annotations_are_applied(dp2_fsdp4):
    def fn(w, x):
        w = with_sharding_annotation(w, "weights")
        h = with_sharding_annotation(x @ w, "activations")
        return with_sharding_annotation(h, "free")

    f = dp2_fsdp4.sjit(
        fn,
        annotation_shardings={
            "weights": FSDPShardingRule(min_fsdp_size=0),
            "activations": PS(("dp", "fsdp")),
            "free": None,  # known, deliberately unconstrained: no warning
        },
    )
    w, x = arange(4, 16), arange(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(f(w, x), x @ w)
        lines = constraints_in(f.lower(w, x))
    assert len(lines) == 2
    assert any('[{}, {"fsdp"}]' in line for line in lines)
    assert any('[{"dp", "fsdp"}, {}]' in line for line in lines)


def test_unknown_annotation_warns_once_per_trace_naming_known_names(fsdp8):
    def fn(x):
        x = with_sharding_annotation(x, "actvations")  # typo
        return with_sharding_annotation(x * 2, "actvations")

    f = fsdp8.sjit(fn, annotation_shardings={"weights": PS(), "activations": PS("fsdp")})
    with pytest.warns(UserWarning) as record:
        np.testing.assert_array_equal(f(arange(8)), arange(8) * 2)
        f(arange(8))  # cached: not traced again
    messages = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "'actvations'" in messages[0]
    assert "activations" in messages[0].replace("'actvations'", "") and "weights" in messages[0]
    with pytest.warns(UserWarning, match="actvations") as record:
        f(arange(16))  # a new shape: traced again, warned again (once)
    assert len([w for w in record if "actvations" in str(w.message)]) == 1


def test_unknown_annotation_warns_once_with_out_shardings(fsdp8):
    f = fsdp8.sjit(
        lambda x: with_sharding_annotation(x, "nope") + 1,
        out_shardings=PS("fsdp"),
        annotation_shardings={"known": PS()},
    )
    with pytest.warns(UserWarning) as record:
        f(arange(8))
    assert len([w for w in record if "'nope'" in str(w.message)]) == 1


# ----------------------------------------------------------------------------- seed examples


def init_state(seed=0):
    # One weight of 2**20 elements reaches the default min_fsdp_size, so the seed's
    # FSDPShardingRule() shards it; the rest stays replicated.
    rng = np.random.default_rng(seed)
    sizes = (8, 256, 4096, 1)
    return {
        "layers": [
            {
                "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                "b": (0.1 * rng.standard_normal(b)).astype(np.float32),
            }
            for a, b in zip(sizes[:-1], sizes[1:])
        ]
    }


def make_batch(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 1)).astype(np.float32),
    }


def forward(params, x, activation_hook=lambda h: h):
    *hidden, last = params["layers"]
    for layer in hidden:
        x = activation_hook(jnp.tanh(x @ layer["w"] + layer["b"]))
    return x @ last["w"] + last["b"]


def reference_step(train_state, batch):
    def loss_fn(params):
        return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(train_state)
    return jax.tree.map(lambda p, g: p - LR * g, train_state, grads), {"loss": loss}


def compare_with_reference(train_step, steps=3):
    start = state = ref_state = init_state()
    batch = make_batch()
    reference = jax.jit(reference_step)
    for _ in range(steps):
        state, metrics = train_step(state, batch)
        ref_state, ref_metrics = reference(ref_state, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], **TOL)
    assert_trained_alike(state, ref_state, start, steps=steps, optimizer="sgd")
    assert ref_metrics["loss"] < reference_step(init_state(), batch)[1]["loss"]
    return state, batch


def test_seed_with_sharding_constraint_example():
    from shardax.sharding import (
        FSDPShardingRule,
        PartitionSpec,
        with_sharding_constraint,
    )

    mesh = MeshShardingHelper([-1], ['fsdp'])  # Create a 1D mesh with fsdp axis

    @partial(
        mesh.sjit,
        in_shardings=(FSDPShardingRule(), None),  # Shard the train_state using FSDP
        out_shardings=(FSDPShardingRule(), None),
        args_sharding_constraint=(FSDPShardingRule(), PartitionSpec('fsdp')),
    )
    def train_step(train_state, batch):
        def loss_fn(params):
            return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(train_state)
        intermediate_pytree = grads
        intermediate_pytree = with_sharding_constraint(
            intermediate_pytree, FSDPShardingRule(),
        )
        updated_train_state = jax.tree.map(
            lambda p, g: p - LR * g, train_state, intermediate_pytree
        )
        metrics = {"loss": loss}
        return updated_train_state, metrics

    state, batch = compare_with_reference(train_step)
    assert state["layers"][1]["w"].sharding.spec == PS(None, "fsdp")
    lines = constraints_in(train_step.lower(state, batch))
    # args: 6 params + 2 batch leaves; grads: 6 leaves.
    assert len(lines) == 14
    assert sum('[{}, {"fsdp"}]' in line for line in lines) == 2  # w of 2**20: arg and grad
    assert sum('[{"fsdp"}, {}]' in line for line in lines) == 2  # the batch


def test_seed_with_sharding_annotation_example():
    from shardax.sharding import (
        FSDPShardingRule,
        PartitionSpec,
        with_sharding_annotation,
    )

    mesh = MeshShardingHelper([-1], ['fsdp'])  # Create a 1D mesh with fsdp axis

    @partial(
        mesh.sjit,
        in_shardings=(FSDPShardingRule(), None),  # Shard the train_state using FSDP
        out_shardings=(FSDPShardingRule(), None),
        args_sharding_constraint=(FSDPShardingRule(), PartitionSpec('fsdp')),
        annotation_shardings={
            'weights': FSDPShardingRule(),
            'activations': PartitionSpec('fsdp'),
        }
    )
    def train_step(train_state, batch):
        def loss_fn(params):
            weights_pytree = params
            weights_pytree = with_sharding_annotation(
                weights_pytree, 'weights',
            )

            def hook(activations):
                activations = with_sharding_annotation(
                    activations, 'activations',
                )
                return activations

            out = forward(weights_pytree, batch["x"], activation_hook=hook)
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(train_state)
        updated_train_state = jax.tree.map(lambda p, g: p - LR * g, train_state, grads)
        metrics = {"loss": loss}
        return updated_train_state, metrics

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # both names are known
        state, batch = compare_with_reference(train_step)
    lines = constraints_in(train_step.lower(state, batch))
    # args: 8 leaves; 'weights': 6 leaves; 'activations': 2 hidden layers. The backward pass
    # constrains the cotangents of the 8 annotated values the same way.
    assert len(lines) == 8 + 2 * (6 + 2)
    assert sum('[{}, {"fsdp"}]' in line for line in lines) == 3  # the 2**20 w: arg, fwd, bwd
    assert sum('[{"fsdp"}, {}]' in line for line in lines) == 2 + 2 * 2  # batch; activations
