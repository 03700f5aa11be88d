"""sjit functions under JAX transformations behave like a nested ``jax.jit`` with their shardings.

Each case compares values with the same sjit function called at top level (and with the plain
function on one device), and reads the inner shardings from the outer program's lowered text.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from shardax.sharding import (
    FSDPShardingRule,
    MeshShardingHelper,
    PartitionSpec,
    get_global_mesh,
    with_sharding_annotation,
    with_sharding_constraint,
)

P = PartitionSpec


@pytest.fixture(scope="module")
def mesh():
    return MeshShardingHelper([2, 4], ["dp", "fsdp"])


def _fn(x):
    return jnp.sin(x) * 2.0 + x.sum()


@pytest.fixture(scope="module")
def inner(mesh):
    return mesh.sjit(_fn, in_shardings=P("fsdp"), out_shardings=P(None, "fsdp"))


X = jnp.arange(64.0).reshape(8, 8) / 64.0


def _constraints(text: str) -> list[str]:
    """The sharding-constraint lines of a lowered program (Shardy or GSPMD spelling)."""
    return [line for line in text.splitlines() if "sharding_constraint" in line
            or "custom_call @Sharding" in line]


def _has_constraint(text: str, *axes_per_dim: str) -> bool:
    """True if some constraint line shards the dims as given (``'fsdp'`` or ``''``)."""
    sdy = "[" + ", ".join("{" + (f'"{a}"' if a else "") + "}" for a in axes_per_dim) + "]"
    return any(sdy in line for line in _constraints(text))


def test_top_level_call_is_the_reference(inner):
    out = inner(X)
    np.testing.assert_allclose(out, _fn(X), rtol=1e-6)
    assert out.sharding.spec == P(None, "fsdp")


def test_under_jit(mesh, inner):
    outer = jax.jit(lambda x: inner(x + 1.0) - 1.0)
    np.testing.assert_allclose(outer(X), inner(X + 1.0) - 1.0, rtol=1e-6)
    text = outer.lower(X).as_text()
    assert _has_constraint(text, "fsdp", ""), _constraints(text)
    assert _has_constraint(text, "", "fsdp"), _constraints(text)


def test_under_eval_shape_the_train_state_idiom(mesh):
    @mesh.sjit
    def init_fn(rng):
        return {"w": jax.random.normal(rng, (16, 8)), "b": jnp.zeros(8)}

    shapes = jax.eval_shape(lambda: init_fn(jax.random.PRNGKey(0)))
    assert shapes["w"].shape == (16, 8) and shapes["b"].dtype == jnp.float32
    fsdp_init = mesh.sjit(init_fn.fun, out_shardings=FSDPShardingRule(min_fsdp_size=0))
    assert jax.eval_shape(fsdp_init, jax.random.PRNGKey(0))["w"].shape == (16, 8)


def test_under_grad_and_vjp(inner):
    loss = lambda x: (inner(x) ** 2).sum()  # noqa: E731
    reference = lambda x: (_fn(x) ** 2).sum()  # noqa: E731
    np.testing.assert_allclose(jax.grad(loss)(X), jax.grad(reference)(X), rtol=1e-5)
    out, pullback = jax.vjp(inner, X)
    ref_out, ref_pullback = jax.vjp(_fn, X)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(pullback(jnp.ones_like(X))[0], ref_pullback(jnp.ones_like(X))[0],
                               rtol=1e-5)
    text = jax.jit(jax.grad(loss)).lower(X).as_text()
    assert _has_constraint(text, "fsdp", ""), _constraints(text)


def test_under_vmap_the_mapped_axis_is_left_unsharded(mesh, inner):
    xs = jnp.stack([X, X * 2.0, X * 3.0])
    out = jax.vmap(inner)(xs)
    np.testing.assert_allclose(out, jnp.stack([inner(x) for x in xs]), rtol=1e-6)
    text = jax.jit(jax.vmap(inner)).lower(xs).as_text()
    assert _has_constraint(text, "", "fsdp", ""), _constraints(text)


def test_under_scan_and_checkpoint(inner):
    def body(carry, _):
        return inner(carry) / 10.0, carry.sum()

    carry, sums = jax.lax.scan(body, X, None, length=3)
    expected = X
    for _ in range(3):
        expected = inner(expected) / 10.0
    np.testing.assert_allclose(carry, expected, rtol=1e-5)
    assert sums.shape == (3,)
    remat = jax.checkpoint(lambda x: (inner(x) ** 2).sum())
    np.testing.assert_allclose(jax.grad(remat)(X), jax.grad(lambda x: (_fn(x) ** 2).sum())(X),
                               rtol=1e-5)


def test_inside_another_sjit(mesh, inner):
    outer = mesh.sjit(lambda x: inner(x) + 1.0, in_shardings=P(), out_shardings=P("dp"))
    out = outer(X)
    np.testing.assert_allclose(out, inner(X) + 1.0, rtol=1e-6)
    assert out.sharding.spec == P("dp")
    assert _has_constraint(outer.lower(X).as_text(), "fsdp", "")


def test_inner_annotations_apply_when_nested(mesh):
    inner = mesh.sjit(lambda x: with_sharding_annotation(x * 3.0, "act"),
                      annotation_shardings={"act": P(None, "dp")})
    outer = jax.jit(lambda x: inner(x))
    np.testing.assert_allclose(outer(X), X * 3.0)
    assert _has_constraint(outer.lower(X).as_text(), "", "dp")


def test_get_context_inside_a_traced_function(mesh):
    @jax.jit
    def f(x):
        with mesh.get_context():
            assert get_global_mesh() is mesh.mesh
            y = with_sharding_constraint(x * 2.0, P("fsdp"))
            return jax.lax.with_sharding_constraint(y, P(None, "dp"))  # a bare spec works too

    np.testing.assert_allclose(f(X), X * 2.0)
    text = f.lower(X).as_text()
    assert _has_constraint(text, "fsdp", "") and _has_constraint(text, "", "dp")
    assert get_global_mesh() is None


def test_top_level_path_is_unchanged_after_nested_use(mesh, inner):
    jax.jit(lambda x: inner(x))(X)
    out = inner(X)
    assert isinstance(out.sharding, NamedSharding) and out.sharding.spec == P(None, "fsdp")


def test_shard_map_on_the_global_mesh_nested(mesh):
    """scalax code names the mesh with ``MeshShardingHelper.get_global_mesh()`` (ring attention)."""

    def double(x):
        return jax.shard_map(lambda b: b * 2.0, mesh=MeshShardingHelper.get_global_mesh(),
                             in_specs=P("fsdp"), out_specs=P("fsdp"))(x)

    step = mesh.sjit(double)
    np.testing.assert_allclose(jax.jit(lambda x: step(x))(X), X * 2.0)
    np.testing.assert_allclose(jax.grad(lambda x: step(x).sum())(X), jnp.full_like(X, 2.0))
