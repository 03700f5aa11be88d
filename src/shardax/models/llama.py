"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in Flax NNX, with
the flags (``LlamaConfig``) that make it Mistral, Qwen2/3 or Gemma 2/3 (text).

Every parameter carries logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads',
'head_dim', 'layers', 'norm', 'expert'); key activations go through ``constrain`` with
('batch', 'length', ...) names, so sharding rules alone decide how the model is split.

The config also turns on explicit parallelism (``shardax.parallel``), read from the mesh at
trace time, with the same parameters in every mode (checkpoints move freely between them):

* ``tp_mode='sync'|'async'|'async_bidi'``: attention QKV/out and the MLP run as Megatron
  column/row-parallel matmuls over 'tp' (async: collective matmul); ``sequence_parallel``
  (implied by the async modes) keeps the residual stream split over the sequence on 'tp'.
* a 'pp' axis: the stacked layers (``scan_layers=True``) run as a pipeline
  (``pp_schedule``, ``pp_microbatches``, ``pp_virtual_stages``).
* a 'cp' axis: attention is ``ring_attention`` (load-balanced when the caller passes tokens and
  positions in ``load_balance`` order, as ``shardax.train.step`` does).
* ``n_experts > 0``: the MLP is a mixture of experts (``llama_moe.MoE``, or the dropless
  ``moe.DroplessMoE`` with ``moe_impl='dropless'``), split over 'ep'.

Without a mesh every path computes the plain single-device math.

Example::

    cfg = CONFIGS['llama-tiny']
    model = Llama(cfg, nnx.Rngs(0))
    logits = model(jnp.zeros((2, 16), jnp.int32))   # [2, 16, 256]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models import embedding
from shardax.models._annotate import constrain
from shardax.models._layers import make_layers, param, remat_policy, run_layers
from shardax.models.attention import attention
from shardax.models.axes import TOKEN_AXES
from shardax.models.configs import LLAMA_CONFIGS, PP_SCHEDULES, TP_MODES, LlamaConfig
from shardax.models.llama_moe import MoE
from shardax.models.loss import chunked_cross_entropy
from shardax.models.moe import DroplessMoE
from shardax.models.ops import apply_rope, gqa_attention, rms_norm, rope_tables
from shardax.models.remat import checkpoint_name
from shardax.parallel import (
    axis_size,
    column_parallel,
    pipeline,
    row_parallel,
    to_stage_layout,
)

__all__ = ["CONFIGS", "PP_SCHEDULES", "TP_MODES", "Llama", "LlamaConfig", "apply_rope",
           "attention", "check_mesh", "gqa_attention", "param_count", "rms_norm", "rope_tables"]

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros
CONFIGS = LLAMA_CONFIGS


def check_mesh(
    config: LlamaConfig, mesh_shape: Mapping[str, int], *, batch_size: int, seq_len: int
) -> None:
    """Raises ``ValueError`` (naming the axis and sizes) if ``config`` cannot run on a mesh of
    ``mesh_shape`` with ``[batch_size, seq_len]`` batches; a shape check, nothing is built.

    Example::

        check_mesh(get_config('llama-tiny', tp_mode='async'), {'fsdp': 8}, batch_size=16,
                   seq_len=128)   # ValueError: tp_mode='async' needs a 'tp' mesh axis ...
    """
    c, mesh = config, dict(mesh_shape)
    tp, pp, cp, ep = (mesh.get(a, 1) for a in ("tp", "pp", "cp", "ep"))

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{message} (mesh {mesh})")

    if c.tp_mode != "none":
        need(tp > 1, f"tp_mode={c.tp_mode!r} needs a 'tp' mesh axis of size > 1")
        for what, n in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads)):
            need(n % tp == 0 or tp % n == 0,
                 f"{what}={n} and 'tp' size {tp}: one must divide the other (whole heads per "
                 "device, or each head replicated on tp/heads devices)")
        need(c.mlp_dim % tp == 0, f"mlp_dim={c.mlp_dim} is not divisible by 'tp' size {tp}")
        if c.sp:
            need(seq_len % tp == 0, f"sequence parallelism splits --seq-len {seq_len} over "
                 f"'tp' size {tp}, which does not divide it")
            need(cp == 1, "sequence parallelism together with a 'cp' axis is not supported; "
                 "use one of them")
    if pp > 1:
        v = c.pp_virtual_stages
        need(c.scan_layers, "a 'pp' axis needs scan_layers=True (stacked layers)")
        need(c.n_layers % (pp * v) == 0, f"n_layers={c.n_layers} is not divisible by 'pp' size "
             f"{pp} x virtual stages {v}")
        need(v == 1 or c.pp_microbatches >= pp, f"the circular schedule with {v} virtual stages "
             f"needs microbatches >= 'pp' size {pp}, got {c.pp_microbatches}")
        need(batch_size % c.pp_microbatches == 0, f"batch size {batch_size} is not divisible "
             f"by {c.pp_microbatches} microbatches")
    if cp > 1:
        need(seq_len % (2 * cp) == 0, f"--seq-len {seq_len} must divide into 2 x 'cp' size "
             f"{cp} = {2 * cp} load-balanced chunks")
    if ep > 1:
        need(c.n_experts > 0, f"an 'ep' axis of size {ep} needs a mixture-of-experts model "
             "(n_experts > 0, e.g. llama-moe-tiny)")
        need(c.n_experts % ep == 0, f"n_experts={c.n_experts} is not divisible by 'ep' size {ep}")


def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, computed from the config alone.

    Example::

        param_count(CONFIGS['llama-1b'])   # 1_100_048_384
    """
    c = config
    attn = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    if c.qkv_bias:
        attn += c.head_dim * (c.n_heads + 2 * c.n_kv_heads)
    if c.qk_norm:
        attn += 2 * c.head_dim
    mlp = 3 * c.dim * c.mlp_dim
    if c.n_experts:
        mlp = c.n_experts * mlp + c.dim * c.n_experts
        if c.shared_expert_dim:
            mlp += 3 * c.dim * c.shared_expert_dim + c.dim
    layer = attn + mlp + (4 if c.post_norms else 2) * c.dim
    head = 0 if c.tie_embeddings else c.dim * c.vocab_size
    return c.vocab_size * c.dim + c.n_layers * layer + c.dim + head


class RMSNorm(nnx.Module):
    """RMSNorm scaling by ``w + offset`` (``offset=1``: Gemma's zero-centred ``w``, initialised
    to 0), so that a new norm is the identity scale either way."""

    def __init__(self, dim: int, eps: float, param_dtype: Any, rngs: nnx.Rngs,
                 offset: float = 0.0):
        self.eps, self.offset = eps, offset
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = param(rngs.params(), init, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


def _norm(c: LlamaConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, c.norm_eps, c.param_dtype, rngs, c.norm_offset)


def _activation(c: LlamaConfig) -> Callable[[jax.Array], jax.Array]:
    """The gate activation: SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU)."""
    if c.mlp_activation == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def _head_repeat(heads: int, tp: int) -> int:
    """Copies of each head so that 'tp' devices hold whole heads (1 when tp divides heads)."""
    if heads % tp == 0:
        return 1
    if tp % heads == 0:
        return tp // heads
    raise ValueError(f"{heads} heads cannot be split over 'tp' of size {tp}: one of them must "
                     "divide the other")


def _tp_kwargs(c: LlamaConfig) -> dict[str, Any]:
    """Keyword arguments of the column/row-parallel blocks for an explicit ``tp_mode``."""
    sync_sp = c.tp_mode == "sync" and c.sp
    # Only sync SP needs the batch axes manual (see shardax.parallel.tensor).
    return dict(mode=c.tp_mode, sequence_parallel=c.sp,
                batch_axes=TOKEN_AXES if sync_sp else ())


class Attention(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        hd, pd = c.head_dim, c.param_dtype
        self.config = c
        self.dtype = c.dtype
        self.wq = param(rngs.params(), _normal(std), (c.dim, c.n_heads, hd),
                        ("embed", "heads", "head_dim"), pd)
        self.wk = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs.params(), _normal(std), (c.dim, c.n_kv_heads, hd),
                        ("embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs.params(), _normal(out_std), (c.n_heads, hd, c.dim),
                        ("heads", "head_dim", "embed"), pd)
        if c.qkv_bias:
            self.bq = param(rngs.params(), _zeros, (c.n_heads, hd), ("heads", "head_dim"), pd)
            self.bk = param(rngs.params(), _zeros, (c.n_kv_heads, hd), ("kv_heads", "head_dim"),
                            pd)
            self.bv = param(rngs.params(), _zeros, (c.n_kv_heads, hd), ("kv_heads", "head_dim"),
                            pd)
        if c.qk_norm:
            self.q_norm = _norm(c, hd, rngs)
            self.k_norm = _norm(c, hd, rngs)
        # Per-layer attention kind; `Llama` sets it per layer when the layers differ.
        self.window: int | None = c.sliding_window
        self.local_rope = False

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 load_balanced: bool = False, segment_ids: jax.Array | None = None
                 ) -> jax.Array:
        if self.config.tp_mode != "none":
            return self._tensor_parallel(x, cos, sin, load_balanced, segment_ids)
        q, k, v = self.qkv(x)
        q, k = self.rope(q, k, cos, sin)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        out = self.attend(q, k, v, load_balanced, segment_ids=segment_ids)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return checkpoint_name(self.out(out), "attn_proj")

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, load_balanced: bool = False,
               **masks: Any) -> jax.Array:
        """Attention of roped q, k and v under the config (implementation, sliding window);
        ``masks``: more keyword arguments of ``shardax.models.attention.attention``."""
        c = self.config
        q, k, v = (checkpoint_name(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        out = attention(q, k, v, window=self.window, softcap=c.attn_softcap,
                        scale=c.attn_scale, implementation=c.attention,
                        load_balanced=load_balanced, **masks)
        return checkpoint_name(out, "attn_out")

    def rope(self, q: jax.Array, k: jax.Array, cos: Any, sin: Any
             ) -> tuple[jax.Array, jax.Array]:
        """q and k rotated by this layer's tables: ``cos``/``sin`` are one table, or a
        ``(global, local)`` pair when sliding layers have their own base (Gemma 3)."""
        if isinstance(cos, tuple):
            i = 1 if self.local_rope else 0
            cos, sin = cos[i], sin[i]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        if not self.config.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def out(self, attended: jax.Array) -> jax.Array:
        """The output projection of attention results [b, s, heads, d] -> [b, s, dim]."""
        return jnp.einsum("bshd,hde->bse", attended, self.wo[...].astype(self.dtype))

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, heads, d], k and v [b, s, kv_heads, d], before RoPE (q and k normed per
        head with ``qk_norm``)."""
        dt = self.dtype
        out = []
        for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")):
            y = jnp.einsum("bse,ehd->bshd", x, getattr(self, w)[...].astype(dt))
            if self.config.qkv_bias:
                y = y + getattr(self, bias)[...].astype(dt)
            out.append(y)
        q, k = self._qk_norm(out[0], out[1])
        return q, k, out[2]

    def _tensor_parallel(self, x, cos, sin, load_balanced, segment_ids):
        """Megatron attention: one fused column-parallel QKV matmul (each 'tp' slice holds the
        q, k and v of its heads), local attention, one row-parallel output matmul. Heads fewer
        than 'tp' are repeated so that every device holds whole heads; the output weight is
        repeated and divided by the copies, so the sum over devices counts each head once."""
        c, dt = self.config, self.dtype
        tp = axis_size("tp")
        rq, rk = _head_repeat(c.n_heads, tp), _head_repeat(c.n_kv_heads, tp)
        d, hd = c.dim, c.head_dim
        wq, wk, wv = (jnp.repeat(w[...].astype(dt), r, axis=1)
                      for w, r in ((self.wq, rq), (self.wk, rk), (self.wv, rk)))
        heads, kv_heads = c.n_heads * rq, c.n_kv_heads * rk
        w_qkv = jnp.concatenate([w.reshape(d, tp, -1) for w in (wq, wk, wv)], axis=-1)
        kw = _tp_kwargs(c)
        qkv = column_parallel(x, w_qkv.reshape(d, -1), **kw)
        b, s = qkv.shape[:2]
        qkv = qkv.reshape(b, s, tp, -1)
        nq, nk = heads // tp * hd, kv_heads // tp * hd
        q = qkv[..., :nq].reshape(b, s, heads, hd)
        k = qkv[..., nq:nq + nk].reshape(b, s, kv_heads, hd)
        v = qkv[..., nq + nk:].reshape(b, s, kv_heads, hd)
        if c.qkv_bias:
            q = q + jnp.repeat(self.bq[...].astype(dt), rq, axis=0)
            k = k + jnp.repeat(self.bk[...].astype(dt), rk, axis=0)
            v = v + jnp.repeat(self.bv[...].astype(dt), rk, axis=0)
        q, k = self.rope(*self._qk_norm(q, k), cos, sin)
        out = self.attend(q, k, v, load_balanced, segment_ids=segment_ids)
        wo = jnp.repeat(self.wo[...].astype(dt), rq, axis=0)
        if rq > 1:
            wo = wo / rq
        return row_parallel(out.reshape(b, s, heads * hd), wo.reshape(heads * hd, d), **kw)


class SwiGLU(nnx.Module):
    """The gated MLP ``down(act(gate(x)) * up(x))``: SwiGLU, or GeGLU with
    ``mlp_activation='gelu_tanh'``."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
        pd = c.param_dtype
        self.dtype = c.dtype
        self.w_gate = param(rngs.params(), _normal(std), (c.dim, c.mlp_dim), ("embed", "mlp"), pd)
        self.w_up = param(rngs.params(), _normal(std), (c.dim, c.mlp_dim), ("embed", "mlp"), pd)
        self.w_down = param(rngs.params(), _normal(out_std), (c.mlp_dim, c.dim),
                            ("mlp", "embed"), pd)

        self.config = c

    def __call__(self, x: jax.Array) -> jax.Array:
        dt, c = self.dtype, self.config
        if c.tp_mode != "none":
            # Gate and up columns interleaved so that each 'tp' slice holds both halves of its
            # hidden units: one column-parallel matmul (one all-gather ring under SP/async).
            w = jnp.stack([self.w_gate[...].astype(dt), self.w_up[...].astype(dt)], axis=-1)
            kw = _tp_kwargs(c)
            h = column_parallel(x, w.reshape(c.dim, 2 * c.mlp_dim), **kw)
            h = h.reshape(*h.shape[:-1], c.mlp_dim, 2)
            h = checkpoint_name(_activation(c)(h[..., 0]) * h[..., 1], "mlp_hidden")
            return checkpoint_name(row_parallel(h, self.w_down[...].astype(dt), **kw), "mlp_out")
        gate = checkpoint_name(x @ self.w_gate[...].astype(dt), "mlp_gate")
        up = checkpoint_name(x @ self.w_up[...].astype(dt), "mlp_up")
        h = constrain(checkpoint_name(_activation(c)(gate) * up, "mlp_hidden"),
                      ("batch", "length", "mlp"))
        return checkpoint_name(h @ self.w_down[...].astype(dt), "mlp_out")


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with
    ``post_norms`` (Gemma 2/3) the attention and MLP outputs are normed again before each add.

    Returns ``(x, aux)``: ``aux`` is the MoE load-balancing loss (0 for a dense MLP).
    """

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        self.config = c
        self.attn_norm = _norm(c, c.dim, rngs)
        self.attn = Attention(c, rngs)
        self.mlp_norm = _norm(c, c.dim, rngs)
        if not c.n_experts:
            self.mlp = SwiGLU(c, rngs)
        else:
            self.mlp = DroplessMoE(c, rngs) if c.moe_impl == "dropless" else MoE(c, rngs)
        if c.post_norms:
            self.attn_post_norm = _norm(c, c.dim, rngs)
            self.mlp_post_norm = _norm(c, c.dim, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 load_balanced: bool = False, segment_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        x = self.attn_residual(
            x, self.attn(self.attn_norm(x), cos, sin, load_balanced, segment_ids))
        return self.mlp_residual(x)

    def attn_residual(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """The residual stream after adding the attention output ``y``."""
        if self.config.post_norms:
            y = self.attn_post_norm(y)
        return constrain(x + y, ("batch", "length", "embed"))

    def mlp_residual(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(x + mlp(norm(x)), aux)``: the MLP half of the layer."""
        y = self.mlp(self.mlp_norm(x))
        y, aux = y if isinstance(y, tuple) else (y, jnp.zeros((), jnp.float32))
        if self.config.post_norms:
            y = self.mlp_post_norm(y)
        return constrain(x + y, ("batch", "length", "embed")), aux


class Llama(nnx.Module):
    """Causal language model: ``model(tokens [b, s]) -> logits [b, s, vocab]`` (float32).

    Example::

        model = Llama(CONFIGS['llama-tiny'], nnx.Rngs(0))
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = param(rngs.params(), _normal(0.02), (c.vocab_size, c.dim),
                           ("vocab", "embed"), c.param_dtype)
        self.layers = make_layers(lambda r: Block(c, r), c.n_layers, rngs, c.scan_layers)
        if c.mixed_layers:  # list layout (the config refuses scan_layers)
            for i, layer in enumerate(self.layers):
                layer.attn.window = c.window_of(i)
                layer.attn.local_rope = c.rope_local_theta is not None and not c.is_global(i)
        self.final_norm = _norm(c, c.dim, rngs)
        if not c.tie_embeddings:
            self.lm_head = param(rngs.params(), _normal(0.02), (c.dim, c.vocab_size),
                                 ("embed", "vocab"), c.param_dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, load_balanced: bool = False,
                 return_aux: bool = False):
        """Logits ``[b, s, vocab]`` (float32); with ``return_aux``, ``(logits, aux)`` where
        ``aux`` is the MoE load-balancing loss averaged over layers (0 for a dense model).

        ``segment_ids`` [b, s] (ints >= 0): packed documents; a token attends only within
        its segment. ``load_balanced``: ``tokens``, ``positions`` and ``segment_ids`` are in
        ``load_balance(., cp)`` order (then the logits are too); only meaningful on a mesh
        with a 'cp' axis.
        """
        x, cos, sin = self._embed(tokens, positions)
        if axis_size("pp") > 1:
            x, aux = self._pipeline(x, cos, sin, load_balanced, segment_ids=segment_ids)
        else:
            x, aux = self._layers(x, cos, sin, load_balanced, segment_ids=segment_ids)
        logits = self._head(x, *self._head_params())
        return (logits, aux) if return_aux else logits

    def loss(self, tokens: jax.Array, targets: jax.Array, positions: jax.Array | None = None,
             *, segment_ids: jax.Array | None = None, load_balanced: bool = False,
             cast: Callable[[jax.Array], jax.Array] = lambda logits: logits,
             stack: Callable | None = None, loss_weights: jax.Array | None = None,
             lookup: Callable | None = None, layer_gather: Callable | None = None
             ) -> tuple[jax.Array, jax.Array]:
        """``(cross-entropy, aux)``: the mean token cross-entropy of ``targets`` under
        ``cast(logits)``, and the MoE load-balancing loss (0 for a dense model).
        ``loss_weights`` [b, s]: each token's cross-entropy is multiplied by its weight before
        the mean (``shardax.models.loss.chunked_cross_entropy``; packed documents weigh out
        the targets that start the next document: ``shardax.train.packing``).

        On a 'pp' mesh the final norm, head and cross-entropy run on the pipeline's output
        stage only (``pipeline(loss_fn=...)``): the outputs never leave it and just the two
        scalars are reduced over 'pp'. Elsewhere it equals ``cross_entropy(cast(model(tokens)),
        targets)``.

        ``stack(layer_fn, x)``, when given, runs the layers instead of the scan or loop:
        ``layer_fn(layer_state, h)`` is one layer, ``layer_state`` one slice of
        ``nnx.state(self.layers)`` (stacked) or one item of it (list). Explicit FSDP passes
        its gathering loop here. ``lookup(table, tokens)``, when given, looks up the token
        embeddings instead of `shardax.models.embedding.lookup` (explicit FSDP passes its
        table shard and `embedding.lookup_manual`). ``layer_gather(layer_state)``, when given on a
        'pp' mesh, turns one layer's parameters, as the pipeline stage slices them, into the
        state the layer merges (explicit FSDP gathers them there); the pipeline then returns
        its outputs and the head and cross-entropy run after it (a loss region over 'pp'
        nested in explicit FSDP's does not lower under differentiation in JAX 0.10:
        https://github.com/jax-ml/jax/pull/26588).

        Example::

            ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
        """
        c = self.config
        x, cos, sin = self._embed(tokens, positions, lookup)
        if stack is not None and axis_size("pp") > 1:
            raise ValueError("a custom layer stack (explicit FSDP) cannot run as a 'pp' "
                             "pipeline; pass layer_gather")
        if layer_gather is not None and axis_size("pp") > 1:
            x, aux = self._pipeline(x, cos, sin, load_balanced, segment_ids=segment_ids,
                                    layer_gather=layer_gather)
            return self._cross_entropy(x, targets, *self._head_params(), cast=cast,
                                       weights=loss_weights), aux
        if axis_size("pp") <= 1:
            x, aux = self._layers(x, cos, sin, load_balanced, stack, segment_ids)
            return self._cross_entropy(x, targets, *self._head_params(), cast=cast,
                                       weights=loss_weights), aux
        labels = _labels(targets, loss_weights)

        def ce(out, labels, *head):
            targets, weights = _unlabel(labels)
            return self._cross_entropy(out[0], targets, *head, cast=cast, gather=False,
                                       weights=weights)

        if c.pp_schedule == "1f1b":  # it differentiates one scalar per microbatch
            if c.n_experts:
                raise ValueError(
                    "under the 1f1b pipeline schedule the gradient is taken inside the pipeline, "
                    "of one scalar: use training_loss (cross-entropy + moe_aux_weight x aux) for "
                    "a mixture-of-experts model"
                )
            loss = self._pipeline(x, cos, sin, load_balanced, segment_ids=segment_ids, loss_fn=ce,
                                  loss_batch_args=(labels,), loss_args=self._head_params())
            return loss, jnp.zeros((), jnp.float32)

        def stage_loss(out, labels, *head):
            aux = self._aux_loss(out) if c.n_experts else jnp.float32(0)
            return jnp.stack([ce(out, labels, *head), aux])

        both = self._pipeline(x, cos, sin, load_balanced, segment_ids=segment_ids,
                              loss_fn=stage_loss,
                              loss_batch_args=(labels,), loss_args=self._head_params())
        return both[0], both[1]

    def training_loss(self, tokens: jax.Array, targets: jax.Array,
                      positions: jax.Array | None = None, *,
                      segment_ids: jax.Array | None = None, load_balanced: bool = False,
                      cast: Callable[[jax.Array], jax.Array] = lambda logits: logits,
                      stack: Callable | None = None, loss_weights: jax.Array | None = None,
                      lookup: Callable | None = None, layer_gather: Callable | None = None
                      ) -> tuple[jax.Array, jax.Array]:
        """``(objective, cross-entropy)``: what training differentiates, the cross-entropy plus
        ``moe_aux_weight`` times the MoE load-balancing loss (the cross-entropy alone for a
        dense model), and the cross-entropy, to report. Arguments as for :meth:`loss`.

        Under the '1f1b' pipeline schedule an MoE model needs this form: the pipeline takes
        the gradient of one scalar per microbatch (the objective) and reports the
        cross-entropy beside it, without gradient.

        Example::

            objective, ce = model.training_loss(tokens[:, :-1], tokens[:, 1:])
        """
        c = self.config
        if not (c.n_experts and axis_size("pp") > 1 and c.pp_schedule == "1f1b"
                and layer_gather is None):
            ce, aux = self.loss(tokens, targets, positions, segment_ids=segment_ids,
                                load_balanced=load_balanced, cast=cast, stack=stack,
                                loss_weights=loss_weights, lookup=lookup,
                                layer_gather=layer_gather)
            return (ce + c.moe_aux_weight * aux if c.n_experts else ce), ce

        def objective(out, labels, *head):
            targets, weights = _unlabel(labels)
            ce = self._cross_entropy(out[0], targets, *head, cast=cast, gather=False,
                                     weights=weights)
            return ce + c.moe_aux_weight * self._aux_loss(out), ce

        x, cos, sin = self._embed(tokens, positions, lookup)
        return self._pipeline(x, cos, sin, load_balanced, segment_ids=segment_ids,
                              loss_fn=objective,
                              loss_batch_args=(_labels(targets, loss_weights),),
                              loss_args=self._head_params(),
                              loss_has_aux=True)

    def _cross_entropy(self, x, targets, *head, cast, gather=True, weights=None):
        """Mean token cross-entropy from the final hidden states (times ``weights``), in
        sequence chunks (never the whole [b, s, vocab] logits; see ``shardax.models.loss``)."""
        return chunked_cross_entropy(lambda h: cast(self._head(h, *head)), x, targets,
                                     weights=weights, gather=gather)

    def _aux_loss(self, out):
        """The load-balancing loss from the pipeline's outputs (summed over layers per row)."""
        return jnp.mean(out[3]) / self.config.n_layers

    def _embed(self, tokens, positions, lookup=None):
        """Token embeddings ``[b, s, dim]`` in the compute dtype, and the RoPE tables."""
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(f"length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = (lookup or embedding.lookup)(self.embed[...], tokens).astype(c.dtype)
        if c.embed_scale:  # Gemma: the scale rounded to the compute dtype, as transformers
            x = x * jnp.asarray(c.dim ** 0.5, c.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)
        if c.rope_local_theta is not None:  # (global, local) tables: see Attention.rope
            lcos, lsin = rope_tables(positions, c.head_dim, c.rope_local_theta)
            cos, sin = (cos, lcos), (sin, lsin)
        return x, cos, sin

    def _layers(self, x, cos, sin, load_balanced, stack=None, segment_ids=None):
        """The decoder stack without a pipeline (through ``stack`` when given); returns
        ``(x, aux)``."""
        c = self.config
        if stack is not None:
            if c.mixed_layers:
                raise ValueError("a custom layer stack (explicit FSDP) needs identical layers "
                                 "(no global_every)")
            graphdef = nnx.graphdef(self.layers if c.scan_layers else self.layers[0])

            def layer_fn(state, h):
                return nnx.merge(graphdef, state)(h, cos, sin, load_balanced, segment_ids)[0]

            if not c.n_experts:
                return stack(layer_fn, x), jnp.zeros((), jnp.float32)

            def moe_layer_fn(state, h):  # h: (x, the load-balancing losses so far)
                y, a = nnx.merge(graphdef, state)(h[0], cos, sin, load_balanced, segment_ids)
                return y, h[1] + a

            x, aux = stack(moe_layer_fn, (x, jnp.zeros((), jnp.float32)))
            return x, aux / c.n_layers
        if c.n_experts:
            def call(layer, h):
                y, a = layer(h[0], cos, sin, load_balanced, segment_ids)
                return y, h[1] + a

            x, aux = run_layers(self.layers, (x, jnp.zeros((), jnp.float32)), call,
                                c.scan_layers, c.remat)
            return x, aux / c.n_layers
        x = run_layers(self.layers, x,
                       lambda layer, h: layer(h, cos, sin, load_balanced, segment_ids)[0],
                       c.scan_layers, c.remat)
        return x, jnp.zeros((), jnp.float32)

    def _head_params(self):
        w = self.embed if self.config.tie_embeddings else self.lm_head
        return self.final_norm.scale[...], w[...]

    def _head(self, x, norm_scale, w):
        """Final norm and vocabulary projection: logits ``[b, s, vocab]`` in float32."""
        c = self.config
        x = rms_norm(x, norm_scale, c.norm_eps, c.norm_offset)
        spec = "bse,ve->bsv" if c.tie_embeddings else "bse,ev->bsv"
        # Computed in the compute dtype, then widened: with preferred_element_type=float32 the
        # backward would gather and reduce the (tied) table in float32 under bf16 params.
        logits = jnp.einsum(spec, x, w.astype(c.dtype)).astype(jnp.float32)
        if c.final_softcap is not None:
            logits = c.final_softcap * jnp.tanh(logits / c.final_softcap)
        return constrain(logits, ("batch", "length", "vocab"))

    def _pipeline(self, x, cos, sin, load_balanced, loss_fn=None, loss_batch_args=(),
                  loss_args=(), loss_has_aux=False, segment_ids=None, layer_gather=None):
        """The layer stack as a pipeline over 'pp'. Returns ``(x, aux)`` (outputs on every
        stage), or with ``loss_fn`` what ``pipeline(loss_fn=...)`` returns, computed on the
        output stage alone. Without ``loss_fn`` (logits only) '1f1b' runs as 'gpipe', the same
        forward pass. The parameters stay in the sequential layer order
        (portable checkpoints); ``to_stage_layout`` reorders them per step, which is free for
        gpipe and ``V = 1`` and moves part of the stack between stages for circular ``V > 1``.

        An MoE model carries its load-balancing loss through the pipeline as one value per
        row (every row of a microbatch holds that microbatch's loss), so ``aux`` is the mean
        over microbatches: equal to the unpipelined loss when ``pp_microbatches == 1``.
        ``layer_gather``: applied to each layer's parameters inside the stage (see `loss`)."""
        c = self.config
        if not c.scan_layers:
            raise ValueError("a 'pp' mesh axis needs scan_layers=True (stacked layers)")
        v = c.pp_virtual_stages if c.pp_schedule == "circular" else 1
        graphdef, state = nnx.split(self.layers)
        state = to_stage_layout(state, axis_size("pp"), v)

        # The segment ids travel with each microbatch, last in the carried tuple.
        segs = segment_ids is not None

        def layer_fn(params, h):
            if layer_gather is not None:
                params = layer_gather(params)
            y, aux = nnx.merge(graphdef, params)(h[0], h[1], h[2], load_balanced,
                                                 h[-1].astype(jnp.int32) if segs else None)
            rest = h[3:]
            if c.n_experts:
                rest = (rest[0] + aux, *rest[1:])
            return (y, h[1], h[2], *rest)

        schedule = c.pp_schedule if loss_fn is not None else ("circular" if v > 1 else "gpipe")
        h = (x, cos, sin)
        if c.n_experts:
            h += (jnp.zeros(x.shape[:1], jnp.float32),)
        if segs:
            # 1f1b carries floating-point activations only (ids < 2**24 are exact in float32).
            h += (segment_ids.astype(jnp.float32) if schedule == "1f1b" else segment_ids,)
        # Every schedule stores each layer's input and recomputes the layer in the backward
        # pass (what remat='full' asks for). A policy that saves more (save_dots, offload)
        # applies on top; under 1f1b it can only save within one layer's recomputation.
        policy = remat_policy(c.remat)
        if schedule == "1f1b" and c.remat in ("none", "full"):
            policy = None
        out = pipeline(layer_fn, state, h, num_microbatches=c.pp_microbatches,
                       schedule=schedule, virtual_stages=v, remat=True,
                       remat_policy=policy, loss_fn=loss_fn,
                       loss_batch_args=loss_batch_args, loss_args=loss_args,
                       loss_has_aux=loss_has_aux)
        if loss_fn is not None:
            return out
        aux = self._aux_loss(out) if c.n_experts else jnp.zeros((), jnp.float32)
        return out[0], aux


def _labels(targets: jax.Array, weights: jax.Array | None) -> Any:
    """What a pipeline stage's loss takes per row: the targets, with the loss weights if
    any."""
    return targets if weights is None else (targets, weights)


def _unlabel(labels: Any) -> tuple:
    """``(targets, weights)`` of `_labels`' result (weights None without them)."""
    return labels if isinstance(labels, tuple) else (labels, None)
