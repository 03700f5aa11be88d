"""``shardax.models.attention``: every implementation equals the einsum reference (forward and
gradients) for every mask, on one device and under ``sjit`` on fsdp / tp / cp meshes; the KV
cache decodes as full recomputation does; the chunked loss equals the full one; blockwise
temporaries grow linearly with the sequence; remat by name recomputes the same numbers."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as PS

from shardax import models
from shardax.hf import config_from_hf, config_to_hf, load_config
from shardax.hlo import hlo_collectives
from shardax.layout import PRESETS, Layout, forward
from shardax.logical import use_logical_rules
from shardax.models import attention as attn
from shardax.models import loss as loss_mod
from shardax.models._layers import cross_entropy
from shardax.models.decode import generate
from shardax.models.remat import check_remat, remat_policy
from shardax.parallel.remat import checkpoint_in_order
from shardax.rules import LogicalAxisRules
from shardax.sharding import MeshShardingHelper

CPU_IMPLS = ("xla", "blockwise", "auto")
# float32 throughout; the implementations sum in different orders: 1e-5 relative to the
# largest entry holds with a wide margin (observed <= 1e-6).
RTOL = 1e-5


def _qkv(b=2, s=20, h=4, kvh=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(b, s, h, d), (b, s, kvh, d), (b, s, kvh, d), (b, s, h, d)]
    return [rng.standard_normal(sh, np.float32) for sh in shapes]  # q, k, v, cotangent


def _segments(b=2, s=20, seed=1):
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.random((b, s)) < 0.2, axis=1).astype(np.int32)


CASES = {
    "causal": dict(),
    "window": dict(window=5),
    "segments": dict(segment_ids=_segments()),
    "softcap": dict(softcap=2.0, window=7),
    "bidirectional_segments": dict(causal=False, segment_ids=_segments()),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), window=7,
                  segment_ids=_segments()),
}


def _value_and_grads(impl, kw, q, k, v, ct, block=8):
    def f(q, k, v):
        return attn.attention(q, k, v, implementation=impl, block_size=block, **kw)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(ct))


def _close(got, want):
    for g, w in zip(got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, rtol=0, atol=RTOL * scale)


def _check_all(kw, q, k, v, ct):
    """One program: the einsum reference and every CPU implementation, values and grads."""
    run = jax.jit(lambda *a: {i: _value_and_grads(i, kw, *a) for i in ("einsum", *CPU_IMPLS)})
    out = run(q, k, v, ct)
    for impl in CPU_IMPLS:
        _close(out[impl], out["einsum"])
    return out["einsum"]


@pytest.mark.parametrize("case", list(CASES))
def test_implementations_match_einsum(case):
    kw = CASES[case]
    _check_all(kw, *_qkv())


def test_mqa_and_masked_rows():
    """One kv head for all query heads; padding keys (kv_mask) leave a row with no key:
    every implementation gives zeros there."""
    q, k, v, ct = _qkv(h=4, kvh=1)
    kv_mask = np.ones((2, 20), bool)
    kv_mask[:, :3] = False
    ref = _check_all(dict(kv_mask=kv_mask), q, k, v, ct)
    np.testing.assert_array_equal(ref[0][:, :3], 0.0)


def test_sinks_are_a_softmax_column_and_their_gradients_agree():
    """gpt-oss's sinks: the einsum reference is softmax over [scores, sink] with the sink
    dropped (written out here in numpy); blockwise gives the same gradient for the sinks."""
    q, k, v, ct = _qkv(s=12)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
    s = np.where(np.tril(np.ones((12, 12), bool)), s, -np.inf)
    full = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (2, 4, 12, 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    want = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v, 2, axis=2))

    def grads(impl):
        f = lambda q, sk: jnp.vdot(attn.attention(q, k, v, sinks=sk, implementation=impl,
                                                  block_size=4), ct[:, :12])
        return jax.grad(f, argnums=(0, 1))(q, sinks)

    got = jax.jit(lambda: attn.attention(q, k, v, sinks=sinks, implementation="einsum"))()
    _close([got], [want])
    _close(jax.jit(lambda: grads("blockwise"))(), jax.jit(lambda: grads("einsum"))())


def test_einsum_is_the_old_reference():
    """'einsum' equals the models' previous attention (ops.gqa_attention) bit for bit."""
    from shardax.models.ops import gqa_attention

    q, k, v, _ = _qkv()
    got = jax.jit(lambda *a: (attn.attention(*a, implementation="einsum"), gqa_attention(*a)))
    a, b = got(q, k, v)
    np.testing.assert_array_equal(a, b)


def test_blockwise_is_linear_in_memory_for_attention_alone():
    """Forward + backward of attention alone: blockwise temporaries grow ~linearly (x8 seq
    gives <= 10x), the einsum's quadratically."""
    def temp(impl, s):
        q = jax.ShapeDtypeStruct((1, s, 4, 16), jnp.float32)
        k = jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32)
        f = lambda q, k, v: jnp.sum(attn.attention(q, k, v, implementation=impl,
                                                   block_size=128) ** 2)
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, k).compile()
        return c.memory_analysis().temp_size_in_bytes

    assert temp("blockwise", 4096) <= 10 * temp("blockwise", 512)
    assert temp("einsum", 4096) >= 30 * temp("einsum", 512)


def test_auto_and_errors():
    q, k, v, _ = _qkv()
    assert attn.resolve_implementation("auto", q, k) == "xla"
    long = np.zeros((1, attn.BLOCKWISE_MIN_LEN, 2, 8), np.float32)
    assert attn.resolve_implementation("auto", long, long) == "blockwise"
    with pytest.raises(ValueError, match="'cudnn' cannot run.*NVIDIA GPU"):
        attn.attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="must be one of"):
        attn.attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="needs q_positions and kv_positions"):
        attn.attention(q, k[:, :5], v[:, :5])
    with pytest.raises(ValueError, match="attention must be one of"):
        Layout(attention="flash")
    # The layout's (and the decoder's) implementation is the one that runs.
    model = _model(_tiny())
    with pytest.raises(ValueError, match="'cudnn' cannot run"):
        jax.eval_shape(lambda t: forward.logits(model, Layout(attention="cudnn"), t),
                       jax.ShapeDtypeStruct((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="'cudnn' cannot run"):
        generate(model, [[1, 2]], 1, attention="cudnn")


def test_auto_on_an_nvidia_gpu_picks_cudnn_for_packed_rows_up_to_the_dense_mask_limit(
        monkeypatch):
    """The decision alone (cuDNN's numbers are checked on a GPU by
    benchmarks/gpu_attention.py): segment ids and key masks go to cuDNN as a dense mask up to
    CUDNN_DENSE_MASK_MAX_LEN keys under 'auto'; given positions and float32 never do."""
    gpu = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H200"})()
    monkeypatch.setattr(jax, "devices", lambda *a: [gpu])

    def qk(s, dtype=jnp.bfloat16):
        return [jax.ShapeDtypeStruct((1, s, 4, 64), dtype)] * 2

    limit = attn.CUDNN_DENSE_MASK_MAX_LEN
    assert attn.resolve_implementation("auto", *qk(2048)) == "cudnn"
    assert attn.resolve_implementation("auto", *qk(limit), custom_mask=True) == "cudnn"
    assert attn.resolve_implementation("auto", *qk(2 * limit), custom_mask=True) == "blockwise"
    assert attn.resolve_implementation("auto", *qk(2 * limit)) == "cudnn"
    assert attn.resolve_implementation("cudnn", *qk(2 * limit), custom_mask=True) == "cudnn"
    assert attn.resolve_implementation("auto", *qk(2048), positioned=True) == "blockwise"
    assert attn.resolve_implementation("auto", *qk(512, jnp.float32)) == "xla"
    with pytest.raises(ValueError, match="'cudnn' cannot run.*given positions"):
        attn.resolve_implementation("cudnn", *qk(512), positioned=True)
    # jax.nn.dot_product_attention refuses cuDNN a window that also reaches forward
    assert attn.resolve_implementation("auto", *qk(512), two_sided_window=True) == "xla"


# ------------------------------------------------------------------ meshes (sjit, ring)

MESHES = {
    "fsdp": ((8,), ("fsdp",), PS("fsdp")),  # batch 8
    "tp": ((2, 4), ("fsdp", "tp"), PS("fsdp", None, "tp")),
    "cp": ((4, 2), ("cp", "fsdp"), PS("fsdp", "cp")),
}


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_matches_one_device(mesh_name, impl):
    """Under sjit with q/k/v split over the mesh (batch, heads, or the sequence: ring
    attention over 'cp'), window + segment ids + soft-cap, values and gradients equal the
    einsum on one device."""
    dims, names, spec = MESHES[mesh_name]
    b = 8 if mesh_name == "fsdp" else 2
    q, k, v, ct = _qkv(b=b, s=32, h=4, kvh=4 if mesh_name == "tp" else 2)
    segs = _segments(b=b, s=32)
    kw = dict(window=9, segment_ids=segs, softcap=5.0)
    ref = jax.jit(functools.partial(_value_and_grads, "einsum", kw))(q, k, v, ct)
    helper = MeshShardingHelper(dims, names)
    seg_spec = PS(*spec[:2])
    fn = helper.sjit(lambda q, k, v, ct, segs: _value_and_grads(
        impl, dict(kw, segment_ids=segs), q, k, v, ct, block=4),
        in_shardings=(spec, spec, spec, spec, seg_spec), out_shardings=spec)
    _close(fn(q, k, v, ct, segs), ref)


def test_ring_load_balanced_with_window_and_segments():
    """The model's cp path: q, k, v and segment ids in load_balance order."""
    from shardax.layout.forward import ring_attend
    from shardax.parallel import load_balance, unload_balance

    q, k, v, ct = _qkv(b=2, s=32)
    segs = _segments(s=32)
    kw = dict(window=11, segment_ids=segs)
    ref = jax.jit(functools.partial(_value_and_grads, "einsum", kw))(q, k, v, ct)
    mesh = jax.make_mesh((4, 2), ("cp", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def run(q, k, v, ct, segs):
        lb = lambda x: load_balance(x, 4)
        f = lambda q, k, v: ring_attend(True)(q, k, v, window=11, segment_ids=lb(segs),
                                              block_size=4)
        out, vjp = jax.vjp(f, lb(q), lb(k), lb(v))
        return tuple(unload_balance(x, 4) for x in (out, *vjp(lb(ct))))

    with jax.set_mesh(mesh):
        got = jax.jit(run)(q, k, v, ct, segs)
    _close(got, ref)


# ------------------------------------------------------------------ models: decode, window


def _tiny(name="llama-tiny", **kw):
    return models.get_config(name, n_layers=2, **kw)


@functools.cache
def _model(cfg):
    return models.create(cfg, nnx.Rngs(0))


@pytest.mark.parametrize("impl", ["einsum", "xla", "blockwise"])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_decode_with_cache_equals_recompute(name, impl):
    cfg = _tiny(name)
    if name == "llama-tiny":
        cfg = dataclasses.replace(cfg, sliding_window=6)  # Mistral-style window, in decode too
    model = _model(cfg)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    cached = generate(model, prompts, 6, use_cache=True, attention=impl)
    again = generate(model, prompts, 6, use_cache=False, attention=impl)
    assert cached.tokens == again.tokens


def _loss_and_grads(graphdef, impls, tokens, params):
    def loss(impl, p):
        m = nnx.merge(graphdef, p)
        return cross_entropy(forward.logits(m, Layout(attention=impl), tokens[:, :-1]),
                             tokens[:, 1:])

    return {i: jax.value_and_grad(functools.partial(loss, i))(params) for i in impls}


def test_models_match_across_implementations():
    """llama (with a sliding window) and gpt2 logits and gradients: every implementation as
    the einsum."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    for name, extra in (("llama-tiny", dict(sliding_window=5)), ("gpt2-tiny", {})):
        graphdef, params = nnx.split(_model(_tiny(name, **extra)), nnx.Param)
        out = jax.jit(functools.partial(_loss_and_grads, graphdef, ("einsum", *CPU_IMPLS),
                                        tokens))(params)
        for i in CPU_IMPLS:
            np.testing.assert_allclose(out[i][0], out["einsum"][0], rtol=RTOL)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(
                a, b, rtol=0, atol=RTOL * float(np.max(np.abs(b))) + 1e-9),
                out[i][1], out["einsum"][1])


def test_window_changes_the_result_and_mistral_config_reads_it():
    tokens = jnp.asarray(np.arange(40).reshape(2, 20) % 256, jnp.int32)
    plain = _model(_tiny())
    windowed = nnx.merge(nnx.graphdef(_model(_tiny(sliding_window=4))),
                         nnx.state(plain, nnx.Param))
    a, b = plain(tokens), windowed(tokens)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])  # within the window: the same
    assert not np.allclose(a[:, 4:], b[:, 4:])
    hf = dict(model_type="mistral", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=176, vocab_size=256, sliding_window=16,
              max_position_embeddings=128)
    cfg = config_from_hf(hf)
    assert cfg.sliding_window == 16 and cfg.max_seq_len == 128
    assert config_to_hf(cfg)["sliding_window"] == 16


# ------------------------------------------------------------------ chunked loss


def test_chunked_loss_equals_full():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 24, 16), np.float32)
    w = rng.standard_normal((16, 50), np.float32)
    t = rng.integers(0, 50, (2, 24)).astype(np.int32)
    mask = rng.random((2, 24)) < 0.7

    def both(x, w):
        full = jax.value_and_grad(lambda x, w: cross_entropy(x @ w, t, mask), (0, 1))(x, w)
        chunked = [jax.value_and_grad(lambda x, w, c=c, g=g: loss_mod.chunked_cross_entropy(
            lambda h: h @ w, x, t, mask, chunk_len=c, gather=g), (0, 1))(x, w)
            for c in (5, 8) for g in (True, False)]
        return full, chunked

    full, chunked = jax.jit(both)(x, w)
    for loss, grads in chunked:
        np.testing.assert_allclose(loss, full[0], rtol=1e-6)
        for g, f in zip(grads, full[1], strict=True):
            np.testing.assert_allclose(g, f, rtol=0, atol=1e-6 * float(np.max(np.abs(f))))
    assert loss_mod.num_chunks(24, 5) == 6 and loss_mod.num_chunks(7, 2) == 7


def test_model_loss_is_chunked_and_exact_on_a_tp_mesh(monkeypatch):
    """Llama training_loss with 4 chunks equals cross_entropy of the full logits, on one device
    and with the vocabulary split over 'tp' (rules), loss and gradients."""
    monkeypatch.setattr(loss_mod, "MAX_CHUNK_LOGITS", 4 * 4 * 256)  # 4 chunks of 4 tokens
    cfg = _tiny(tie_embeddings=True)
    model = _model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    # Batch 2 on fsdp=4: the partitioner pads the batch split. A plain jnp.take lookup there
    # gives the table's row 0 spurious gradients (the gather's transpose scatters the padded
    # rows into row 0, 8x off); `embedding.lookup` moves the rows instead and stays exact.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)

    def full(p):
        m = nnx.merge(graphdef, p)
        return cross_entropy(m(tokens[:, :-1]), tokens[:, 1:])

    def chunked(p):
        return nnx.merge(graphdef, p).training_loss(tokens[:, :-1], tokens[:, 1:])[0]

    text = jax.jit(jax.grad(chunked)).lower(params).as_text()
    assert "while" in text  # the chunk loop
    ref = jax.jit(jax.value_and_grad(full))(params)
    got = jax.jit(jax.value_and_grad(chunked))(params)
    rules = LogicalAxisRules(PRESETS["fsdp_tp"])
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), use_logical_rules(rules):
        sharded = jax.jit(jax.value_and_grad(chunked))(params)
    for loss, grads in (got, sharded):
        np.testing.assert_allclose(loss, ref[0], rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))) + 1e-9), grads, ref[1])


# ------------------------------------------------------------------ memory, remat


@pytest.mark.parametrize("stack", [dict(), dict(scan_layers=True, remat="full")],
                         ids=["list", "scan_remat"])
def test_llama_blockwise_temporaries_grow_linearly(stack):
    """Forward + backward of a llama-small-shaped model (2 layers): from seq 512 to 4096 (x8)
    the temporaries grow at most 10x with blockwise attention and the chunked loss (linear is
    8x; the einsum's scores alone would be 64x). Scanned layers too: there JAX's partial
    evaluation would hoist every block's mask out of the layer loop (40x) without the
    kernel's optimization barrier."""
    stack = dict(stack)
    remat = stack.pop("remat", "none")
    scan = stack.pop("scan_layers", False)

    def temp(s, impl):
        cfg = models.get_config("llama-small", n_layers=2, max_seq_len=s, **stack)
        graphdef, params = nnx.split(nnx.eval_shape(
            lambda: models.create(cfg, nnx.Rngs(0))), nnx.Param)
        tokens = jax.ShapeDtypeStruct((1, s + 1), jnp.int32)
        lay = Layout(attention=impl, remat=remat, scan_layers=scan)

        def loss(p, t):
            return forward.training_loss(nnx.merge(graphdef, p), lay, t[:, :-1], t[:, 1:])[0]

        c = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
        return c.memory_analysis().temp_size_in_bytes

    assert temp(4096, "blockwise") <= 10 * temp(512, "blockwise")


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "list"])
def test_remat_by_name_matches_no_remat(scan):
    base = _tiny()
    params = nnx.state(_model(base), nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    graphdef = nnx.graphdef(_model(base))
    policies = ("full", "dots", "names:q,k,v,attn_out,mlp_hidden", "offload:q,k")

    def loss(r, p):
        return forward.training_loss(nnx.merge(graphdef, p), Layout(remat=r, scan_layers=scan),
                                     tokens[:, :-1], tokens[:, 1:])[0]

    # Every policy and no remat in one program: one compile instead of one per policy.
    out = jax.jit(lambda p: {r: jax.value_and_grad(functools.partial(loss, r))(p)
                             for r in ("none", *policies)})(params)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7)
    for policy in policies:
        assert remat_policy(policy) is not None
        np.testing.assert_allclose(out[policy][0], out["none"][0], rtol=1e-6, err_msg=policy)
        jax.tree.map(functools.partial(close, err_msg=policy), out[policy][1], out["none"][1])


def test_looped_layer_remat_holds_layer_inputs_or_a_stack_slice():
    """Full remat of looped layers: in a list (layers that differ, here sliding-window and
    global ones) each extra layer adds about its saved input to the compiled temporaries, not
    its activations. Plain ``jax.checkpoint`` in a Python loop lost this on XLA's CPU compiler
    (the recomputation was merged back into the forward: the same temporaries as no remat);
    ``checkpoint_in_order`` ties it to the backward. A loop over a stack (``scan_layers=False``)
    also holds the slices it reads and the gradient pieces it concatenates: about 1.3x a
    layer's parameters per layer, the cost docs/models.md states (the scan holds neither)."""
    seq, dim = 512, models.get_config("llama-small").dim
    mixed = dict(sliding_window=64, global_every=2)

    def temp(n_layers, remat, scan=False, **overrides):
        cfg = models.get_config("llama-small", n_layers=n_layers, max_seq_len=seq, **overrides)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0))),
                                     nnx.Param)
        tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)

        def loss(p, t):
            return forward.training_loss(nnx.merge(graphdef, p),
                                         Layout(remat=remat, scan_layers=scan),
                                         t[:, :-1], t[:, 1:])[0]

        c = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
        layer_params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
        return c.memory_analysis().temp_size_in_bytes, layer_params / n_layers

    layer_input = seq * dim * 4
    per_layer = {r: (temp(4, r, **mixed)[0] - temp(2, r, **mixed)[0]) / 2 for r in ("none", "full")}
    assert per_layer["full"] <= 4 * layer_input, per_layer      # measured 0.75x
    assert per_layer["none"] >= 10 * layer_input, per_layer     # measured ~50x: activations
    (four, layer_params), (two, _) = temp(4, "full"), temp(2, "full")
    assert (four - two) / 2 <= 1.5 * layer_params, ((four - two) / 2, layer_params)  # 1.32x


def test_checkpoint_in_order_recomputes_in_the_backward():
    """8 unrolled tanh-MLP layers: ``checkpoint_in_order`` holds one layer's activations at
    a time, with the gradients of ``jax.checkpoint`` (bit for bit). Plain ``jax.checkpoint``
    compiled here (XLA 0.10, CPU) to the temporaries of no remat: the recomputation merged
    back into the forward."""
    n, rows, dim, hidden = 8, 256, 64, 1024

    def block(p, x):
        return x + jnp.tanh(jnp.tanh(x @ p[0]) @ p[1]) @ p[2]

    def loss(wrap):
        def f(ps, x):
            for p in ps:
                x = wrap(block)(p, x)
            return (x ** 2).mean()
        return f

    nothing = jax.checkpoint_policies.nothing_saveable
    wraps = {"none": lambda f: f,
             "jax.checkpoint": lambda f: jax.checkpoint(f, policy=nothing),
             "in order": lambda f: checkpoint_in_order(f, policy=nothing)}
    keys = jax.random.split(jax.random.key(0), 3 * n + 1)
    shapes = ((dim, hidden), (hidden, hidden), (hidden, dim))
    ps = [tuple(jax.random.normal(keys[3 * i + j], s) / s[0] ** 0.5
                for j, s in enumerate(shapes)) for i in range(n)]
    x = jax.random.normal(keys[-1], (rows, dim))
    temps, grads, hlo = {}, {}, {}
    for name, wrap in wraps.items():
        fn = jax.jit(jax.grad(loss(wrap)))
        compiled = fn.lower(ps, x).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        hlo[name] = compiled.as_text()
        grads[name] = fn(ps, x)
    # Each tie reads its elements once: no computation re-reads the chain of layers below
    # (a directly read element was fused into every consumer with the residual adds of all
    # earlier layers: 22 slices in one fusion here, and compile time quadratic in depth).
    assert max(c.count(" slice(") for c in hlo["in order"].split("\n\n")) <= 3
    activations = 2 * rows * hidden * 4  # the two tanh outputs a layer keeps without remat
    # One layer's working set at a time (measured 1.5x a layer's activations; no remat and
    # plain jax.checkpoint: 5x, XLA reusing some buffers across the 8 layers).
    assert temps["in order"] <= 3 * activations < temps["none"], temps
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
                 grads["in order"], grads["jax.checkpoint"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 grads["in order"], grads["none"])


def test_remat_policy_errors():
    for bad in ("names:", "names:q,bogus", "offload:", "most"):
        with pytest.raises(ValueError, match="remat"):
            check_remat(bad)
    with pytest.raises(ValueError, match="remat"):
        Layout(remat="names:nope")
    assert remat_policy("none") is None
    # remat, attention and scan_layers are how a model runs, not what it is: the error names
    # Layout
    for runtime in (dict(remat="full"), dict(attention="xla"), dict(scan_layers=True)):
        with pytest.raises(TypeError, match=r"how the model runs.*Layout\("):
            models.get_config("llama-tiny", **runtime)
        with pytest.raises(TypeError, match=r"how the model runs.*Layout\("):
            load_config("no-such-dir", **runtime)  # before any file is read


# ------------------------------------------------------------------ packed documents


def _packed():
    """Two rows, each two documents packed end to end: tokens, per-document positions,
    segment ids, and the documents alone."""
    rng = np.random.default_rng(3)
    docs = [[rng.integers(0, 256, n).astype(np.int32) for n in lens]
            for lens in ((5, 11), (9, 7))]
    tokens = np.stack([np.concatenate(d) for d in docs])
    positions = np.stack([np.concatenate([np.arange(len(x)) for x in d]) for d in docs])
    segs = np.stack([np.concatenate([np.full(len(x), i) for i, x in enumerate(d)])
                     for d in docs]).astype(np.int32)
    return tokens, positions.astype(np.int32), segs, docs


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_packed_documents_equal_unpacked(name):
    """A packed row's logits are each document's logits computed alone (no attention across
    documents, positions restarting per document)."""
    tokens, positions, segs, docs = _packed()
    model, lay = _model(_tiny(name)), Layout(attention="blockwise")
    packed = np.asarray(jax.jit(lambda t, p, s: forward.logits(model, lay, t, p,
                                                               segment_ids=s))(
        tokens, positions, segs))
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            alone = np.asarray(jax.jit(lambda t: forward.logits(model, lay, t))(doc[None]))[0]
            np.testing.assert_allclose(packed[r, start:start + len(doc)], alone,
                                       rtol=0, atol=1e-5 * float(np.max(np.abs(alone))))
            start += len(doc)


@pytest.mark.parametrize("mesh_name", ["pp", "cp"])
def test_packed_loss_and_grads_on_pp_and_cp_meshes(mesh_name):
    """Packed llama training_loss (segment ids) on a pipeline / context-parallel mesh: loss
    and gradients as on one device."""
    from shardax.parallel import load_balance

    tokens, positions, segs, _ = _packed()
    cfg = _tiny()
    model = _model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, t, pos, s, balanced=False):
        m = nnx.merge(graphdef, p)
        return forward.training_loss(m, Layout(attention="blockwise"), t[:, :-1], t[:, 1:],
                                     pos[:, :-1],
                                     segment_ids=s[:, :-1], load_balanced=balanced)[0]

    ref = jax.jit(jax.value_and_grad(loss))(params, tokens, positions, segs)
    if mesh_name == "pp":
        mesh = jax.make_mesh((2, 4), ("pp", "fsdp"), axis_types=(AxisType.Auto,) * 2)
        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(loss))(params, tokens, positions, segs)
    else:
        mesh = jax.make_mesh((2, 4), ("cp", "fsdp"), axis_types=(AxisType.Auto,) * 2)
        # Inputs of 15 tokens (16 - 1) do not split in 4 chunks: use 8 + 1 token windows.
        t, pos, s = tokens[:, :9], positions[:, :9], segs[:, :9]
        ref = jax.jit(jax.value_and_grad(loss))(params, t, pos, s)

        def balanced(p, t, pos, s):
            lb = lambda x: load_balance(x, 2)
            m = nnx.merge(graphdef, p)
            return forward.training_loss(m, Layout(), lb(t[:, :-1]), lb(t[:, 1:]),
                                         lb(pos[:, :-1]), segment_ids=lb(s[:, :-1]),
                                         load_balanced=True)[0]

        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(balanced))(params, t, pos, s)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))) + 1e-9), got[1], ref[1])


def _partitioned_equals_one_device(objective, params):
    """Checks that ``objective``'s loss and gradients under the partitioner (fsdp=4 x tp=2,
    rules 'fsdp_tp') equal one device's; returns the partitioned program's optimized HLO."""
    ref = jax.jit(jax.value_and_grad(objective))(params)
    rules = LogicalAxisRules(PRESETS["fsdp_tp"])
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), use_logical_rules(rules):
        step = jax.jit(jax.value_and_grad(objective))
        hlo = step.lower(params).compile().as_text()
        got = step(params)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))) + 1e-9), got[1], ref[1])
    return hlo


def test_partitioned_loss_reduces_the_head_gradient_once_not_per_chunk(monkeypatch):
    """Under the partitioner (rules, no explicit FSDP) each data shard computes its chunks of
    the loss with its own copy of the head: the head is gathered, and its gradient reduced,
    once per step, not once in each of the 8 chunks (the loop moves no head-sized buffer).
    Loss and gradients equal one device's."""
    monkeypatch.setattr(loss_mod, "MAX_CHUNK_LOGITS", 4 * 2 * 256)  # 8 chunks of 2 tokens
    cfg = _tiny()
    model = _model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 17)), jnp.int32)

    def objective(p):
        m = nnx.merge(graphdef, p)
        return forward.training_loss(m, Layout(), tokens[:, :-1], tokens[:, 1:])[0]

    hlo = _partitioned_equals_one_device(objective, params)
    head_bytes = cfg.vocab_size * cfg.dim * 4 // (4 * 2)  # one device's shard
    in_loop = [op for op in hlo_collectives(hlo) if op.multiplier % 8 == 0  # chunks' loop
               and op.bytes // op.multiplier >= head_bytes]
    assert "while" in hlo and not in_loop, in_loop


def test_partitioned_blockwise_attention_skips_blocks_on_each_device(monkeypatch):
    """Under the partitioner the attention runs per data shard (`forward.per_data_shard`): the
    blockwise kernel decides which key blocks to skip on each device, with no all-reduce of
    that decision per block (packed rows: segment ids differ by row). Loss and gradients equal
    one device's."""
    cfg = _tiny()
    model = _model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 256, (4, 33)), jnp.int32)
    segments = jnp.asarray(np.sort(rng.integers(0, 3, (4, 32)), axis=1), jnp.int32)
    lay = Layout(attention="blockwise")

    def objective(p):
        m = nnx.merge(graphdef, p)
        return forward.training_loss(m, lay, tokens[:, :-1], tokens[:, 1:],
                                     segment_ids=segments)[0]

    monkeypatch.setattr(forward, "attention", functools.partial(attn.attention, block_size=8))
    hlo = _partitioned_equals_one_device(objective, params)
    decisions = [op for op in hlo_collectives(hlo) if op.dtype == "pred"]
    assert "while" in hlo and not decisions, decisions
