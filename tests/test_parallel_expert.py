"""Expert parallelism: the ep-sharded MoE MLP equals the single-device reference.

Tolerance: float32, rtol = atol = 1e-5 for outputs, aux losses and gradients (the sharded
program sums the same terms in a different order: psum of router statistics, all-to-all'd
expert matmuls). Routing decisions (dropped_fraction, expert_fraction) are compared exactly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import assert_trained_alike
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardax.parallel.expert import expert_capacity, init_moe_params, moe_mlp, moe_param_specs

TOL = dict(rtol=1e-5, atol=1e-5)
E, D, H = 8, 8, 16
X_SHAPE = (8, 8, D)  # 64 tokens
MESHES = {"ep8": ((8,), ("ep",)), "ep4_fsdp2": ((4, 2), ("ep", "fsdp"))}


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


@functools.cache
def _data(gated=True):
    # numpy draws: compiling jax.random's threefry costs seconds of CPU per shape on this host.
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    params = {
        # Large router weights give confident, uneven routing, so small capacities really drop.
        "router_w": normal(D, E),
        "w_in": normal(E, D, H) * D**-0.5,
        "w_gate": normal(E, D, H) * D**-0.5,
        "w_out": normal(E, H, D) * H**-0.5,
    }
    if not gated:
        del params["w_gate"]
    return normal(*X_SHAPE), params, normal(*X_SHAPE)


def _objective(x, params, r, **kw):
    y, aux = moe_mlp(x, **params, **kw)
    loss = jnp.sum(y * r) + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"]
    return loss, (y, aux)


def _value_and_grad(**kw):
    f = jax.value_and_grad(_objective, argnums=(0, 1), has_aux=True)
    return jax.jit(lambda x, p, r: f(x, p, r, **kw))


def _shard(mesh, x, params, r):
    """Tokens over every mesh axis; experts over ep (and d over fsdp when there is one)."""
    batch = P(mesh.axis_names)
    specs = moe_param_specs(params)
    if "fsdp" in mesh.axis_names:
        specs = {k: P() if k == "router_w" else P("ep", "fsdp") for k in specs}
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    return put(x, batch), jax.tree.map(put, params, specs), put(r, batch)


@functools.cache
def _reference(top_k, capacity_factor, num_groups, gated=True):
    x, params, r = _data(gated)
    return _value_and_grad(top_k=top_k, capacity_factor=capacity_factor, num_groups=num_groups)(
        x, params, r
    )


def _assert_equal(got, want):
    (loss, (y, aux)), grads = got
    (loss_r, (y_r, aux_r)), grads_r = want
    np.testing.assert_allclose(y, y_r, **TOL)
    np.testing.assert_allclose(loss, loss_r, **TOL)
    np.testing.assert_array_equal(aux["dropped_fraction"], aux_r["dropped_fraction"])
    np.testing.assert_array_equal(aux["expert_fraction"], aux_r["expert_fraction"])
    for k in ("load_balancing_loss", "router_z_loss"):
        np.testing.assert_allclose(aux[k], aux_r[k], **TOL, err_msg=k)
    np.testing.assert_allclose(grads[0], grads_r[0], **TOL, err_msg="d/dx")
    assert set(grads[1]) == set(grads_r[1])
    for k in grads[1]:
        np.testing.assert_allclose(grads[1][k], grads_r[1][k], **TOL, err_msg=f"d/d{k}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [float(E), 0.5], ids=["no_drop", "drop"])
def test_sharded_equals_reference(mesh_name, top_k, capacity_factor):
    mesh = _mesh(mesh_name)
    ep = mesh.shape["ep"]
    want = _reference(top_k, capacity_factor, ep)
    dropped = want[0][1][1]["dropped_fraction"]
    if capacity_factor >= E / top_k:
        assert dropped == 0.0
    else:
        assert dropped > 0.1
    with jax.set_mesh(mesh):
        got = _value_and_grad(top_k=top_k, capacity_factor=capacity_factor)(*_shard(mesh, *_data()))
    _assert_equal(got, want)


def test_ungated_experts_and_num_groups_make_it_mesh_invariant():
    # 8 routing groups on an ep=4 mesh: each device routes 2 groups; same function as ep=8.
    x, params, r = _data(gated=False)
    want = _reference(2, 0.5, 8, gated=False)
    # The mesh is passed explicitly here instead of through jax.set_mesh.
    mesh = _mesh("ep4_fsdp2")
    got = _value_and_grad(top_k=2, capacity_factor=0.5, num_groups=8, mesh=mesh)(
        *_shard(mesh, x, params, r)
    )
    assert got[0][1][0].sharding.spec == P(("ep", "fsdp"))  # y stays token-sharded
    _assert_equal(got, want)


def test_batch_axes_split_tokens_over_fsdp_too():
    # Tokens split over (ep, fsdp): 8 routing groups, experts gathered over fsdp inside.
    mesh = _mesh("ep4_fsdp2")
    with jax.set_mesh(mesh):
        f = _value_and_grad(top_k=2, capacity_factor=0.5, batch_axes=("fsdp",))
        args = _shard(mesh, *_data())
        got = f(*args)
        hlo = f.lower(*args).compile().as_text()
    _assert_equal(got, _reference(2, 0.5, 8))
    # Each device exchanges only its own group: [E, C, d] with C = ceil(0.5 * 8 * 2 / E) = 1.
    a2a = [line for line in hlo.splitlines() if " all-to-all(" in line]
    assert a2a and all("f32[2,1,8]" in line for line in a2a)


def _naive_moe(x, params, top_k, capacity_factor, num_groups):
    """Token-by-token loop over the documented routing rule (float64 numpy)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    tokens = np.asarray(x, np.float64).reshape(-1, D)
    group = len(tokens) // num_groups
    cap = expert_capacity(group, E, top_k, capacity_factor)
    logits = tokens @ p["router_w"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choices = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    y = np.zeros_like(tokens)
    kept = 0
    for g in range(num_groups):
        used = np.zeros(E, int)
        for k in range(top_k):
            for t in range(g * group, (g + 1) * group):
                e = choices[t, k]
                if used[e] == cap:
                    continue
                used[e] += 1
                kept += 1
                gates = probs[t, choices[t]]
                gate = gates[k] / gates.sum() if top_k > 1 else gates[k]
                a = tokens[t] @ p["w_gate"][e]
                h = a / (1 + np.exp(-a)) * (tokens[t] @ p["w_in"][e])
                y[t] += gate * (h @ p["w_out"][e])
    frac = np.bincount(choices.ravel(), minlength=E) / choices.size
    lb = E * np.sum(frac * probs.mean(0))
    return y.reshape(x.shape), lb, 1 - kept / choices.size


@pytest.mark.parametrize("top_k,num_groups", [(1, 1), (2, 4)])
def test_reference_matches_naive_routing_rule(top_k, num_groups):
    x, params, _ = _data()
    y, aux = jax.jit(
        lambda x, p: moe_mlp(x, **p, top_k=top_k, capacity_factor=0.75, num_groups=num_groups)
    )(x, params)
    y_n, lb_n, dropped_n = _naive_moe(x, params, top_k, 0.75, num_groups)
    assert dropped_n > 0.1
    np.testing.assert_allclose(y, y_n, **TOL)
    np.testing.assert_allclose(aux["load_balancing_loss"], lb_n, **TOL)
    np.testing.assert_allclose(aux["dropped_fraction"], dropped_n, **TOL)


def test_hlo_has_all_to_all():
    x, params, _ = _data()
    fwd = jax.jit(lambda x, p: moe_mlp(x, **p, top_k=2)[0])
    assert "all-to-all" not in fwd.lower(x, params).compile().as_text()
    mesh = _mesh("ep4_fsdp2")
    with jax.set_mesh(mesh):
        xs, ps, _ = _shard(mesh, x, params, x)
        hlo = fwd.lower(xs, ps).compile().as_text()
    assert hlo.count("all-to-all(") >= 2, "dispatch and combine should each be an all-to-all"


def _sgd(params, x, target, steps=4, lr=0.5, **kw):
    """Plain SGD on a tiny MoE regression (residual + MoE); returns params and the losses."""

    def loss_fn(p):
        y, aux = moe_mlp(x, **p, top_k=2, capacity_factor=1.0, **kw)
        return jnp.mean((x + y - target) ** 2) + 0.01 * aux["load_balancing_loss"]

    @jax.jit
    def step(p):
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), loss

    losses = []
    for _ in range(steps):
        params, loss = step(params)
        losses.append(float(loss))
    return params, losses


def test_sgd_steps_equal_single_device():
    x, params, _ = _data()
    target = jnp.tanh(x[..., ::-1] * 2.0)
    p_ref, losses_ref = _sgd(params, x, target, num_groups=4)
    mesh = _mesh("ep4_fsdp2")
    with jax.set_mesh(mesh):
        xs, ps, ts = _shard(mesh, x, params, target)
        p_sharded, losses = _sgd(ps, xs, ts)
    assert losses[-1] < 0.9 * losses[0]
    np.testing.assert_allclose(losses, losses_ref, **TOL)
    assert_trained_alike(p_sharded, p_ref, params, steps=4, optimizer="sgd")


def test_init_and_specs():
    p = jax.eval_shape(lambda: init_moe_params(jax.random.key(0), D, H, E))
    assert {k: v.shape for k, v in p.items()} == {
        "router_w": (D, E),
        "w_in": (E, D, H),
        "w_gate": (E, D, H),
        "w_out": (E, H, D),
    }
    assert "w_gate" not in jax.eval_shape(
        lambda: init_moe_params(jax.random.key(0), D, H, E, gated=False)
    )
    assert moe_param_specs(p) == {
        "router_w": P(),
        "w_in": P("ep"),
        "w_gate": P("ep"),
        "w_out": P("ep"),
    }


def test_errors():
    # Shapes are checked before any computation, so numpy stand-ins are enough here.
    params = {k: np.zeros(v.shape, np.float32) for k, v in _data()[1].items()}
    x = np.zeros(X_SHAPE, np.float32)
    p6 = {k: v[:6] if k != "router_w" else v[:, :6] for k, v in params.items()}
    mesh = jax.make_mesh((4, 2), ("ep", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"num_experts=6 .*'ep' of size 4.*w_in \(6, 8, 16\)"):
            jax.jit(lambda x, p: moe_mlp(x, **p))(x, p6)
        with pytest.raises(ValueError, match=r"6 tokens \(x \(3, 2, 8\)\).*'ep' of size 4"):
            moe_mlp(np.zeros((3, 2, D), np.float32), **params)
        with pytest.raises(ValueError, match=r"num_groups=6 .*'ep' of size 4"):
            moe_mlp(x, **params, num_groups=6)
        with pytest.raises(ValueError, match=r"batch_axes \['dp'\].*'fsdp': 2"):
            moe_mlp(x, **params, batch_axes=("dp",))
        with pytest.raises(ValueError, match=r"num_groups=4 .*'ep' of size 4 x batch_axes"):
            moe_mlp(x, **params, batch_axes=("fsdp",), num_groups=4)
    with pytest.raises(ValueError, match=r"top_k=9 .*num_experts=8"):
        moe_mlp(x, **params, top_k=9)
    with pytest.raises(ValueError, match=r"inconsistent shapes .*w_out \(8, 8, 16\)"):
        moe_mlp(x, params["router_w"], params["w_in"], params["w_in"])
    with pytest.raises(ValueError, match=r"capacity_factor"):
        moe_mlp(x, **params, capacity_factor=0.0)
