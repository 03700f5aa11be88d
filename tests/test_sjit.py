"""``sjit``: jax.jit with sharding rules, checked against plain ``jax.jit`` on one device.

Tolerances: the elementwise and routing tests are exact. Sharded train steps reduce in a
different order than one device (partial sums + all-reduce), so they are compared at
atol = rtol = 1e-5 (float32); the seed's FSDP example, whose small leaves stay replicated, at
1e-6.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import shardax.sharding as sharding
from shardax.sharding import (
    FSDPShardingRule,
    MeshShardingHelper,
    PartitionSpec,
    TreePathShardingRule,
)

TOL = dict(atol=1e-5, rtol=1e-5)
LR_WIDE = 1e-3  # SGD step for the 4096-wide seed model (0.1 diverges there)


@pytest.fixture(scope="module")
def mesh():
    return MeshShardingHelper([-1], ["fsdp"])


@pytest.fixture(scope="module")
def mesh3d():
    return MeshShardingHelper([2, 2, 2], ["dp", "fsdp", "tp"])


def arange(*shape, dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def spec_of(x):
    """The spec of a NamedSharding, padded with None to the array's rank."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


# ----------------------------------------------------------------------------- a small MLP


def init_mlp(sizes=(8, 32, 16, 4), seed=0):
    rng = np.random.default_rng(seed)
    return {
        "layers": [
            {
                "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                "b": (0.1 * rng.standard_normal(b)).astype(np.float32),
            }
            for a, b in zip(sizes[:-1], sizes[1:])
        ]
    }


def make_batch(n=16, d_in=8, d_out=4, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, d_in)).astype(np.float32),
        "y": rng.standard_normal((n, d_out)).astype(np.float32),
    }


def mlp(params, x):
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def loss_fn(params, batch):
    return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)


def sgd_step(params, batch, lr=0.1):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params, {"loss": loss, "grads": grads}


def assert_trees_close(actual, expected, **tol):
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol),
        actual,
        expected,
    )


# ----------------------------------------------------------------------------- train steps


def test_seed_fsdp_train_step_as_written_matches_jax_jit():
    """The seed's first example, verbatim apart from the import, with SGD for 3 steps."""
    from shardax.sharding import FSDPShardingRule, MeshShardingHelper, PartitionSpec

    mesh = MeshShardingHelper([-1], ["fsdp"])  # Create a 1D mesh with fsdp axis

    @partial(
        mesh.sjit,
        in_shardings=(FSDPShardingRule(), None),  # Shard the train_state using FSDP
        out_shardings=(FSDPShardingRule(), None),
        args_sharding_constraint=(FSDPShardingRule(), PartitionSpec("fsdp")),
    )
    def train_step(train_state, batch):
        updated_train_state, metrics = sgd_step(train_state, batch, lr=LR_WIDE)
        return updated_train_state, metrics

    # One weight of 2**20 elements reaches the default min_fsdp_size and is sharded.
    state = init_mlp(sizes=(8, 256, 4096, 1))
    batch = make_batch(d_out=1)
    reference = jax.jit(partial(sgd_step, lr=LR_WIDE))
    ref_state = state
    for _ in range(3):
        state, metrics = train_step(state, batch)
        ref_state, ref_metrics = reference(ref_state, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], atol=1e-6, rtol=1e-6)
    assert_trees_close(state, ref_state, atol=1e-6, rtol=1e-6)
    assert spec_of(state["layers"][1]["w"]) == (None, "fsdp")  # 256 x 4096: largest dim
    assert state["layers"][0]["w"].sharding.is_fully_replicated  # below min_fsdp_size
    assert metrics["loss"] < 10 and np.isfinite(metrics["loss"])


MESHES = {
    "fsdp8": (
        ([-1], ["fsdp"]),
        FSDPShardingRule(min_fsdp_size=0),
        PS("fsdp"),
        {"layers/0/w": (None, "fsdp"), "layers/1/w": ("fsdp", None), "layers/2/b": (None,)},
    ),
    "dp2_fsdp2_tp2": (
        ([2, 2, 2], ["dp", "fsdp", "tp"]),
        TreePathShardingRule(
            ("layers/0/w", PS("fsdp", "tp")),
            ("layers/0/b", PS("tp")),
            ("layers/1/w", PS("tp", "fsdp")),
            (".*", FSDPShardingRule(min_fsdp_size=0)),
        ),
        PS(("dp", "fsdp")),
        {"layers/0/w": ("fsdp", "tp"), "layers/1/w": ("tp", "fsdp"), "layers/2/w": ("fsdp", None)},
    ),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_end_to_end_sharded_mlp_matches_one_device(name):
    (dims, names), params_rule, batch_spec, expected_specs = MESHES[name]
    helper = MeshShardingHelper(dims, names)
    step = helper.sjit(
        sgd_step,
        in_shardings=(params_rule, batch_spec),
        out_shardings=(params_rule, {"loss": PS(), "grads": params_rule}),
    )
    reference = jax.jit(sgd_step)
    params = ref_params = init_mlp()
    batch = make_batch()
    for _ in range(3):
        params, metrics = step(params, batch)
        ref_params, ref_metrics = reference(ref_params, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], **TOL)
        assert_trees_close(metrics["grads"], ref_metrics["grads"], **TOL)
    assert_trees_close(params, ref_params, **TOL)
    assert ref_metrics["loss"] < float(loss_fn(init_mlp(), batch))  # it trained
    for path, spec in expected_specs.items():
        _, i, leaf = path.split("/")
        assert spec_of(params["layers"][int(i)][leaf]) == spec, path
        assert spec_of(metrics["grads"]["layers"][int(i)][leaf]) == spec, path
    assert metrics["loss"].sharding.is_fully_replicated


# ----------------------------------------------------------------------------- rule trees


def test_rule_trees_are_prefixes_and_none_means_unspecified(mesh):
    state = {"w": arange(16, 4), "b": arange(4)}
    batch = {"x": arange(8, 2), "n": arange(8, dtype=np.int32)}

    def fn(state, batch):
        return {"w": state["w"] * 2, "b": state["b"] + 1}, batch["x"].sum() + batch["n"].sum()

    f = mesh.sjit(
        fn,
        in_shardings=({"w": PS("fsdp"), "b": None}, PS("fsdp")),
        out_shardings=({"w": PS(None, None), "b": None}, None),
    )
    new_state, total = f(state, batch)
    np.testing.assert_array_equal(new_state["w"], state["w"] * 2)
    np.testing.assert_array_equal(new_state["b"], state["b"] + 1)
    assert float(total) == batch["x"].sum() + batch["n"].sum()
    assert new_state["w"].sharding.is_fully_replicated
    for rules in [(None, None), None, [None, PS()], (None, {"x": None, "n": PS()})]:
        out = mesh.sjit(fn, in_shardings=rules, out_shardings=None)(state, batch)
        np.testing.assert_array_equal(out[0]["w"], state["w"] * 2)


def test_output_shardings_are_what_the_rule_says(mesh3d):
    rule = TreePathShardingRule(("a", PS("tp", "fsdp")), ("b", PS(("dp", "fsdp"))), (".*", PS()))
    f = mesh3d.sjit(
        lambda x: {"a": x * 2, "b": x.sum(1), "c": x[0]}, out_shardings=rule
    )
    out = f(arange(8, 4))
    assert out["a"].sharding == NamedSharding(mesh3d.mesh, PS("tp", "fsdp"))
    assert out["b"].sharding == NamedSharding(mesh3d.mesh, PS(("dp", "fsdp")))
    assert out["c"].sharding.is_fully_replicated
    np.testing.assert_array_equal(out["b"], arange(8, 4).sum(1))


def test_keyword_arguments(mesh):
    def fn(x, *, scale, offset=0.0):
        return x * scale + offset

    f = mesh.sjit(fn, in_shardings=(PS("fsdp"),), out_shardings=PS("fsdp"))
    x = arange(8, 2)
    np.testing.assert_array_equal(f(x, scale=np.float32(3.0)), x * 3)
    np.testing.assert_array_equal(f(x, scale=np.float32(3.0), offset=np.ones(2, np.float32)),
                                  x * 3 + 1)
    assert spec_of(f(x, scale=2.0)) == ("fsdp", None)


# ----------------------------------------------------------------------------- static arguments


def test_static_argnums_including_a_function_and_caching(mesh):
    traces = []

    def apply(x, fn, n):
        traces.append((fn, n))
        for _ in range(n):
            x = fn(x)
        return x

    f = mesh.sjit(apply, in_shardings=(PS("fsdp"),), out_shardings=PS("fsdp"),
                  static_argnums=(1, 2))
    x = arange(8, 2) / 16
    np.testing.assert_allclose(f(x, jnp.tanh, 2), np.tanh(np.tanh(x)), atol=1e-6)
    count = len(traces)
    f(x, jnp.tanh, 2)
    assert len(traces) == count  # cached
    np.testing.assert_allclose(f(x, jnp.sin, 1), np.sin(x), atol=1e-6)
    assert len(traces) > count  # a new static value compiles anew
    count = len(traces)
    f(x, jnp.tanh, 3)
    assert len(traces) > count
    assert spec_of(f(x, jnp.sin, 1)) == ("fsdp", None)


def test_static_argnums_in_the_middle_keep_paths_right(mesh):
    def fn(a, n, b):
        return a * n + b

    f = mesh.sjit(fn, in_shardings=(PS("fsdp"), PS("fsdp")), static_argnums=1)
    np.testing.assert_array_equal(f(arange(8), 3, arange(8)), arange(8) * 4)
    with pytest.raises(ValueError, match=r"'b'.*\(6,\)"):
        f(arange(8), 3, arange(6))


def test_static_argnames(mesh):
    traces = []

    def fn(x, n=1):
        traces.append(n)
        for _ in range(n):
            x = x * 2
        return x

    f = mesh.sjit(fn, in_shardings=(PS("fsdp"),), out_shardings=PS("fsdp"), static_argnames="n")
    x = arange(8)
    np.testing.assert_array_equal(f(x, n=3), x * 8)
    count = len(traces)
    np.testing.assert_array_equal(f(x, n=3), x * 8)
    assert len(traces) == count
    np.testing.assert_array_equal(f(x, n=1), x * 2)
    assert len(traces) > count
    np.testing.assert_array_equal(f(x), x * 2)


def test_static_argnames_passed_positionally(mesh):
    f = mesh.sjit(lambda x, n: x * n if n > 1 else x, static_argnames="n")
    np.testing.assert_array_equal(f(arange(8), 2), arange(8) * 2)


def test_static_argnums_passed_by_keyword(mesh):
    f = mesh.sjit(lambda x, n: x * n if n > 1 else x, static_argnums=1)
    np.testing.assert_array_equal(f(arange(8), n=2), arange(8) * 2)


def test_unhashable_static_argument_is_an_error(mesh):
    f = mesh.sjit(lambda x, opts: x * len(opts), static_argnums=1)
    with pytest.raises((TypeError, ValueError), match="hashable"):
        f(arange(8), [1, 2])
    g = mesh.sjit(lambda x, opts: x, static_argnames="opts")
    with pytest.raises((TypeError, ValueError), match="hashable"):
        g(arange(8), opts={"a": 1})


def test_non_array_leaves_are_static_as_in_eqx_filter_jit(mesh):
    # A function, a string: kept static (each value its own program), returned as they are.
    f = mesh.sjit(lambda x, fn, how: (fn(x), {"fn": fn, "how": how}))
    y, same = f(arange(8), jnp.tanh, "tanh")
    np.testing.assert_allclose(y, jnp.tanh(arange(8)), rtol=1e-6)
    assert same == {"fn": jnp.tanh, "how": "tanh"} and same["fn"] is jnp.tanh
    np.testing.assert_allclose(f(arange(8), jnp.sin, "sin")[0], jnp.sin(arange(8)), rtol=1e-6)
    with pytest.raises(TypeError, match=r"'how/0' of type set .* not hashable"):
        f(arange(8), jnp.tanh, [{1, 2}])
    with pytest.raises(ValueError, match="static"):
        f.get_jitted_function_by_args(arange(8), jnp.tanh, "tanh")


# ----------------------------------------------------------------------------- donation


def test_donate_argnums_and_argnames(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh.mesh, PS("fsdp")))

    f = mesh.sjit(lambda x, y: x + y, in_shardings=(PS("fsdp"), PS("fsdp")),
                  out_shardings=PS("fsdp"), donate_argnums=0)
    x, y = put(arange(8)), put(arange(8))
    np.testing.assert_array_equal(f(x, y), arange(8) * 2)
    assert x.is_deleted() and not y.is_deleted()

    g = mesh.sjit(lambda n, x: x * n, in_shardings=(PS("fsdp"),), out_shardings=PS("fsdp"),
                  static_argnums=0, donate_argnums=1)
    x = put(arange(8))
    np.testing.assert_array_equal(g(3, x), arange(8) * 3)
    assert x.is_deleted()

    h = mesh.sjit(lambda x, *, y: x + y, out_shardings=PS("fsdp"), donate_argnames="y")
    x, y = put(arange(8)), put(arange(8))
    np.testing.assert_array_equal(h(x, y=y), arange(8) * 2)
    assert y.is_deleted() and not x.is_deleted()


def test_donate_argnames_passed_positionally(mesh):
    f = mesh.sjit(lambda x, y: x + y, out_shardings=PS("fsdp"), donate_argnames="x")
    x = jax.device_put(arange(8), NamedSharding(mesh.mesh, PS("fsdp")))
    f(x, arange(8))
    assert x.is_deleted()


# ----------------------------------------------------------------------------- caching


def test_new_shapes_and_dtypes_resolve_rules_again(mesh):
    traces = []

    def double(x):
        traces.append(x.shape)
        return x * 2

    f = mesh.sjit(double, in_shardings=FSDPShardingRule(min_fsdp_size=0),
                  out_shardings=FSDPShardingRule(min_fsdp_size=0))
    out = f(arange(16, 4))
    assert spec_of(out) == ("fsdp", None)
    count = len(traces)
    f(arange(16, 4) + 1)
    assert len(traces) == count
    out = f(arange(4, 16))
    assert spec_of(out) == (None, "fsdp")  # the rule picked another dim for the new shape
    np.testing.assert_array_equal(out, arange(4, 16) * 2)
    count = len(traces)
    out = f(arange(4, 16, dtype=np.int32))
    assert len(traces) > count
    assert out.dtype == np.int32
    assert spec_of(f(arange(3, 5))) == (None, None)  # nothing divisible: replicated
    count = len(traces)
    f({"a": arange(16, 4)}["a"])
    assert len(traces) == count


def test_the_cache_is_keyed_on_the_mesh_not_the_helper_object():
    """Two meshes, one shape, one function: each call runs the program of its own mesh, and
    each mesh keeps its program (traced once each)."""
    traces = []

    def double(x):
        traces.append(x.shape)
        return x * 2

    f = sharding.sjit(double, in_shardings=PS("fsdp"), out_shardings=PS("fsdp"))
    devices = jax.devices()
    forward = MeshShardingHelper([8], ["fsdp"], devices=devices)
    backward = MeshShardingHelper([8], ["fsdp"], devices=devices[::-1])
    x = arange(8)
    with forward.get_context():
        a = f(x)
    with backward.get_context():
        b = f(x)
    assert a.sharding == NamedSharding(forward.mesh, PS("fsdp"))
    assert b.sharding == NamedSharding(backward.mesh, PS("fsdp"))
    first_row_on = {s.device: float(s.data[0]) for s in b.addressable_shards}
    assert first_row_on[devices[0]] == 14.0 and first_row_on[devices[7]] == 0.0
    for helper in (forward, backward, forward):
        with helper.get_context():
            assert f(x).sharding == NamedSharding(helper.mesh, PS("fsdp"))
    assert len(traces) == 2


def test_the_cache_is_bounded_least_recently_used_first(mesh, monkeypatch):
    import shardax.jit as jit_module

    monkeypatch.setattr(jit_module, "CACHE_SIZE", 3)
    traces = []

    def inc(x):
        traces.append(x.shape[0])
        return x + 1

    f = mesh.sjit(inc)
    for n in (1, 2, 3, 1, 4):  # 1 is used again, so 2 is the oldest when 4 arrives
        f(jnp.zeros(n))
    assert traces == [1, 2, 3, 4]
    for n in (3, 1, 4):  # kept: no new trace
        f(jnp.zeros(n))
    assert traces == [1, 2, 3, 4]
    f(jnp.zeros(2))  # dropped: traced again
    assert traces == [1, 2, 3, 4, 2]


def test_the_function_is_traced_once_for_its_output_rules_lower_and_call(mesh):
    """Resolving the output rules traces the function on the abstract values the call and
    ``lower`` pass (committed inputs on their rule's sharding, NumPy ones without), so jit's
    trace cache serves both: one trace, where a second would double the CLI step's lowering."""
    traces = []

    def double(x):
        traces.append(x.shape)
        return x * 2

    committed = jax.device_put(arange(8), NamedSharding(mesh.mesh, PS()))  # moved to 'fsdp'
    for x in (committed, arange(8)):
        f = sharding.sjit(double, in_shardings=PS("fsdp"), out_shardings=PS("fsdp"))
        with mesh.get_context():
            f.lower(x)
            f(x)
        assert len(traces) == 1, traces
        traces.clear()


def test_tree_structure_is_part_of_the_cache_key(mesh):
    f = mesh.sjit(lambda t: jax.tree.map(lambda x: x + 1, t),
                  in_shardings=FSDPShardingRule(min_fsdp_size=0))
    a = f({"a": arange(8)})
    b = f({"a": arange(8), "b": arange(3)})
    assert set(b) == {"a", "b"}
    np.testing.assert_array_equal(a["a"], b["a"])


# ----------------------------------------------------------------------------- the object


def test_sharded_function_object(mesh):
    def fn(x):
        """Doubles."""
        return x * 2

    f = mesh.sjit(fn, in_shardings=PS("fsdp"))
    assert isinstance(hash(f), int)
    assert {f: 1}[f] == 1
    assert f.__name__ == "fn" and f.__doc__ == "Doubles."
    assert callable(f)
    lowered = f.lower(arange(8))
    text = lowered.as_text()
    assert "num_partitions = 8" in text
    assert f.lower(jax.ShapeDtypeStruct((8,), jnp.float32)).as_text() == text
    assert isinstance(repr(f), str)


def test_decorator_forms(mesh):
    @partial(mesh.sjit, in_shardings=(PS("fsdp"),), out_shardings=PS("fsdp"))
    def a(x):
        return x + 1

    @sharding.sjit(in_shardings=PS("fsdp"), mesh=mesh)
    def b(x):
        return x + 2

    np.testing.assert_array_equal(a(arange(8)), arange(8) + 1)
    np.testing.assert_array_equal(b(arange(8)), arange(8) + 2)
    assert spec_of(a(arange(8))) == ("fsdp",)


def test_sjit_without_a_mesh_uses_the_active_context(mesh):
    f = sharding.sjit(lambda x: x * 3, in_shardings=PS("fsdp"), out_shardings=PS("fsdp"))
    with pytest.raises(ValueError, match="no mesh"):
        f(arange(8))
    with mesh.get_context():
        out = f(arange(8))
    np.testing.assert_array_equal(out, arange(8) * 3)
    assert out.sharding == NamedSharding(mesh.mesh, PS("fsdp"))


def test_bare_partition_spec_constraint_inside_sjit(mesh3d):
    def fn(x):
        y = jax.lax.with_sharding_constraint(x * 2, PS("fsdp"))
        return jax.lax.with_sharding_constraint(y + 1, PartitionSpec(None, "tp"))

    f = mesh3d.sjit(fn)
    x = arange(8, 4)
    out = f(x)
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert out.sharding == NamedSharding(mesh3d.mesh, PS(None, "tp"))
    text = f.lower(x).as_text()
    assert 'sdy.sharding_constraint' in text and '[{"fsdp"}, {}]' in text


@pytest.mark.parametrize("where", ["replicated", "one_device", "other_axis"])
def test_committed_input_with_another_sharding_is_resharded(mesh3d, where):
    x = arange(8, 4)
    placed = {
        "replicated": lambda: jax.device_put(x, NamedSharding(mesh3d.mesh, PS())),
        "one_device": lambda: jax.device_put(x, jax.devices()[3]),
        "other_axis": lambda: jax.device_put(x, NamedSharding(mesh3d.mesh, PS(None, "tp"))),
    }[where]()
    f = mesh3d.sjit(lambda x: x - 1, in_shardings=PS(("dp", "fsdp")),
                    out_shardings=PS(("dp", "fsdp")))
    out = f(placed)
    np.testing.assert_array_equal(out, x - 1)
    assert out.sharding == NamedSharding(mesh3d.mesh, PS(("dp", "fsdp")))
    np.testing.assert_array_equal(f(out), x - 2)  # the program's own sharding: no move
    out = f(placed)  # after the first call, a misplaced input is still moved, not refused
    assert out.sharding == NamedSharding(mesh3d.mesh, PS(("dp", "fsdp")))


def test_args_sharding_constraint(mesh):
    f = mesh.sjit(lambda a, b: a @ b, args_sharding_constraint=(PS("fsdp"), None))
    a, b = arange(8, 4), arange(4, 2)
    np.testing.assert_array_equal(f(a, b), a @ b)
    assert f.lower(a, b).as_text().count("sdy.sharding_constraint") == 1
    g = mesh.sjit(lambda a, b: a @ b, args_sharding_constraint=(PS("fsdp"),))
    with pytest.raises(ValueError, match="args_sharding_constraint has 1 entries"):
        g(a, b)


# ----------------------------------------------------------------------------- errors


def test_in_shardings_tuple_of_the_wrong_length(mesh):
    f = mesh.sjit(lambda a, b: a + b, in_shardings=(PS("fsdp"),))
    with pytest.raises(ValueError, match=r"in_shardings has 1 entries.*2 dynamic"):
        f(arange(8), arange(8))
    g = mesh.sjit(lambda a, n: a * n, in_shardings=(PS("fsdp"), None), static_argnums=1)
    with pytest.raises(ValueError, match=r"in_shardings has 2 entries.*1 dynamic"):
        g(arange(8), 2)


def test_indivisible_input_names_path_shape_spec_and_mesh(mesh3d):
    f = mesh3d.sjit(lambda state, batch: batch["x"].sum(),
                    in_shardings=(None, PS(("dp", "fsdp"))))
    msg = r"'batch/x'.*\(6, 4\).*'dp', 'fsdp'.*\{'dp': 2, 'fsdp': 2, 'tp': 2\}"
    with pytest.raises(ValueError, match=msg):
        f({"w": arange(4)}, {"x": arange(6, 4)})


def test_indivisible_output_names_the_output_leaf(mesh):
    f = mesh.sjit(lambda x: {"y": x[:6]}, out_shardings={"y": PS("fsdp")})
    with pytest.raises(ValueError, match=r"out.*'y'.*\(6,\).*'fsdp'.*\{'fsdp': 8\}"):
        f(arange(8))


def test_unknown_mesh_axis_lists_the_mesh_axes(mesh3d):
    f = mesh3d.sjit(lambda x: x, in_shardings=PS("model"))
    with pytest.raises(ValueError, match=r"'model'.*\('dp', 'fsdp', 'tp'\)"):
        f(arange(8))
    g = mesh3d.sjit(lambda x: x, out_shardings=PS("fsdp", "model"))
    with pytest.raises(ValueError, match=r"'model'.*\('dp', 'fsdp', 'tp'\)"):
        g(arange(8, 8))


def test_spec_longer_than_rank_in_in_shardings(mesh):
    f = mesh.sjit(lambda x: x, in_shardings=PS("fsdp", None))
    with pytest.raises(ValueError, match=r"'x'.*\(8,\).*rank"):
        f(arange(8))


def test_static_leaves_next_to_nnx_objects_are_one_clear_error(mesh):
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    f = mesh.sjit(lambda m, x, fn: fn(m(x)))
    with pytest.raises(TypeError, match=r"'fn' is not an array .* NNX"):
        f(model, arange(8).reshape(1, 8), jnp.tanh)
