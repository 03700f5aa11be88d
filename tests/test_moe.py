"""The dropless mixture of experts (``shardax.models.moe``): equal to computing every expert
on every token and keeping the top-k, for any batch and mesh; trains alike on one device and
on an ep x fsdp mesh.

Tolerance: float32, 1e-5 (the same products summed in another order: grouped matmuls over
sorted rows vs dense per-expert matmuls, or sharded reductions); routing is compared exactly.
Parity with transformers' Mixtral / Qwen-MoE is in test_hf.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardax import layout, models
from shardax.logical import use_logical_rules
from shardax.models.moe import DroplessMoE, route
from shardax.parallel import grouped_kernel
from shardax.rules import LogicalAxisRules
from shardax.sharding import MeshShardingHelper

TOL = dict(rtol=1e-5, atol=1e-5)
CFG = models.LlamaConfig(dim=16, n_heads=2, n_kv_heads=1, n_layers=2, mlp_dim=24, n_experts=4,
                         top_k=2, moe_impl="dropless", vocab_size=64, max_seq_len=16)


def dense_reference(moe, x):
    """Every expert on every token, combined with the top-k weights (zero elsewhere)."""
    c = moe.config
    t = x.reshape(-1, x.shape[-1])
    w, e, _ = route(t @ moe.router[...], c.top_k, c.moe_norm_topk)
    gates = jnp.zeros((t.shape[0], c.n_experts)).at[jnp.arange(t.shape[0])[:, None], e].set(w)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", t, moe.w_gate[...])) * jnp.einsum(
        "td,edf->tef", t, moe.w_up[...])
    y = jnp.einsum("tef,efd,te->td", h, moe.w_down[...], gates)
    if c.shared_expert_dim:
        shared = (jax.nn.silu(t @ moe.shared_gate[...]) * (t @ moe.shared_up[...])
                  ) @ moe.shared_down[...]
        y = y + jax.nn.sigmoid(t @ moe.shared_router[...]) * shared
    return y.reshape(x.shape)


@pytest.mark.parametrize("overrides", [{}, dict(moe_norm_topk=False, shared_expert_dim=8)])
@pytest.mark.parametrize("backend", ["cpu", "gpu"])  # tiles; capacity buckets (grouped_kernel)
def test_dropless_equals_every_expert_on_every_token(overrides, backend, monkeypatch):
    monkeypatch.setattr(grouped_kernel, "_backend", lambda: backend)
    moe = DroplessMoE(dataclasses.replace(CFG, **overrides), nnx.Rngs(0))
    # Large router weights: confident, uneven routing (some experts get most tokens).
    moe.router[...] = 3.0 * jax.random.normal(jax.random.key(1), moe.router.shape)
    x = jax.random.normal(jax.random.key(2), (3, 8, CFG.dim))
    y, aux = moe(x)
    np.testing.assert_allclose(y, dense_reference(moe, x), **TOL)
    # One row alone gets the numbers it gets in the batch: nothing is dropped or shared.
    np.testing.assert_allclose(moe(x[1:2])[0], y[1:2], **TOL)
    probs = jax.nn.softmax(x.reshape(-1, CFG.dim) @ moe.router[...])
    _, experts = jax.lax.top_k(probs, CFG.top_k)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=CFG.n_experts)
    want = CFG.n_experts * np.sum(counts / 24 * np.asarray(probs).mean(0))
    np.testing.assert_allclose(aux.loss, want, **TOL)
    assert counts.max() > 12  # uneven: a capacity of 1.25 x 12 would have dropped tokens


def test_training_on_ep_fsdp_mesh_equals_one_device():
    """Three SGD steps of the objective (cross-entropy + aux) on ep=2,fsdp=4 (experts split
    over 'ep' by the rules) give the one-device losses and parameters."""
    cfg = dataclasses.replace(CFG, moe_aux_weight=0.1)
    tokens = jax.random.randint(jax.random.key(3), (8, 13), 0, cfg.vocab_size)

    def train(mesh=None, rules=None):
        model = models.create(cfg, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, t):
            def loss_fn(m):
                return m.training_loss(t[:, :-1], t[:, 1:])[0]
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        losses = []
        if mesh is None:
            losses = [float(step(model, opt, tokens)) for _ in range(3)]
        else:
            with jax.set_mesh(mesh.mesh), use_logical_rules(rules):
                state = nnx.state(model)
                nnx.update(model, jax.device_put(state, mesh.match_sharding_rule(rules, state)))
                assert model.layers.mlp.w_gate[...].sharding.spec[1] == "ep"  # [layers, expert]
                losses = [float(step(model, opt, tokens)) for _ in range(3)]
        return losses, {k: np.asarray(v) for k, v in
                        nnx.to_flat_state(nnx.state(model, nnx.Param))}

    want_losses, want = train()
    mesh = MeshShardingHelper.from_string("ep=2,fsdp=4")
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp"], dict(mesh.mesh.shape), heads=cfg.n_heads, kv_heads=cfg.n_kv_heads))
    losses, got = train(mesh, rules)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert want_losses[-1] < want_losses[0]
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, **TOL, err_msg=str(k))
