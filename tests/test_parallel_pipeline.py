"""Pipeline parallelism (shardax.parallel.pipeline) against the sequential single-device scan.

Tolerance: float32, rtol = atol = 1e-5. The pipeline runs the same per-layer math on
microbatches, so the only differences are float32 summation order inside the matmuls and the
gradient sums over microbatches (observed max abs error <= 2e-6 on these sizes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import assert_trained_alike
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardax.parallel import axis_size
from shardax.parallel.pipeline import (
    bubble_fraction,
    from_stage_layout,
    pipeline,
    sequential,
    stage_specs,
    to_stage_layout,
)

TOL = dict(rtol=1e-5, atol=1e-5)
D, BATCH = 8, 16


def layer(p, h):
    return h + jnp.tanh(h @ p["w"] + p["b"])


def ref_scan(p, x):
    """Independent reference: a plain lax.scan over the sequential layer stack."""
    return lax.scan(lambda h, pi: (layer(pi, h), None), x, p)[0]


def make(num_layers, seed=0, batch=BATCH):
    k = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w": jax.random.normal(k[0], (num_layers, D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k[1], (num_layers, D)),
    }
    return params, jax.random.normal(k[2], (batch, D))


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def put(mesh, tree, specs):
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def shard_inputs(mesh, params, x):
    """Stage-sharded params; fsdp/tp/dp shardings on the rest are left for XLA to propagate."""
    names = mesh.axis_names
    if "tp" in names:
        inner = {"w": P("fsdp", "tp"), "b": P("tp")}
        return put(mesh, params, stage_specs(params, layer_specs=inner)), put(mesh, x, P("fsdp"))
    batch = P("dp") if "dp" in names else P()
    return put(mesh, params, stage_specs(params)), put(mesh, x, batch)


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


CASES = [  # mesh shape, axis names, schedule, V, M, remat
    ((2, 2, 2), ("pp", "fsdp", "tp"), "gpipe", 1, 4, True),
    ((2, 2, 2), ("pp", "fsdp", "tp"), "circular", 2, 2, False),
    ((4, 2), ("pp", "dp"), "gpipe", 1, 2, False),  # M < P is allowed for gpipe
    ((4, 2), ("pp", "dp"), "circular", 2, 4, True),
    ((8,), ("pp",), "gpipe", 1, 8, True),
    ((8,), ("pp",), "circular", 2, 8, True),
]


@pytest.mark.parametrize("shape,names,schedule,v,m,remat", CASES)
def test_forward_and_grads_match_sequential(shape, names, schedule, v, m, remat):
    pp = shape[0]
    params, x = make(max(8, pp * v))

    def loss(p, x):
        y = pipeline(
            layer, p, x, num_microbatches=m, schedule=schedule, virtual_stages=v, remat=remat
        )
        return jnp.mean(jnp.sin(y) * y), y

    mesh = mesh_of(shape, names)
    sp, sx = shard_inputs(mesh, to_stage_layout(params, pp, v), x)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        compiled = step.lower(sp, sx).compile()
        (_, y), (gp, gx) = compiled(sp, sx)
    assert "collective-permute" in compiled.as_text()

    ref_loss = lambda p, x: jnp.mean(jnp.sin(ref_scan(p, x)) * ref_scan(p, x))
    rgp, rgx = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
    assert_close(y, jax.jit(ref_scan)(params, x))
    assert_close(from_stage_layout(gp, pp, v), rgp)
    assert_close(gx, rgx)
    assert float(jnp.max(jnp.abs(gx))) > 0  # the input gradient really flows back


@pytest.mark.parametrize(
    "shape,names,schedule,v,m",
    [((2, 2, 2), ("pp", "fsdp", "tp"), "gpipe", 1, 4), ((4, 2), ("pp", "dp"), "circular", 2, 4)],
)
def test_loss_on_stage_with_pytree_activations(shape, names, schedule, v, m):
    """loss_fn runs where the outputs are; grads flow to params, inputs and loss_args."""
    pp = shape[0]
    params, x = make(8, seed=1)
    target = jax.random.normal(jax.random.key(2), (BATCH, D))
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (BATCH, D)))

    def layer2(p, hg):  # pytree activations: (hidden, gate)
        h, g = hg
        return h + g * jnp.tanh(h @ p["w"] + p["b"]), 0.9 * g

    def mse(out, t):
        return jnp.mean((out[0] - t) ** 2)

    def loss(p, x, g, t):
        return pipeline(
            layer2,
            p,
            (x, g),
            num_microbatches=m,
            schedule=schedule,
            virtual_stages=v,
            loss_fn=mse,
            loss_args=(t,),
        )

    def ref_loss(p, x, g, t):
        return mse(lax.scan(lambda hg, pi: (layer2(pi, hg), None), (x, g), p)[0], t)

    mesh = mesh_of(shape, names)
    sp, sx = shard_inputs(mesh, to_stage_layout(params, pp, v), x)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(sp, sx, gate, target)
    want = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3)))(params, x, gate, target)
    assert_close(got[0], want[0])
    assert_close(from_stage_layout(got[1][0], pp, v), want[1][0])
    assert_close(got[1][1:], want[1][1:])


ONE_F_ONE_B_CASES = [  # mesh shape, axis names, M, remat
    ((4, 2), ("pp", "dp"), 4, True),
    ((2, 2, 2), ("pp", "fsdp", "tp"), 8, False),
    ((4, 2), ("pp", "dp"), 2, True),  # M < P: only warm-up and cool-down overlap
    ((8,), ("pp",), 1, False),
]


@pytest.mark.parametrize("shape,names,m,remat", ONE_F_ONE_B_CASES)
def test_1f1b_matches_sequential(shape, names, m, remat):
    """1F1B: the loss (with and without differentiation) and the gradients of params, inputs,
    per-row loss inputs and shared loss inputs equal the sequential single-device program."""
    params, x = make(8, seed=1)
    target = jax.random.normal(jax.random.key(2), (BATCH, D))
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (BATCH, D)))
    scale = jnp.float32(1.5)

    def layer2(p, hg):  # pytree activations: (hidden, gate)
        h, g = hg
        return h + g * jnp.tanh(h @ p["w"] + p["b"]), 0.9 * g

    def mse(out, t, scale):  # a mean over rows: the mean over microbatches equals it
        return scale * jnp.mean((out[0] - t) ** 2)

    def loss(p, x, g, t, scale):
        return pipeline(layer2, p, (x, g), num_microbatches=m, schedule="1f1b", remat=remat,
                        loss_fn=mse, loss_batch_args=(t,), loss_args=(scale,))

    def ref_loss(p, x, g, t, scale):
        return mse(lax.scan(lambda hg, pi: (layer2(pi, hg), None), (x, g), p)[0], t, scale)

    mesh = mesh_of(shape, names)
    sp, sx = shard_inputs(mesh, params, x)
    args = (gate, target, scale)
    with jax.set_mesh(mesh):
        value = jax.jit(loss)(sp, sx, *args)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(sp, sx, *args)
        only_params = jax.jit(jax.grad(loss))(sp, sx, *args)
    want = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3, 4)))(params, x, *args)
    assert_close(value, want[0])
    assert_close(got, want)
    assert_close(only_params, want[1][0])
    assert float(jnp.max(jnp.abs(got[1][1]))) > 0  # the input gradient really flows back


@pytest.mark.parametrize("shape,names,schedule,v", [
    ((4, 2), ("pp", "dp"), "1f1b", 1),
    ((4, 2), ("pp", "dp"), "gpipe", 1),  # circular shares gpipe's loss path
    ((2, 2, 2), ("pp", "fsdp", "tp"), "1f1b", 1),
    ((8,), ("dp",), "1f1b", 1),  # no 'pp' axis: the sequential path
])
def test_loss_has_aux_reports_values_without_gradient(shape, names, schedule, v):
    """loss_has_aux: loss_fn's aux comes back (as jax.value_and_grad(has_aux=True) would give
    it: averaged over microbatches under 1f1b, which for row means is the whole-batch value)
    and carries no gradient; the loss and its gradients equal the sequential program's."""
    params, x = make(8, seed=4)
    target = jax.random.normal(jax.random.key(5), (BATCH, D))

    def loss_and_metrics(out, t):
        err = out - t
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err)), "max": jnp.max(err, axis=0)}

    def loss(p, x, t):
        total, aux = pipeline(layer, p, x, num_microbatches=4, schedule=schedule,
                              virtual_stages=v, loss_fn=loss_and_metrics, loss_batch_args=(t,),
                              loss_has_aux=True)
        # aux carries no gradient: adding it changes the value, not the gradients
        return total + aux["mae"] + jnp.sum(aux["max"]), (total, aux)

    def ref_loss(p, x, t):
        total, aux = loss_and_metrics(ref_scan(p, x), t)
        return total, (total, aux)

    mesh = mesh_of(shape, names)
    if "pp" in names:
        sp, sx = shard_inputs(mesh, params, x)
    else:
        sp, sx = params, put(mesh, x, P("dp"))
    with jax.set_mesh(mesh):
        (_, (total, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                                              has_aux=True))(sp, sx, target)
    (_, (ref_total, ref_aux)), ref_grads = jax.jit(
        jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))(params, x, target)
    assert_close(total, ref_total)
    assert_close(aux["mae"], ref_aux["mae"])
    assert_close(grads, ref_grads)
    if schedule == "1f1b":  # per-microbatch max, averaged: not the batch max, but each is <= it
        assert np.all(np.asarray(aux["max"]) <= np.asarray(ref_aux["max"]) + 1e-6)
    else:
        assert_close(aux["max"], ref_aux["max"])


@pytest.mark.parametrize("remat", [True, False])
def test_1f1b_closed_over_values_get_gradients(remat):
    """A traced value layer_fn closes over (a weight shared by every layer) is differentiated
    like an argument; a loss_fn closing over one is refused (its gradient would be lost)."""
    params, x = make(8, seed=2)
    shared = jax.random.normal(jax.random.key(7), (D, D)) / np.sqrt(D)

    def layer_with(shared):
        return lambda lp, h: h + jnp.tanh(h @ lp["w"] + lp["b"] + h @ shared)

    def loss(p, x, shared, scale):
        return pipeline(layer_with(shared), p, x, num_microbatches=4, schedule="1f1b",
                        remat=remat, loss_fn=lambda out, scale: scale * jnp.mean(out**2),
                        loss_args=(scale,))

    def ref_loss(p, x, shared, scale):
        out = lax.scan(lambda h, lp: (layer_with(shared)(lp, h), None), x, p)[0]
        return scale * jnp.mean(out**2)

    mesh = mesh_of((4, 2), ("pp", "dp"))
    sp, sx = shard_inputs(mesh, params, x)
    want = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3)))(params, x, shared, 2.0)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(sp, sx, shared, 2.0)
        assert_close(got, want)
        assert float(jnp.max(jnp.abs(got[1][2]))) > 0

        def closes_over_scale(p, x, scale):
            return pipeline(layer, p, x, num_microbatches=4, schedule="1f1b",
                            loss_fn=lambda out: scale * jnp.mean(out**2))

        with pytest.raises(ValueError, match="loss_fn closes over traced float values"):
            jax.jit(jax.grad(closes_over_scale, argnums=2))(sp, sx, 2.0)


def test_1f1b_activation_memory_does_not_grow_with_microbatches():
    """GPipe (with remat) keeps every layer input of every microbatch until the backward pass:
    per extra microbatch at least K = L/P layer inputs. 1F1B keeps at most 2P - 1 stage inputs;
    per extra microbatch it grows only by the batch-sized buffers (the microbatched input and
    its gradient: 2 microbatch inputs). Read from the compiled programs (float32, pp=4, dp=2,
    L=16 so K=4, microbatch input 128x64 per device = 32 KiB)."""
    d, mb, num_layers, pp = 64, 256, 16, 4
    mb_bytes = (mb // 2) * d * 4
    mesh = mesh_of((pp, 2), ("pp", "dp"))

    def layer_big(p, h):
        return h + jnp.tanh(jnp.tanh(h @ p["w"]) @ p["w"].T)

    def temp(schedule, m):
        x = jax.ShapeDtypeStruct((mb * m, d), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
        w = jax.ShapeDtypeStruct((num_layers, d, d), jnp.float32,
                                 sharding=NamedSharding(mesh, P("pp")))

        def loss(p, x):
            return pipeline(layer_big, p, x, num_microbatches=m, schedule=schedule,
                            loss_fn=lambda out: jnp.mean(out**2))

        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower({"w": w}, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    slope = {s: (temp(s, 32) - temp(s, 16)) / 16 for s in ("gpipe", "1f1b")}
    assert slope["gpipe"] >= (num_layers // pp) * mb_bytes, slope
    assert slope["1f1b"] <= 2.5 * mb_bytes, slope
    assert temp("1f1b", 32) < 0.6 * temp("gpipe", 32)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sgd_training_matches_single_device(schedule):
    """3 SGD steps of a tiny MLP classifier (pp=4, dp=2) equal single-device training."""
    din, classes, num_layers, lr = 6, 3, 8, 0.5
    k = jax.random.split(jax.random.key(4), 5)
    hidden, _ = make(num_layers, seed=5)
    params = {
        "w_in": jax.random.normal(k[0], (din, D)) / np.sqrt(din),
        "hidden": hidden,
        "w_out": jax.random.normal(k[1], (D, classes)) / np.sqrt(D),
    }
    xs = jax.random.normal(k[2], (3, BATCH, din))
    ys = jax.random.randint(k[3], (3, BATCH), 0, classes)

    def xent(h, y, w_out):
        logp = jax.nn.log_softmax(h @ w_out)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def loss_pp(p, x, y):
        return pipeline(
            layer,
            p["hidden"],
            jnp.tanh(x @ p["w_in"]),
            num_microbatches=4,
            schedule=schedule,
            loss_fn=xent,
            loss_batch_args=(y,),
            loss_args=(p["w_out"],),
        )

    def loss_ref(p, x, y):
        return xent(ref_scan(p["hidden"], jnp.tanh(x @ p["w_in"])), y, p["w_out"])

    def sgd(loss_fn):
        @jax.jit
        def step(p, x, y):
            val, g = jax.value_and_grad(loss_fn)(p, x, y)
            return jax.tree.map(lambda a, b: a - lr * b, p, g), val

        return step

    mesh = mesh_of((4, 2), ("pp", "dp"))
    specs = {"w_in": P(), "hidden": stage_specs(hidden), "w_out": P()}
    p_pp, p_ref = put(mesh, params, specs), params
    step_pp, step_ref = sgd(loss_pp), sgd(loss_ref)
    losses_pp, losses_ref = [], []
    with jax.set_mesh(mesh):
        for i in range(3):
            p_pp, l_pp = step_pp(p_pp, put(mesh, xs[i], P("dp")), put(mesh, ys[i], P("dp")))
            losses_pp.append(l_pp)
    for i in range(3):
        p_ref, l_ref = step_ref(p_ref, xs[i], ys[i])
        losses_ref.append(l_ref)
    assert_close(losses_pp, losses_ref)
    assert_trained_alike(p_pp, p_ref, params, steps=3, optimizer="sgd")  # fails if not trained


def test_no_pipeline_axis_is_sequential():
    params, x = make(8)
    want = jax.jit(ref_scan)(params, x)
    f = jax.jit(
        lambda p, x: pipeline(
            layer, p, x, num_microbatches=4, schedule="circular", virtual_stages=2
        )
    )
    np.testing.assert_array_equal(f(params, x), want)  # no mesh at all
    for shape, names in [((8,), ("dp",)), ((1, 8), ("pp", "dp"))]:
        mesh = mesh_of(shape, names)
        with jax.set_mesh(mesh):
            assert axis_size("pp") == 1
            np.testing.assert_allclose(f(params, x), want, **TOL)
    np.testing.assert_array_equal(sequential(layer, params, x), ref_scan(params, x))


def test_bubble_fraction():
    assert bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("gpipe", 4, 16) == pytest.approx(3 / 19)
    assert bubble_fraction("gpipe", 1, 4) == 0.0
    assert bubble_fraction("circular", 4, 4, 2) == pytest.approx(3 / 11)
    assert bubble_fraction("circular", 8, 8, 4) == pytest.approx(7 / 39)
    assert bubble_fraction("circular", 4, 4, 1) == bubble_fraction("gpipe", 4, 4)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        bubble_fraction("gpipe", 4, 4, 2)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        bubble_fraction("circular", 4, 0, 2)


def test_stage_layout():
    layers = jnp.arange(8)
    np.testing.assert_array_equal(to_stage_layout(layers, 2, 2), [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(to_stage_layout(layers, 4, 1), layers)
    np.testing.assert_array_equal(to_stage_layout(layers, 1, 4), layers)
    # Layer i lives on stage (i // K) % P with K = L / (P V); stage s owns rows [s L/P, (s+1) L/P).
    for num_layers, p, v in [(8, 2, 2), (16, 2, 4), (16, 4, 2), (24, 4, 3)]:
        order = np.asarray(to_stage_layout(jnp.arange(num_layers), p, v))
        k = num_layers // (p * v)
        for row, i in enumerate(order):
            assert row // (num_layers // p) == (i // k) % p
    params, _ = make(16)
    back = from_stage_layout(to_stage_layout(params, 4, 2), 4, 2)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    assert stage_specs(params) == {"w": P("pp"), "b": P("pp")}
    assert stage_specs(params, "stage", {"w": P(None, "tp"), "b": None}) == {
        "w": P("stage", None, "tp"),
        "b": P("stage"),
    }


def test_errors():
    mesh = mesh_of((4, 2), ("pp", "dp"))
    params, x = make(8)
    run = lambda p, x, **kw: pipeline(layer, p, x, mesh=mesh, **kw)
    with pytest.raises(ValueError, match=r"L=6 .*'pp' size 4"):
        run(make(6)[0], x, num_microbatches=4)
    with pytest.raises(ValueError, match=r"L=8 .*'pp' size 4 x virtual_stages 4 = 16"):
        run(params, x, num_microbatches=4, schedule="circular", virtual_stages=4)
    with pytest.raises(ValueError, match=r"\(10, 8\).*num_microbatches=4"):
        run(params, x[:10], num_microbatches=4)
    with pytest.raises(ValueError, match=r"axis 'pp' of size 4 .*num_microbatches >= 4 \(got 2\)"):
        run(params, x, num_microbatches=2, schedule="circular", virtual_stages=2)
    mismatch = r"\['w'\] of shape \(8, 8, 8\) has 8 layers but \['b'\] of shape \(4, 8\) has 4"
    with pytest.raises(ValueError, match=mismatch):
        run({"w": params["w"], "b": params["b"][:4]}, x, num_microbatches=4)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        run(params, x, num_microbatches=4, schedule="zb")
    with pytest.raises(ValueError, match="'gpipe' and '1f1b' need 1"):
        run(params, x, num_microbatches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="'1f1b' got virtual_stages=2"):
        run(params, x, num_microbatches=4, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="'1f1b' .* needs loss_fn"):
        run(params, x, num_microbatches=4, schedule="1f1b")
    mse = lambda out, t: jnp.mean((out - t) ** 2)
    with pytest.raises(ValueError, match=r"loss_batch_args leaf \[0\] of shape \(8, 8\) .* \(16\)"):
        run(params, x, num_microbatches=4, loss_fn=mse, loss_batch_args=(x[:8],))
    with pytest.raises(ValueError, match="needs loss_fn to return a scalar"):
        run(params, x, num_microbatches=4, schedule="1f1b", loss_fn=lambda o: o)
    no_aux = r"loss_has_aux=True needs loss_fn to return \(loss, aux\)"
    with pytest.raises(ValueError, match=no_aux):
        run(params, x, num_microbatches=4, loss_fn=lambda o: jnp.mean(o), loss_has_aux=True)
    with pytest.raises(ValueError, match=no_aux):
        run(params, x, num_microbatches=4, schedule="1f1b", loss_fn=lambda o: jnp.mean(o),
            loss_has_aux=True)
    with pytest.raises(ValueError, match="loss_has_aux=True needs a loss_fn"):
        run(params, x, num_microbatches=4, loss_has_aux=True)
    with pytest.raises(ValueError, match=r"leaf x\[1\] has dtype int32"):
        pipeline(lambda p, h: (layer(p, h[0]), h[1]), params, (x, jnp.zeros(BATCH, jnp.int32)),
                 num_microbatches=4, schedule="1f1b", loss_fn=lambda o: jnp.mean(o[0]), mesh=mesh)
    with pytest.raises(ValueError, match="same structure, shapes and dtypes"):
        pipeline(lambda p, h: h[:, :4], params, x, num_microbatches=4, mesh=mesh)
    with pytest.raises(ValueError, match=r"L=6 .*'pp' size 4 x virtual_stages 1"):
        to_stage_layout(make(6)[0], 4)


def test_explicit_mesh_argument():
    """mesh= works without a context mesh (params and input placed by the caller)."""
    mesh = mesh_of((8,), ("pp",))
    params, x = make(8)
    sp, sx = shard_inputs(mesh, params, x)
    f = jax.jit(lambda p, x: pipeline(layer, p, x, num_microbatches=2, mesh=mesh))
    assert "collective-permute" in f.lower(sp, sx).compile().as_text()
    assert_close(f(sp, sx), jax.jit(ref_scan)(params, x))
