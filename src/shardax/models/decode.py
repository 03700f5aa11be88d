"""Autoregressive generation for the Llama and GPT-2 models, with a KV cache.

The prompt batch is left-padded to a common length and run once (prefill), writing every
layer's keys and values into a cache ``[layers, batch, length, kv_heads, head_dim]``; each
further step runs one token per row against the cache. The cache carries the activations'
logical names (``('batch', 'length', 'kv_heads', 'head_dim')``), so under sharding rules it is
split like the attention activations (the batch and the kv heads as the rules split them). Rows of
different prompt lengths are masked per row (keys before a row's first token are ignored)
and take their own RoPE / learned positions, so every row decodes as if it were alone.

``use_cache=False`` recomputes the whole window for every token with the same masks: the
reference the cached path must equal, and the benchmark's baseline.

Example::

    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)   # greedy
    out.tokens       # [[32 new ids], [32 new ids]]
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardax.logical import use_logical_rules
from shardax.models._annotate import constrain
from shardax.models._layers import layer_list
from shardax.models.attention import attention as attend
from shardax.models.gpt2 import GPT2
from shardax.models.llama import Llama

__all__ = ["Generated", "KVCache", "filter_logits", "forward", "generate", "init_cache"]

_CACHE_NAMES = ("layers", "batch", None, "kv_heads", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer: ``[layers, batch, length, kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


def init_cache(model: Llama | GPT2, batch: int, length: int) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``length`` tokens, in the compute dtype.

    Example::

        cache = init_cache(model, batch=4, length=128)
    """
    c = model.config
    kv = getattr(c, "n_kv_heads", c.n_heads)
    shape = (c.n_layers, batch, length, kv, c.head_dim)
    z = constrain(jnp.zeros(shape, c.dtype), _CACHE_NAMES)
    return KVCache(z, z)


def forward(model: Llama | GPT2, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            index: jax.Array, start: jax.Array, attention: str = "auto"
            ) -> tuple[jax.Array, KVCache]:
    """Logits ``[b, s, vocab]`` for ``tokens`` [b, s] written at cache slots ``index ..
    index + s - 1``, attending to cache slots ``start[row] ..`` up to their own slot;
    ``positions`` [b, s] are the tokens' positions in their sequence; ``attention`` the
    implementation (``shardax.models.attention``). Returns the updated cache.

    Example::

        logits, cache = forward(model, prompt, positions, init_cache(model, b, n), 0, pad)
    """
    if not isinstance(model, Llama | GPT2):
        raise ValueError(f"KV-cache decoding supports Llama and GPT2, got {type(model).__name__}")
    c = model.config
    if isinstance(model, Llama) and c.n_experts and c.moe_impl != "dropless":
        raise ValueError("KV-cache decoding of a capacity-based mixture-of-experts Llama is "
                         "not supported (its routing depends on the batch); use "
                         "moe_impl='dropless'")
    b, s = tokens.shape
    length = cache.k.shape[2]
    # Masks by cache slot: causal over slots, keys before a row's first token are padding.
    slots = index + jnp.arange(s)
    keys = jnp.arange(length)
    masks = dict(q_positions=slots, kv_positions=keys, kv_mask=keys[None, :] >= start[:, None])
    llama = isinstance(model, Llama)
    fn = partial(attend, implementation=attention)
    x, extras = model.embed_inputs(tokens, positions)
    ks, vs = [], []
    for i, layer in enumerate(layer_list(model.layers)):
        h = layer.attn_norm(x) if llama else layer.ln_1(x)
        q, k, v = layer.attn.qkv(h)
        if llama:
            q, k = layer.attn.rope(q, k, extras["cos"], extras["sin"])
        kc = jax.lax.dynamic_update_slice(cache.k[i], k.astype(cache.k.dtype), (0, index, 0, 0))
        vc = jax.lax.dynamic_update_slice(cache.v[i], v.astype(cache.v.dtype), (0, index, 0, 0))
        ks.append(kc)
        vs.append(vc)
        out = constrain(layer.attn.attend(q, kc, vc, fn, **masks),
                        ("batch", "length", "heads", "head_dim"))
        if llama:
            x = layer.mlp_residual(layer.attn_residual(x, layer.attn.out(out)))[0]
        else:
            x = constrain(x + layer.attn.out(out), ("batch", "length", "embed"))
            x = x + layer.mlp(layer.ln_2(x))
        x = constrain(x, ("batch", "length", "embed"))
    logits = model.head(x, *model.head_params())
    new = KVCache(constrain(jnp.stack(ks), _CACHE_NAMES), constrain(jnp.stack(vs), _CACHE_NAMES))
    return logits, new


@dataclasses.dataclass
class Generated:
    """``tokens``: the new ids per prompt (up to and including a stop id); ``prefill_s`` /
    ``decode_s``: wall time of the prefill and of the remaining steps (compile included on
    first use); ``stopped``: per prompt, whether it ended at one of ``stop_ids``;
    ``tokens_per_s``: new tokens of all rows per second of decoding."""

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    stopped: list[bool] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens)
        return n / max(self.prefill_s + self.decode_s, 1e-9)


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """``logits`` [..., vocab] with the tokens outside the ``top_k`` likeliest (0: no limit)
    and outside the smallest set whose probability reaches ``top_p`` set to -inf, as
    transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper`` do (the likeliest token is
    always kept; ties at the threshold are all kept).

    >>> filter_logits(jnp.log(jnp.array([0.5, 0.3, 0.2])), top_p=0.7).tolist()[2]
    -inf
    """
    logits = logits.astype(jnp.float32)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # likeliest first
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the likelier tokens
        # The last token kept in sorted order (the first always is): its logit is the cut.
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
        cut = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    return logits


def _pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int,
          top_p: float) -> jax.Array:
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # As transformers: temperature first, then top-k, then top-p.
    logits = filter_logits(logits.astype(jnp.float32) / temperature, top_k, top_p)
    return jax.random.categorical(key, logits).astype(jnp.int32)


_STATIC = ("temperature", "top_k", "top_p", "attention")


@jax.jit(static_argnames=_STATIC)
def _prefill(model, tokens, positions, cache, start, key, temperature, top_k, top_p, attention):
    logits, cache = forward(model, tokens, positions, cache, jnp.int32(0), start, attention)
    return _pick(logits[:, -1], key, temperature, top_k, top_p), cache


@jax.jit(static_argnames=_STATIC, donate_argnames=("cache",))
def _step(model, token, position, cache, index, start, key, temperature, top_k, top_p,
          attention):
    logits, cache = forward(model, token[:, None], position[:, None], cache, index, start,
                            attention)
    return _pick(logits[:, 0], key, temperature, top_k, top_p), cache


@jax.jit(static_argnames=_STATIC)
def _recompute(model, window, positions, cache, start, last, key, temperature, top_k, top_p,
               attention):
    logits, _ = forward(model, window, positions, cache, jnp.int32(0), start, attention)
    return _pick(logits[:, last], key, temperature, top_k, top_p)


def generate(model: Llama | GPT2, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_ids: Sequence[int] = (), use_cache: bool = True, mesh: Any = None,
             rules: Any = None, attention: str = "auto") -> Generated:
    """``max_new_tokens`` new tokens after each prompt (greedy when ``temperature <= 0``,
    else sampled from the ``top_k`` likeliest tokens (0: all) within probability ``top_p``),
    attending with the implementation ``attention`` (``shardax.models.attention``).

    A row ends at the first of ``stop_ids`` it emits (kept as its last token; ``stopped``
    says so), and decoding ends once every row has. With ``mesh`` and ``rules``
    (``LogicalAxisRules``) the computation runs under them (the model's arrays should already
    be sharded; the cache follows the rules). When the longest prompt plus the new tokens
    exceed ``max_seq_len``, generation goes in rounds: each round re-reads (prefills) the last
    ``max_seq_len // 2`` tokens of every row and fills the rest of the window. Any number of
    prompts works: where the rules split the batch over mesh axes the prompt count does not
    divide, the batch is padded with copies of the first prompt and those rows are dropped
    from the result.

    Example::

        out = generate(model, [tok.encode('def ')], 64, temperature=0.8, top_p=0.95)
        print(out.tokens_per_s)
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
    length = model.config.max_seq_len
    rows = _padded_rows(len(prompts), mesh, rules)
    seqs = [list(p) for p in prompts] + [list(prompts[0])] * (rows - len(prompts))
    new: list[list[int]] = [[] for _ in seqs]
    # Padding rows count as stopped: nothing waits for them.
    stopped = [False] * len(prompts) + [True] * (rows - len(prompts))
    out = Generated(new, 0.0, 0.0, stopped)
    stop = np.asarray(sorted(set(stop_ids)), np.int32)
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                    attention=attention)
    remaining, round_ = max_new_tokens, 0
    while remaining > 0 and not all(stopped):
        if max(map(len, seqs)) + remaining > length:
            seqs = [s[-(length // 2):] for s in seqs]
        n = min(remaining, length - max(map(len, seqs)))
        got = _once(model, seqs, n, sampling, seed + round_, stop, stopped, use_cache, mesh,
                    rules)
        for r, toks in enumerate(got.tokens):
            if not stopped[r]:
                new[r].extend(toks)
                seqs[r].extend(toks)
                stopped[r] = got.stopped[r]
        out.prefill_s += got.prefill_s
        out.decode_s += got.decode_s
        remaining -= n
        round_ += 1
    del new[len(prompts):], stopped[len(prompts):]
    return out


def _padded_rows(n: int, mesh: Any, rules: Any) -> int:
    """``n`` rounded up to a multiple of the mesh axes the rules may split 'batch' over.

    A rule list can give 'batch' different axes in different arrays (a fallback applies where
    an earlier name took an axis); each is a subset of all the axes its rules name, so a
    multiple of their product divides every one.
    """
    if mesh is None or rules is None:
        return n
    sizes = dict(getattr(mesh, "mesh", mesh).shape)
    axes: set[str] = set()
    for name, names in rules:
        if name == "batch" and names is not None:
            axes.update(a for a in ((names,) if isinstance(names, str) else names) if a in sizes)
    multiple = math.prod(sizes[a] for a in axes)
    return -(-n // multiple) * multiple


def _once(model, prompts, max_new_tokens, sampling, seed, stop, done, use_cache, mesh, rules
          ) -> Generated:
    """One round of :func:`generate`: prompt plus new tokens fit ``max_seq_len``; rows in
    ``done`` have already stopped (the round ends early once every row has)."""
    width = max(len(p) for p in prompts)
    total = width + max_new_tokens
    b = len(prompts)
    pad = np.array([width - len(p) for p in prompts], np.int32)
    buf = np.zeros((b, total), np.int32)
    for r, p in enumerate(prompts):
        buf[r, pad[r]:width] = p
    cols = np.arange(total, dtype=np.int32)
    positions = np.maximum(cols[None, :] - pad[:, None], 0).astype(np.int32)
    start = jnp.asarray(pad)
    key = jax.random.key(seed)
    ends = np.full(b, total)  # the column after each row's stop id
    finished = np.array(done, bool)
    hits = np.zeros(b, bool)  # the rows that stop in this round
    end = total

    def record(col: int) -> bool:
        """Notes the rows that stopped at ``col``; whether every row now has."""
        hit = ~finished & np.isin(buf[:, col], stop)
        ends[hit] = col + 1
        finished[hit] = hits[hit] = True
        return bool(finished.all())

    contexts = []
    if mesh is not None:
        contexts.append(jax.set_mesh(getattr(mesh, "mesh", mesh)))
    if rules is not None:
        contexts.append(use_logical_rules(rules))
    for ctx in contexts:
        ctx.__enter__()
    try:
        t0 = time.perf_counter()
        cache = init_cache(model, b, total)
        if use_cache:
            key, sub = jax.random.split(key)
            tok, cache = _prefill(model, jnp.asarray(buf[:, :width]),
                                  jnp.asarray(positions[:, :width]), cache, start, sub,
                                  **sampling)
            buf[:, width] = np.asarray(tok)
            t1 = time.perf_counter()
            if record(width):
                end = width + 1
            for col in range(width + 1, end):
                key, sub = jax.random.split(key)
                tok, cache = _step(model, jnp.asarray(buf[:, col - 1]),
                                   jnp.asarray(positions[:, col - 1]), cache, jnp.int32(col - 1),
                                   start, sub, **sampling)
                buf[:, col] = np.asarray(tok)
                if record(col):
                    end = col + 1
                    break
        else:
            t1 = t0
            for col in range(width, total):
                key, sub = jax.random.split(key)
                tok = _recompute(model, jnp.asarray(buf), jnp.asarray(positions), cache, start,
                                 jnp.int32(col - 1), sub, **sampling)
                buf[:, col] = np.asarray(tok)
                if col == width:
                    t1 = time.perf_counter()
                if record(col):
                    end = col + 1
                    break
        t2 = time.perf_counter()
    finally:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
    return Generated([buf[r, width:min(ends[r], end)].tolist() for r in range(b)], t1 - t0,
                     t2 - t1, hits.tolist())
