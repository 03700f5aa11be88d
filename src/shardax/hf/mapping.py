"""Where each shardax parameter lives in a Hugging Face checkpoint, and how it is laid out.

A :class:`TensorMap` says: take HF tensor ``name``, view it with shape ``view``, fix the view
dims in ``select`` (e.g. GPT-2's fused ``c_attn`` holds q, k and v on one dim), and transpose
the remaining dims by ``perm`` to get the shardax parameter (or one layer of a stacked one).
The same maps drive import (read a slice) and export (write the inverse).

Example::

    maps = param_maps(LlamaConfig(...))
    maps['layers/0/attn/wq']   # TensorMap('model.layers.0.self_attn.q_proj.weight',
                               #   hf_shape=(heads * head_dim, dim),
                               #   view=(heads, head_dim, dim), perm=(2, 0, 1))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from shardax.models.configs import GPT2Config, LlamaConfig

__all__ = ["TensorMap", "iter_maps", "param_maps", "read_block", "stack_depth", "to_hf"]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One shardax array (or one layer of it) as a view of the HF tensor ``name`` (of shape
    ``hf_shape``)."""

    name: str
    hf_shape: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]
    select: tuple[tuple[int, int], ...] = ()

    def groups(self) -> list[list[int]]:
        """The view dims that make up each HF dim (a view is a reshape of the HF tensor)."""
        hf_shape = self.hf_shape
        out: list[list[int]] = []
        dim = 0
        for size in hf_shape:
            if dim == len(self.view):
                break
            acc, prod = [dim], self.view[dim]
            dim += 1
            while prod < size and dim < len(self.view):
                prod *= self.view[dim]
                acc.append(dim)
                dim += 1
            if prod != size:
                break
            out.append(acc)
        if len(out) != len(hf_shape) or dim != len(self.view):
            raise ValueError(f"Hugging Face tensor {self.name!r} has shape {tuple(hf_shape)}, "
                             f"expected {math.prod(self.view)} elements as {self.view}")
        return out

    def shape(self) -> tuple[int, ...]:
        """The shardax array's shape (one layer's, for a stacked parameter)."""
        fixed = dict(self.select)
        rest = [s for i, s in enumerate(self.view) if i not in fixed]
        return tuple(rest[p] for p in self.perm)


def read_block(m: TensorMap, index: Sequence[slice], read) -> np.ndarray:
    """The shardax block at ``index`` (slices of :meth:`TensorMap.shape`), fetching from the HF
    tensor with ``read(ranges)`` only the rows that block needs. A view dim split off a HF dim
    reads its outer part exactly; inner parts (e.g. half of ``head_dim``) read whole, then cut."""
    fixed = dict(m.select)
    rest = [i for i in range(len(m.view)) if i not in fixed]
    view_sl: list[tuple[int, int]] = [(0, 0)] * len(m.view)
    for i, k in fixed.items():
        view_sl[i] = (k, k + 1)
    for j, sl in enumerate(index):
        vi = rest[m.perm[j]]
        start, stop, _ = sl.indices(m.view[vi])
        view_sl[vi] = (start, stop)
    ranges, cut = [], []
    for group in m.groups():
        inner = math.prod(m.view[i] for i in group[1:])
        a, b = view_sl[group[0]]
        ranges.append((a * inner, b * inner))
        cut.append(slice(0, b - a))
        cut.extend(slice(*view_sl[i]) for i in group[1:])
    block = read(ranges)
    shape = []
    for group in m.groups():
        a, b = view_sl[group[0]]
        shape.extend([b - a, *(m.view[i] for i in group[1:])])
    block = block.reshape(shape)[tuple(cut)]
    block = block.reshape([b - a for i, (a, b) in enumerate(view_sl) if i not in fixed])
    return np.transpose(block, m.perm)


def to_hf(m: TensorMap, value: np.ndarray, out: np.ndarray) -> None:
    """Writes the shardax array ``value`` into its place in the HF tensor ``out`` (in place)."""
    fixed = dict(m.select)
    view = out.reshape(m.view)
    inverse = np.argsort(m.perm)
    idx = tuple(fixed.get(i, slice(None)) for i in range(len(m.view)))
    view[idx] = np.transpose(value, inverse)


def param_maps(config: LlamaConfig | GPT2Config) -> dict[str, TensorMap | list]:
    """``{shardax parameter path ('/'-joined): map}`` of the model built from ``config``; a
    parameter stacked on leading axes maps to nested lists of :class:`TensorMap` (one list
    level per axis): a layer stack holds one item per layer, an expert weight one
    :class:`TensorMap` per expert."""
    if isinstance(config, LlamaConfig):
        top, layer = _llama_maps(config)
    elif isinstance(config, GPT2Config):
        top, layer = _gpt2_maps(config)
    else:
        raise ValueError(f"no Hugging Face layout for {type(config).__name__}")
    out: dict[str, TensorMap | list] = dict(top)
    per_layer = [layer(i) for i in range(config.n_layers)]
    if not getattr(config, "mixed_layers", False):  # one stack (`shardax.models.create`)
        for key in per_layer[0] if per_layer else ():
            out[f"layers/{key}"] = [p[key] for p in per_layer]
    else:  # layers may differ (first_k_dense): each its own keys
        out.update({f"layers/{i}/{key}": m for i, p in enumerate(per_layer)
                    for key, m in p.items()})
    return out


def iter_maps(m: TensorMap | list, index: tuple[int, ...] = ()):
    """``(index, TensorMap)`` for each map in a (nested) list, ``index`` its position on the
    stacked leading axes (``()`` for a single map)."""
    if isinstance(m, TensorMap):
        yield index, m
        return
    for i, one in enumerate(m):
        yield from iter_maps(one, (*index, i))


def stack_depth(m: TensorMap | list) -> int:
    """The number of stacked leading axes of a (nested) map list."""
    return 0 if isinstance(m, TensorMap) else 1 + stack_depth(m[0])


def _moe_maps(c: LlamaConfig, p: str) -> dict[str, TensorMap | list]:
    """The dropless mixture-of-experts MLP of layer prefix ``p``: Mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2`` or Qwen-MoE's ``mlp.experts.{e}.gate/up/down_proj``
    (and Qwen2-MoE's shared expert)."""
    d, m, e = c.dim, c.mlp_dim, c.n_experts
    mixtral = c.family == "mixtral"
    deepseek = c.family == "deepseek_v3"
    q = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, TensorMap | list] = {
        "mlp/router": TensorMap(q + "gate.weight", (e, d), (e, d), (1, 0))}
    for ours, theirs, shape in zip(("w_gate", "w_up", "w_down"), names,
                                   ((m, d), (m, d), (d, m))):
        out[f"mlp/{ours}"] = [TensorMap(f"{q}experts.{j}.{theirs}.weight", shape, shape, (1, 0))
                              for j in range(e)]
    if c.router_bias:  # DeepSeek-V3's auxiliary-loss-free balancing bias
        out["mlp/router_bias"] = TensorMap(q + "gate.e_score_correction_bias", (e,), (e,), (0,))
    if c.shared_expert_dim:
        f, s = c.shared_expert_dim, q + ("shared_experts." if deepseek else "shared_expert.")
        out.update({
            "mlp/shared_gate": TensorMap(s + "gate_proj.weight", (f, d), (f, d), (1, 0)),
            "mlp/shared_up": TensorMap(s + "up_proj.weight", (f, d), (f, d), (1, 0)),
            "mlp/shared_down": TensorMap(s + "down_proj.weight", (d, f), (d, f), (1, 0)),
        })
        if c.shared_expert_gate:
            out["mlp/shared_router"] = TensorMap(q + "shared_expert_gate.weight", (1, d),
                                                 (1, d), (1, 0))
    return out


def _gpt_oss_maps(c: LlamaConfig, p: str) -> dict[str, TensorMap | list]:
    """gpt-oss's experts under the layer prefix ``p``: the router (weight and bias), the fused
    ``gate_up_proj`` [experts, dim, 2 * mlp] whose even columns are the gate and odd ones the
    up projection (its bias likewise), ``down_proj`` [experts, mlp, dim] and its bias."""
    d, m, e = c.dim, c.mlp_dim, c.n_experts
    q = p + "mlp."
    gu, gub = q + "experts.gate_up_proj", q + "experts.gate_up_proj_bias"
    down, downb = q + "experts.down_proj", q + "experts.down_proj_bias"
    out: dict[str, TensorMap | list] = {
        "mlp/router": TensorMap(q + "router.weight", (e, d), (e, d), (1, 0)),
        "mlp/router_b": TensorMap(q + "router.bias", (e,), (e,), (0,)),
        "mlp/w_down": [TensorMap(down, (e, m, d), (e, m, d), (0, 1), ((0, j),))
                       for j in range(e)],
        "mlp/b_down": [TensorMap(downb, (e, d), (e, d), (0,), ((0, j),)) for j in range(e)],
    }
    for half, name in enumerate(("gate", "up")):
        out[f"mlp/w_{name}"] = [TensorMap(gu, (e, d, 2 * m), (e, d, m, 2), (0, 1),
                                          ((0, j), (3, half))) for j in range(e)]
        out[f"mlp/b_{name}"] = [TensorMap(gub, (e, 2 * m), (e, m, 2), (0,),
                                          ((0, j), (2, half))) for j in range(e)]
    return out


def _mla_maps(c: LlamaConfig, a: str) -> dict[str, TensorMap]:
    """DeepSeek-V3's latent attention under the prefix ``a`` ('...self_attn.')."""
    d, h, hd, r, v = c.dim, c.n_heads, c.head_dim, c.qk_rope_head_dim, c.v_head_dim
    ql, kl, kvd = c.q_lora_rank, c.kv_lora_rank, hd - r + v
    maps = {
        "attn/wkv_a": TensorMap(a + "kv_a_proj_with_mqa.weight", (kl + r, d), (kl + r, d),
                                (1, 0)),
        "attn/kv_norm": TensorMap(a + "kv_a_layernorm.weight", (kl,), (kl,), (0,)),
        "attn/wkv_b": TensorMap(a + "kv_b_proj.weight", (h * kvd, kl), (h, kvd, kl),
                                (2, 0, 1)),
        "attn/wo": TensorMap(a + "o_proj.weight", (d, h * v), (d, h, v), (1, 2, 0)),
    }
    if not ql:
        maps["attn/wq"] = TensorMap(a + "q_proj.weight", (h * hd, d), (h, hd, d), (2, 0, 1))
        return maps
    maps.update({
        "attn/wq_a": TensorMap(a + "q_a_proj.weight", (ql, d), (ql, d), (1, 0)),
        "attn/q_norm": TensorMap(a + "q_a_layernorm.weight", (ql,), (ql,), (0,)),
        "attn/wq_b": TensorMap(a + "q_b_proj.weight", (h * hd, ql), (h, hd, ql), (2, 0, 1)),
    })
    return maps


def _llama_maps(c: LlamaConfig):
    if c.n_experts and c.moe_impl != "dropless":
        raise ValueError("a capacity-based mixture-of-experts Llama has no Hugging Face layout "
                         "(moe_impl='dropless' has Mixtral's and Qwen-MoE's)")
    d, h, kv, hd, v = c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size
    top = {"embed": TensorMap("model.embed_tokens.weight", (v, d), (v, d), (0, 1)),
           "final_norm/scale": TensorMap("model.norm.weight", (d,), (d,), (0,))}
    if not c.tie_embeddings:
        top["lm_head"] = TensorMap("lm_head.weight", (v, d), (v, d), (1, 0))

    def layer(i):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        def norm(name, size=d):
            return TensorMap(name + ".weight", (size,), (size,), (0,))

        # Gemma's "post_attention_layernorm" norms the attention output; Llama's the MLP input.
        mlp_in = "pre_feedforward_layernorm" if c.post_norms else "post_attention_layernorm"
        maps = {
            "attn_norm/scale": norm(p + "input_layernorm"),
            "mlp_norm/scale": norm(p + mlp_in),
        }
        if c.mla:
            maps.update(_mla_maps(c, a))
        else:
            maps.update({
                "attn/wq": TensorMap(a + "q_proj.weight", (h * hd, d), (h, hd, d), (2, 0, 1)),
                "attn/wk": TensorMap(a + "k_proj.weight", (kv * hd, d), (kv, hd, d),
                                     (2, 0, 1)),
                "attn/wv": TensorMap(a + "v_proj.weight", (kv * hd, d), (kv, hd, d),
                                     (2, 0, 1)),
                "attn/wo": TensorMap(a + "o_proj.weight", (d, h * hd), (d, h, hd), (1, 2, 0)),
            })
        if not c.is_dense(i):
            maps.update(_gpt_oss_maps(c, p) if c.family == "gpt_oss" else _moe_maps(c, p))
        else:
            m = c.dense_mlp_dim or c.mlp_dim if c.n_experts else c.mlp_dim
            maps.update({
                "mlp/w_gate": TensorMap(p + "mlp.gate_proj.weight", (m, d), (m, d), (1, 0)),
                "mlp/w_up": TensorMap(p + "mlp.up_proj.weight", (m, d), (m, d), (1, 0)),
                "mlp/w_down": TensorMap(p + "mlp.down_proj.weight", (d, m), (d, m), (1, 0)),
            })
        if c.post_norms:
            maps["attn_post_norm/scale"] = norm(p + "post_attention_layernorm")
            maps["mlp_post_norm/scale"] = norm(p + "post_feedforward_layernorm")
        if c.qk_norm:
            maps["attn/q_norm/scale"] = norm(a + "q_norm", hd)
            maps["attn/k_norm/scale"] = norm(a + "k_norm", hd)
        if c.attn_out_bias:
            maps["attn/bo"] = TensorMap(a + "o_proj.bias", (d,), (d,), (0,))
        if c.attn_sinks:
            maps["attn/sinks"] = TensorMap(a + "sinks", (h,), (h,), (0,))
        if c.qkv_bias:
            maps["attn/bq"] = TensorMap(a + "q_proj.bias", (h * hd,), (h, hd), (0, 1))
            maps["attn/bk"] = TensorMap(a + "k_proj.bias", (kv * hd,), (kv, hd), (0, 1))
            maps["attn/bv"] = TensorMap(a + "v_proj.bias", (kv * hd,), (kv, hd), (0, 1))
        return maps

    return top, layer


def _gpt2_maps(c: GPT2Config):
    d, h, hd, m = c.dim, c.n_heads, c.head_dim, c.mlp_dim
    t = "transformer."
    top = {"wte": TensorMap(t + "wte.weight", (c.vocab_size, d), (c.vocab_size, d), (0, 1)),
           "wpe": TensorMap(t + "wpe.weight", (c.max_seq_len, d), (c.max_seq_len, d), (0, 1)),
           "ln_f/scale": TensorMap(t + "ln_f.weight", (d,), (d,), (0,)),
           "ln_f/bias": TensorMap(t + "ln_f.bias", (d,), (d,), (0,))}

    def layer(i):
        p = f"{t}h.{i}."
        maps = {f"{ln}/{ours}": TensorMap(f"{p}{ln}.{theirs}", (d,), (d,), (0,))
                for ln in ("ln_1", "ln_2") for ours, theirs in (("scale", "weight"),
                                                                ("bias", "bias"))}
        for k, name in enumerate(("q", "k", "v")):
            maps[f"attn/w{name}"] = TensorMap(p + "attn.c_attn.weight", (d, 3 * d),
                                              (d, 3, h, hd), (0, 1, 2), select=((1, k),))
            maps[f"attn/b{name}"] = TensorMap(p + "attn.c_attn.bias", (3 * d,), (3, h, hd),
                                              (0, 1), select=((0, k),))
        maps.update({
            "attn/wo": TensorMap(p + "attn.c_proj.weight", (d, d), (h, hd, d), (0, 1, 2)),
            "attn/bo": TensorMap(p + "attn.c_proj.bias", (d,), (d,), (0,)),
            "mlp/w_fc": TensorMap(p + "mlp.c_fc.weight", (d, m), (d, m), (0, 1)),
            "mlp/b_fc": TensorMap(p + "mlp.c_fc.bias", (m,), (m,), (0,)),
            "mlp/w_proj": TensorMap(p + "mlp.c_proj.weight", (m, d), (m, d), (0, 1)),
            "mlp/b_proj": TensorMap(p + "mlp.c_proj.bias", (d,), (d,), (0,)),
        })
        return maps

    return top, layer
