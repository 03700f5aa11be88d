"""Tensor parallelism (sync / sequence-parallel / async collective matmul) vs one device.

Tolerance: rtol = atol = 1e-5 in float32. Results are not bit-exact because row-parallel
layers add ``tp`` partial products (and SP/async layers multiply sequence chunks) in a different
order than one big ``x @ w`` on one device; the rounding of that reduction order differs.
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardax.parallel import axis_size, column_parallel, row_parallel, tp_mlp

AUTO = jax.sharding.AxisType.Auto
TOL = dict(rtol=1e-5, atol=1e-5)
MODES = [("sync", False), ("sync", True), ("async", True), ("async_bidi", True)]
MODE_IDS = ["sync", "sp", "async", "async_bidi"]
B, S, D, F = 4, 8, 16, 32  # batch, sequence, model dim, ffn dim


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


MESHES = {"dp2_tp4": ((2, 4), ("dp", "tp")), "tp8": ((8,), ("tp",))}


def rand(i, shape):
    """N(0, 1) activations; 2-D weights scaled by 1/sqrt(fan_in) so activations stay O(1)."""
    x = np.random.default_rng(i).standard_normal(shape, np.float32)
    return jnp.asarray(x / np.sqrt(shape[0]) if len(shape) == 2 else x)


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def collectives(hlo: str) -> Counter:
    """Count collective ops in optimized HLO text (async pairs are counted once, at -start)."""
    ops = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
    return Counter(m.group(1) for m in re.finditer(rf"\s({ops})(?:-start)?\(", hlo))


def value_and_grads(f, args, ct):
    """(f(*args), grads of sum(f(*args) * ct) w.r.t. every arg), in one jit."""

    def loss(*a):
        y = f(*a)
        return jnp.sum(y * ct), y

    n = len(args)
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n)), has_aux=True))(*args)
    return y, grads


def reference(ref, args):
    """Cotangent, value and gradients of ``ref`` on one device (no mesh set)."""
    ct = rand(99, jax.eval_shape(ref, *args).shape)
    return (ct, *value_and_grads(ref, args, ct))


def assert_matches_reference(f, ref, args, mesh, expected=None):
    ct, y_ref, g_ref = expected or reference(ref, args)
    with jax.set_mesh(mesh):
        y, g = value_and_grads(f, args, ct)
    np.testing.assert_allclose(y, y_ref, **TOL)
    for gi, gi_ref in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(gi, gi_ref, **TOL)


def compiled_hlo(f, args, mesh):
    with jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile().as_text()


def dense(x, w, b):
    return x @ w + b


def mlp_ref(x, w_in, w_out):
    return jax.nn.gelu(x @ w_in) @ w_out


# --- values and gradients ------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "sp"), MODES, ids=MODE_IDS)
def test_column_parallel_matches_one_device(mode, sp):
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x = put(mesh, rand(0, (B, S, D)), "dp", "tp" if sp else None)
    w, b = put(mesh, rand(1, (D, F)), None, "tp"), rand(2, (F,))
    f = lambda x, w, b: column_parallel(x, w, b, mode=mode, sequence_parallel=sp)
    assert_matches_reference(f, dense, (x, w, b), mesh)


@pytest.mark.parametrize(("mode", "sp"), MODES, ids=MODE_IDS)
def test_row_parallel_matches_one_device(mode, sp):
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x = put(mesh, rand(0, (B, S, F)), "dp", None, "tp")
    w, b = put(mesh, rand(1, (F, D)), "tp", None), rand(2, (D,))
    f = lambda x, w, b: row_parallel(x, w, b, mode=mode, sequence_parallel=sp)
    assert_matches_reference(f, dense, (x, w, b), mesh)


@pytest.mark.parametrize(("mode", "sp"), MODES, ids=MODE_IDS)
def test_mlp_matches_one_device_on_tp8(mode, sp):
    mesh = make_mesh((8,), ("tp",))
    args = (rand(0, (B, S, D)), rand(1, (D, F)), rand(2, (F, D)))
    f = lambda x, a, b: tp_mlp(x, a, b, mode=mode, sequence_parallel=sp)
    assert_matches_reference(f, mlp_ref, args, mesh)


def test_async_weights_interchangeable_with_sync_on_fsdp_tp_mesh():
    """Same global weights (sharded fsdp x tp) give the same result in sync and async modes."""
    mesh = make_mesh((2, 4), ("fsdp", "tp"))
    x = put(mesh, rand(0, (B, S, D)), "fsdp", "tp")
    w_in, w_out = put(mesh, rand(1, (D, F)), "fsdp", "tp"), put(mesh, rand(2, (F, D)), "tp", "fsdp")
    expected = reference(mlp_ref, (x, w_in, w_out))
    for mode in ("sync", "async_bidi"):
        f = lambda x, a, b, mode=mode: tp_mlp(x, a, b, mode=mode, sequence_parallel=True)
        assert_matches_reference(f, mlp_ref, (x, w_in, w_out), mesh, expected)


def test_async_ring_on_odd_tp_size():
    """tp=3: the bidirectional ring splits n - 1 = 2 hops into 1 forward + 1 backward."""
    mesh = jax.make_mesh((3,), ("tp",), axis_types=(AUTO,), devices=jax.devices()[:3])
    args = (rand(0, (2, 6, 12)), rand(1, (12, 9)), rand(2, (9, 12)))
    f = lambda x, a, b: tp_mlp(x, a, b, mode="async_bidi")
    assert_matches_reference(f, mlp_ref, args, mesh)


@pytest.mark.parametrize(("mode", "sp"), MODES[1:], ids=MODE_IDS[1:])
def test_batch_axes_keep_dp_sharded_batch_local(mode, sp):
    """With batch_axes=('dp',) every collective stays inside a tp group (no dp gathers)."""
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x = put(mesh, rand(0, (B, S, D)), "dp")
    w_in, w_out = put(mesh, rand(1, (D, F)), None, "tp"), put(mesh, rand(2, (F, D)), "tp", None)
    f = lambda x, a, b: tp_mlp(x, a, b, mode=mode, sequence_parallel=sp, batch_axes=("dp",))
    assert_matches_reference(f, mlp_ref, (x, w_in, w_out), mesh)
    hlo = compiled_hlo(f, (x, w_in, w_out), mesh)
    lines = [ln for ln in hlo.splitlines() if re.search(r"\s(all-gather|reduce-scatter)\(", ln)]
    assert len(lines) == (2 if mode == "sync" else 0), lines
    assert all("replica_groups={{0,1,2,3},{4,5,6,7}}" in ln for ln in lines), lines


@pytest.mark.parametrize(("mode", "sp"), [MODES[0], MODES[3]], ids=["sync", "async_bidi"])
def test_attention_heads_split_over_tp(mode, sp):
    """Column-parallel Q/K/V (heads over tp) + row-parallel output projection."""
    heads, head_dim = 4, D // 4
    kw = dict(mode=mode, sequence_parallel=sp)

    def attention(x, wq, wk, wv, wo, col=column_parallel, row=row_parallel, kw=kw):
        split = lambda t: t.reshape(*t.shape[:-1], heads, head_dim)
        q, k, v = (split(col(x, w, **kw)) for w in (wq, wk, wv))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return row(o.reshape(*o.shape[:-2], heads * head_dim), wo, **kw)

    plain = lambda x, w, b=None, **_: x @ w
    ref = lambda *a: attention(*a, col=plain, row=plain)
    mesh = make_mesh((2, 4), ("dp", "tp"))
    args = (rand(0, (B, S, D)), *(rand(i, (D, D)) for i in (1, 2, 3, 4)))
    assert_matches_reference(attention, ref, args, mesh)
    ops = collectives(compiled_hlo(attention, args, mesh))
    if mode == "sync":
        assert ops == Counter({"all-reduce": 1}), ops  # heads stay local: one all-reduce
    else:
        assert ops["all-gather"] == 0 and ops["all-reduce"] == 0, ops
        assert ops["collective-permute"] > 0, ops


# --- collectives in the optimized HLO -------------------------------------------------------


def _layer_hlo(op, mode, sp, mesh):
    if op == "column":
        args = (rand(0, (B, S, D)), rand(1, (D, F)))
        f = lambda x, w: column_parallel(x, w, mode=mode, sequence_parallel=sp)
    else:
        args = (rand(0, (B, S, F)), rand(1, (F, D)))
        f = lambda x, w: row_parallel(x, w, mode=mode, sequence_parallel=sp)
    return compiled_hlo(f, args, mesh)


def test_hlo_sync_column_has_no_collectives_and_row_all_reduces():
    mesh = make_mesh((2, 4), ("dp", "tp"))
    assert collectives(_layer_hlo("column", "sync", False, mesh)) == Counter()
    assert collectives(_layer_hlo("row", "sync", False, mesh)) == Counter({"all-reduce": 1})


def test_hlo_sequence_parallel_all_gather_and_reduce_scatter():
    mesh = make_mesh((2, 4), ("dp", "tp"))
    assert collectives(_layer_hlo("column", "sync", True, mesh)) == Counter({"all-gather": 1})
    hlo = _layer_hlo("row", "sync", True, mesh)
    ops = collectives(hlo)
    # XLA:CPU may lower reduce-scatter as all-reduce + dynamic-slice.
    assert ops == Counter({"reduce-scatter": 1}) or (
        ops == Counter({"all-reduce": 1}) and "dynamic-slice" in hlo
    ), ops


def _permute_directions(hlo: str, n: int) -> set[int]:
    """Ring steps (+1 / -1 mod n) of every collective-permute's source_target_pairs."""
    steps = set()
    for pairs in re.findall(r"source_target_pairs=\{(.*?)\}\}", hlo):
        for src, dst in re.findall(r"(\d+),(\d+)", pairs):
            steps.add((int(dst) - int(src)) % n)
    return steps


@pytest.mark.parametrize("op", ["column", "row"])
@pytest.mark.parametrize("mode", ["async", "async_bidi"])
def test_hlo_async_uses_only_collective_permutes(op, mode):
    mesh = make_mesh((2, 4), ("dp", "tp"))
    hlo = _layer_hlo(op, mode, True, mesh)
    # tp=4: 3 chunks arrive (uni: 3 forward hops; bidi: 2 forward + 1 backward hop).
    assert collectives(hlo) == Counter({"collective-permute": 3}), collectives(hlo)
    assert _permute_directions(hlo, 4) == ({1} if mode == "async" else {1, 3})


@pytest.mark.parametrize("mode", ["async", "async_bidi"])
def test_hlo_async_mlp_gradients_have_no_all_gather(mode):
    mesh = make_mesh((8,), ("tp",))
    args = (rand(0, (B, S, D)), rand(1, (D, F)), rand(2, (F, D)))
    loss = lambda x, a, b: jnp.sum(tp_mlp(x, a, b, mode=mode) ** 2)
    ops = collectives(compiled_hlo(jax.grad(loss, argnums=(0, 1, 2)), args, mesh))
    assert ops["all-gather"] == 0 and ops["collective-permute"] > 0, ops


def test_megatron_mlp_one_all_reduce_per_block_forward():
    args = (rand(0, (B, S, D)), *(rand(i, s) for i, s in enumerate([(D, F), (F, D)] * 2, 1)))

    def two_blocks(x, a1, b1, a2, b2):
        return tp_mlp(tp_mlp(x, a1, b1), a2, b2)

    for shape, names in MESHES.values():
        mesh = make_mesh(shape, names)
        assert collectives(compiled_hlo(two_blocks, args, mesh)) == Counter({"all-reduce": 2})


def test_megatron_mlp_gradient_one_all_reduce_each_way():
    mesh = make_mesh((8,), ("tp",))
    args = (rand(0, (B, S, D)), rand(1, (D, F)), rand(2, (F, D)))
    loss = lambda x, a, b: jnp.sum(tp_mlp(x, a, b) ** 2)
    ops = collectives(compiled_hlo(jax.grad(loss, argnums=(0, 1, 2)), args, mesh))
    assert ops == Counter({"all-reduce": 2}), ops  # forward g + backward f (Megatron)


# --- single-device fallback -----------------------------------------------------------------


def test_no_mesh_is_plain_dense():
    x, w, b = rand(0, (B, S, D)), rand(1, (D, F)), rand(2, (F,))
    assert axis_size("tp") == 1
    for mode in ("sync", "async", "async_bidi"):
        np.testing.assert_array_equal(column_parallel(x, w, b, mode=mode), x @ w + b)
        np.testing.assert_array_equal(row_parallel(x, w, b, mode=mode), x @ w + b)
        np.testing.assert_array_equal(tp_mlp(x, w, w.T, mode=mode), mlp_ref(x, w, w.T))


@pytest.mark.parametrize(("shape", "names"), [((8,), ("dp",)), ((8, 1), ("dp", "tp"))])
def test_mesh_without_tp_is_plain_dense(shape, names):
    mesh = make_mesh(shape, names)
    args = (rand(0, (B, S, D)), rand(1, (D, F)), rand(2, (F, D)))
    f = lambda x, a, b: tp_mlp(x, a, b, mode="async_bidi")
    with jax.set_mesh(mesh):
        assert axis_size("tp") == 1
        np.testing.assert_array_equal(jax.jit(f)(*args), jax.jit(mlp_ref)(*args))
    assert collectives(compiled_hlo(f, args, mesh)) == Counter()


# --- bad input ------------------------------------------------------------------------------


def _raises(match, f, *args, mesh_shape=(2, 4)):
    mesh = make_mesh(mesh_shape, ("dp", "tp"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(f)(*args)


def test_hidden_not_divisible_names_axis_size_dim_and_shape():
    x = rand(0, (B, S, D))
    _raises(
        r"w dimension 1 \(out\) of size 30 in shape \(16, 30\).*'tp' of size 4",
        column_parallel,
        x,
        rand(1, (D, 30)),
    )
    _raises(
        r"w dimension 0 \(in\) of size 30 in shape \(30, 16\).*'tp' of size 4",
        row_parallel,
        rand(0, (B, S, 30)),
        rand(1, (30, D)),
    )


def test_sequence_not_divisible_names_axis_size_dim_and_shape():
    x, w = rand(0, (B, 6, D)), rand(1, (D, F))
    for mode in ("sync", "async", "async_bidi"):
        f = lambda x, w, mode=mode: column_parallel(x, w, mode=mode, sequence_parallel=True)
        _raises(
            r"x dimension 1 \(sequence\) of size 6 in shape \(4, 6, 16\).*'tp' of size 4", f, x, w
        )
    f = lambda x, w: row_parallel(x, w, mode="async")
    _raises(
        r"sequence\) of size 6 in shape \(4, 6, 32\).*'tp' of size 4",
        f,
        rand(0, (B, 6, F)),
        rand(1, (F, D)),
    )


def test_bad_arguments():
    x, w = rand(0, (B, S, D)), rand(1, (D, F))
    _raises(
        r"x\[\.\.\., in\] and w\[in, out\].*\(4, 8, 16\).*\(32, 16\)",
        column_parallel,
        x,
        rand(1, (F, D)),
    )
    _raises("mode must be one of", lambda x, w: column_parallel(x, w, mode="ring"), x, w)
    _raises(
        "needs sequence-parallel",
        lambda x, w: row_parallel(x, w.T, mode="async", sequence_parallel=False),
        x @ w,
        w,
    )
    _raises(r"expected b of shape \(32,\)", column_parallel, x, w, rand(2, (D,)))
    _raises(
        "seq_dim=-1", lambda x, w: column_parallel(x, w, sequence_parallel=True, seq_dim=-1), x, w
    )
    _raises(
        r"x dimension 0 \(batch\) of size 3 .*\{'dp': 2\}",
        lambda x, w: column_parallel(x, w, batch_axes=("dp",)),
        rand(0, (3, S, D)),
        w,
    )
    _raises(r"batch_axes=\('tp',\)", lambda x, w: column_parallel(x, w, batch_axes="tp"), x, w)


def test_inside_shard_map_over_tp_is_rejected():
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x, w = rand(0, (B, S, D)), rand(1, (D, F))
    inner = jax.shard_map(
        lambda x, w: column_parallel(x, w),
        in_specs=(P(), P(None, "tp")),
        out_specs=P(None, None, "tp"),
        axis_names={"tp"},
    )
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="already manual"):
        jax.jit(inner)(x, w)
