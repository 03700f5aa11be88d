"""Memory and communication of the llama train step against the textbook formulas.

Everything is compiled from ``jax.ShapeDtypeStruct``s (nothing big is allocated) and read from
the compiled program: per-device argument bytes (``ShardingPlan.rows`` and
``memory_analysis()``) and the collectives of the optimized HLO (``ShardingPlan.collectives``).

    python benchmarks/memory_comm.py [--json out.json]
    python benchmarks/memory_comm.py --dtypes --json out.json   # with XLA_FLAGS dumping HLO
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

from _common import (
    N_DEVICES,
    LogicalAxisRules,
    MeshShardingHelper,
    Policy,
    abstract_train_state,
    adamw,
    batch_shape,
    emit,
    goal_row,
    jax,
    jnp,
    llama_config,
    llama_step,
    models,
)

from shardax import layout
from shardax.hlo import hlo_collectives
from shardax.layout import Layout
from shardax.parallel import tp_mlp
from shardax.train.step import TrainState, eval_loss

MODEL = "llama-small"
BATCH, SEQ = 16, 128
GOAL = 1.05

FP32 = Policy()
MIXED = Policy(compute=jnp.dtype("bfloat16"))
BF16 = Policy(params=jnp.dtype("bfloat16"), compute=jnp.dtype("bfloat16"))

# (label, preset, mesh, policy, config overrides)
CASES = [
    ("dp", "dp", "dp=-1", FP32, {}),
    ("fsdp", "fsdp", "fsdp=-1", FP32, {}),
    ("fsdp_tp", "fsdp_tp", "fsdp=-1,tp=2", FP32, {}),
    ("tp", "tp", "dp=2,tp=4", FP32, {}),
    ("fsdp, scan_layers", "fsdp", "fsdp=-1", FP32, {"scan_layers": True}),
    ("fsdp, params=f32 compute=bf16", "fsdp", "fsdp=-1", MIXED, {}),
    ("fsdp, params=bf16", "fsdp", "fsdp=-1", BF16, {}),
    ("pp, fsdp", "fsdp", "pp=2,fsdp=4", FP32, {"scan_layers": True, "pp_microbatches": 2}),
    ("dp, untied embeddings", "dp", "dp=-1", FP32, {"tie_embeddings": False}),
    ("fsdp, untied embeddings", "fsdp", "fsdp=-1", FP32, {"tie_embeddings": False}),
    ("fsdp, scan_layers, untied embeddings", "fsdp", "fsdp=-1", FP32,
     {"scan_layers": True, "tie_embeddings": False}),
]
MEMORY_CASES = 8  # the first eight also go into the memory table


def _itemsize(dtype: Any) -> int:
    return jnp.dtype(dtype).itemsize


def _state_split(preset: str, mesh: MeshShardingHelper) -> int:
    """Over how many devices the preset splits (almost) every parameter outside the layers."""
    axes = {"dp": (), "fsdp": ("fsdp",), "tp": ("tp",), "fsdp_tp": ("fsdp", "tp")}[preset]
    return math.prod(mesh.shape.get(a, 1) for a in axes)


def _leaf_split(path: str, split: int, mesh: MeshShardingHelper) -> int:
    """A pipeline also splits the stacked layers over 'pp' (and nothing else)."""
    return split * mesh.shape.get("pp", 1) if "/layers/" in f"/{path}/" else split


def _leaf_dtype(tree: Any, key: str) -> Any:
    """dtype of the first leaf whose path contains ``key`` (e.g. the Adam ``mu``)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if key in jax.tree_util.keystr(path):
            return leaf.dtype
    raise ValueError(f"no leaf with {key!r} in its path")


def _group(path: str) -> str:
    """``state/opt_state/1/0/mu/layers/3/attn_norm/scale/value`` -> ``attn_norm/scale``."""
    parts = [p for p in path.split("/") if p not in ("value",) and not p.isdigit()]
    return "/".join(parts[-2:])


def compile_case(label, preset, mesh_text, policy, overrides) -> dict[str, Any]:
    """Plans one train step; returns the numbers both tables need."""
    overrides = dict(overrides)
    lay = Layout(pp_microbatches=overrides.pop("pp_microbatches", 1),
                 scan_layers=overrides.pop("scan_layers", False))
    config = llama_config(MODEL, policy, **overrides)
    tx = adamw()
    graphdef, state = abstract_train_state(config, tx)
    mesh = MeshShardingHelper.from_string(mesh_text)
    # resolve() adds the parallel axes (layers -> pp) as `shardax train` does.
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS[preset], mesh.shape, heads=config.n_heads, kv_heads=config.n_kv_heads))
    plan = llama_step(mesh, rules, graphdef, tx, policy, layout=lay).plan(
        state, batch_shape(BATCH, SEQ))

    psi = models.param_count(config)
    psi_layers = psi - models.param_count(dataclasses.replace(config, n_layers=0))
    split = _state_split(preset, mesh)
    pp = mesh.shape.get("pp", 1)
    p_bytes = _itemsize(policy.params)
    m_bytes = _itemsize(_leaf_dtype(state.opt_state, "mu"))
    v_bytes = _itemsize(_leaf_dtype(state.opt_state, "nu"))
    state_rows = [r for r in plan.rows if r.kind == "input" and r.path.startswith("state/")]
    measured = sum(r.bytes_per_device for r in state_rows)
    formula = (psi - psi_layers + psi_layers / pp) * (p_bytes + m_bytes + v_bytes) / split
    excess: dict[str, float] = {}
    for r in state_rows:
        ways = _leaf_split(r.path, split, mesh)
        extra = r.bytes_per_device - math.prod(r.shape) * _itemsize(r.dtype) / ways
        if extra > 0:
            excess[_group(r.path)] = excess.get(_group(r.path), 0) + extra
    ops = [(op.kind, op.dtype, op.bytes, op.multiplier) for op in plan.collective_ops]
    return {
        "label": label, "preset": preset, "mesh": plan.mesh_shape, "policy": str(policy),
        "psi": psi, "psi_layers": psi_layers, "pp": pp, "split": split,
        "p_bytes": p_bytes, "m_bytes": m_bytes, "v_bytes": v_bytes,
        "state_bytes": measured, "argument_bytes": plan.memory.get("argument_size_in_bytes"),
        "temp_bytes": plan.memory.get("temp_size_in_bytes"), "formula_bytes": formula,
        "excess": dict(sorted(excess.items(), key=lambda kv: -kv[1])),
        "collectives": {k: {"count": v.count, "bytes": v.bytes}
                        for k, v in plan.collectives.items() if v.count},
        "ops": ops,
        "embed_bytes": config.vocab_size * config.dim * p_bytes,
        "tied": config.tie_embeddings, "scan": lay.scan_layers,
        "n_layers": config.n_layers, "dim": config.dim,
    }


# ----------------------------------------------------------------------------- TP (Megatron)

def tp_forward() -> dict[str, Any]:
    """The model's forward loss under the ``tp`` preset: all-reduces of b*s*h per layer."""
    config = llama_config(MODEL, FP32)
    graphdef, state = abstract_train_state(config, adamw())
    mesh = MeshShardingHelper.from_string("dp=2,tp=4")
    rules = LogicalAxisRules(layout.PRESETS["tp"])
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    loss = mesh.sjit(partial(eval_loss, graphdef=graphdef, policy=FP32),
                     in_shardings=(rules, batch_spec))
    # Only what eval_loss reads: jax.jit drops unused arguments, which ShardingPlan mislabels.
    params = TrainState(state.params, state.rest, None, None)
    plan = loss.plan(params, batch_shape(BATCH, SEQ))
    bsh = BATCH // mesh.shape["dp"] * SEQ * config.dim * 4
    ars = [op for op in plan.collective_ops if op.kind == "all-reduce"]
    return {
        "mesh": plan.mesh_shape, "n_layers": config.n_layers, "bsh_bytes": bsh,
        "all_reduce_bytes": sum(op.bytes for op in ars), "all_reduce_count": len(ars),
        "bsh_sized": sum(op.bytes == bsh for op in ars),
        "other_kinds": {k: v.bytes for k, v in plan.collectives.items()
                        if v.count and k != "all-reduce"},
        "theory_bytes": 2 * config.n_layers * bsh,
    }


def tp_mlp_forward() -> list[dict[str, Any]]:
    """``shardax.parallel.tp_mlp`` alone on tp=8: one all-reduce of b*s*h (or AG + RS)."""
    b, s, h, f = 8, 128, 512, 2048
    mesh = MeshShardingHelper.from_string("tp=-1")
    x = jax.ShapeDtypeStruct((b, s, h), jnp.float32)
    w_in = jax.ShapeDtypeStruct((h, f), jnp.float32)
    w_out = jax.ShapeDtypeStruct((f, h), jnp.float32)
    P = jax.sharding.PartitionSpec
    bsh = b * s * h * 4
    rows = []
    for sp in (False, True):
        fn = mesh.sjit(partial(tp_mlp, sequence_parallel=sp),
                       in_shardings=(P(None, "tp" if sp else None), P(None, "tp"), P("tp")))
        plan = fn.plan(x, w_in, w_out)
        rows.append({
            "mode": "sync + sequence parallel" if sp else "sync",
            "bsh_bytes": bsh,
            "collectives": {k: {"count": v.count, "bytes": v.bytes}
                            for k, v in plan.collectives.items() if v.count},
            "theory": ({"all-gather": bsh, "reduce-scatter": bsh} if sp
                       else {"all-reduce": bsh}),
        })
    return rows


# ----------------------------------------------------------------------------- dtype check

def dtype_check(dump_dir: Path) -> list[dict[str, Any]]:
    """Collective dtypes right after SPMD partitioning vs in the optimized HLO.

    Needs ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning`` (set by
    ``run.py``) so XLA writes the module as the partitioner left it.
    """
    out = []
    for label, preset, mesh_text, policy, overrides in CASES:
        if policy is FP32:
            continue
        before = set(dump_dir.glob("*after_spmd-partitioning*.txt"))
        case = compile_case(label, preset, mesh_text, policy, overrides)
        new = sorted(set(dump_dir.glob("*after_spmd-partitioning*.txt")) - before)
        partitioned = [op for f in new for op in hlo_collectives(f.read_text())]
        out.append({
            "label": label, "policy": case["policy"],
            "optimized": _by_dtype(case["ops"]),
            "partitioned": _by_dtype([(o.kind, o.dtype, o.bytes, o.multiplier)
                                      for o in partitioned]),
            "partitioned_f32_big": sorted(
                (o.kind, o.bytes) for o in partitioned if o.dtype == "f32" and o.bytes > 1 << 20),
            "table_f32_bytes": case["embed_bytes"] // case["p_bytes"] * 4,
            "dumped": [f.name for f in new],
        })
    return out


def _by_dtype(ops) -> dict[str, int]:
    totals: dict[str, int] = {}
    for kind, dtype, nbytes, _ in ops:
        totals[f"{kind} {dtype}"] = totals.get(f"{kind} {dtype}", 0) + nbytes
    return totals


# ----------------------------------------------------------------------------- rendering

def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _ok(ratio: float, goal: float = GOAL) -> str:
    return "yes" if ratio <= goal else "**no**"


def render_memory(cases: list[dict[str, Any]]) -> str:
    lines = [
        "## 1. Memory: parameters + optimizer state per device",
        "",
        f"Model `{MODEL}` (Ψ = {cases[0]['psi']:,} parameters), train step "
        f"`shardax.train.step.train_step` with adamw (`make_optimizer('adamw', ...)`), batch "
        f"{BATCH}x{SEQ}, {N_DEVICES} devices. **Measured** = per-device bytes of the compiled "
        "step's arguments under `state/` (params + Adam mu + nu + counters, from "
        "`ShardingPlan.rows`; `memory_analysis().argument_size_in_bytes` adds only the token "
        "batch). Gradients are not an argument (they live in the step's temporaries), so the "
        "matching ZeRO formula is its params + optimizer part: **(p + m + v)·Ψ / S**, with p, m, "
        "v the bytes per element of parameters and Adam moments (optax keeps the moments in the "
        "parameter dtype) and S the number of devices a parameter is split over. For fp32 "
        "that is 12Ψ/S; ZeRO's 16Ψ/S adds the 4Ψ/S of gradients. Goal: ratio ≤ 1.05.",
        "",
        "| case | mesh | precision | formula | formula bytes | measured | ratio | goal met | "
        "temp (not in ratio) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for c in cases:
        ratio = c["state_bytes"] / c["formula_bytes"]
        formula = f"({c['p_bytes']}+{c['m_bytes']}+{c['v_bytes']})Ψ/{c['split']}"
        if c["pp"] > 1:
            formula = (f"({c['p_bytes']}+{c['m_bytes']}+{c['v_bytes']})(Ψ_E + Ψ_L/{c['pp']})"
                       f"/{c['split']}")
        mesh = ",".join(f"{k}={v}" for k, v in c["mesh"].items())
        lines.append(
            f"| {c['label']} | {mesh} | {c['policy']} | {formula} | {_mib(c['formula_bytes'])} | "
            f"{_mib(c['state_bytes'])} | {ratio:.4f} | {_ok(ratio)} | {_mib(c['temp_bytes'])} |"
        )
        if c["excess"]:
            top = ", ".join(f"`{k}` {v / 1024:,.1f} KiB" for k, v in list(c["excess"].items())[:4])
            extra = c["state_bytes"] - c["formula_bytes"]
            notes.append(f"- {c['label']}: {extra / 1024:,.1f} KiB above the formula "
                         f"({(ratio - 1) * 100:.2f}%), from leaves not split {c['split']} ways: "
                         f"{top}.")
    pipelined = [c for c in cases if c["pp"] > 1]
    if pipelined:
        c = pipelined[0]
        lines += ["", f"With a pipeline (`{c['label']}`) the stacked layers (Ψ_L = "
                  f"{c['psi_layers']:,}) are split over `pp` x `fsdp` and everything else "
                  f"(Ψ_E = {c['psi'] - c['psi_layers']:,}: embedding, final norm) over `fsdp` "
                  "only, on every stage, as `shardax train` lays it out (torchtitan would put "
                  "the embedding on the first stage only and the head on the last)."]
    lines += ["", "Where the excess comes from (leaves held whole, or split fewer ways than S):",
              "", *notes, ""]
    fsdp = next(c for c in cases if c["label"] == "fsdp")
    scan = next((c for c in cases if "scan" in c["label"]), None)
    dp = next(c for c in cases if c["label"] == "dp")
    lines += [
        "The replicated leaves are the RMSNorm scales (`norm` is not mapped to a mesh axis by "
        "the presets), the optimizer's step counters and `state/step`; under `fsdp_tp` and "
        "`tp`, leaves without a `tp`-mapped dimension (norms) are also whole on every `tp` "
        "rank. All are under 0.5% of the state.",
        "",
        f"Temporaries (last column: activations, gathered parameters, gradients) are outside "
        f"the formula and shown for completeness. Unrolled FSDP holds "
        f"{_mib(fsdp['temp_bytes'])} of temp per device against {_mib(dp['temp_bytes'])} for "
        "DP: the parameters gathered for the forward stay alive until the backward (one "
        "all-gather per parameter, see section 2) and the CPU backend forms full-size "
        "gradients before its all-reduce + dynamic-slice. So at this size FSDP on CPU saves "
        "state memory, not peak memory."
        + (f" With `scan_layers=True` temp is {_mib(scan['temp_bytes'])}." if scan else ""),
        "",
    ]
    return "\n".join(lines)


def _wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes one device sends for a ring collective whose full buffer is ``nbytes``."""
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
              "reduce-scatter": (n - 1) / n}.get(kind, 1.0)
    return nbytes * factor


def _in_comm_table(c: dict[str, Any]) -> bool:
    """The dp/fsdp cases at full precision without a pipeline: those the 2Ψ/3Ψ formulas fit."""
    return c["preset"] in ("dp", "fsdp") and "=" not in c["label"] and c["pp"] == 1


def _comm_row(c: dict[str, Any]) -> tuple[str, float, str]:
    """One communication table row, its ratio and an explanation when the goal is missed."""
    coll = {k: v["bytes"] for k, v in c["collectives"].items()}
    grads = c["psi"] * c["p_bytes"]
    n = c["split"] if c["preset"] != "dp" else math.prod(c["mesh"].values())
    if c["preset"] == "dp":
        theory = {"all-reduce": grads}
        formula = "all-reduce Ψ·p (grads)"
    else:
        theory = {"all-gather": 2 * grads, "reduce-scatter": grads}
        formula = "all-gather 2Ψ·p + reduce-scatter Ψ·p"
    total, want = sum(coll.values()), sum(theory.values())
    wire = sum(_wire(k, v, n) for k, v in coll.items())
    wire_want = sum(_wire(k, v, n) for k, v in theory.items())
    measured = ", ".join(f"{k} {_mib(v)}" for k, v in coll.items())
    ratio, wire_ratio = total / want, wire / wire_want
    mesh = ",".join(f"{k}={v}" for k, v in c["mesh"].items())
    row = (f"| {c['label']} | {mesh} | {formula} = {_mib(want)} | {measured} | {ratio:.3f} | "
           f"{wire_ratio:.3f} | {_ok(max(ratio, wire_ratio))} |")
    notes = []
    ar = coll.get("all-reduce", 0) + coll.get("reduce-scatter", 0)
    excess = ar - grads
    if c["tied"] and abs(excess - c["embed_bytes"]) < 0.01 * c["embed_bytes"] + 64:
        notes.append(
            f"the gradient reduction moves {_mib(excess)} more than Ψ·p: exactly one more "
            f"copy of the tied embedding table ({_mib(c['embed_bytes'])}). Its gradient has "
            "two parts (token lookup and output logits); XLA reduces each across devices "
            "before adding them instead of adding first. The untied control row shows the "
            "formula is met without the tie")
    if c["preset"] != "dp":
        a_, r_ = coll.get("all-gather", 0) / grads, ar / grads
        if a_ < 1.9:
            tables = ("embedding table, outside the loop, is" if c["tied"] else
                      "embedding and output tables, outside the loop, are")
            why = ("the parameters gathered for the forward stay alive for the backward pass "
                   "(one all-gather per parameter, no loop)" if not c["scan"] else
                   "inside the layer loop each layer is gathered for the forward and again "
                   f"for the backward, but the {tables} gathered once and kept")
            notes.append(f"all-gather is {a_:.2f}·Ψ·p, not 2·Ψ·p: {why} (less traffic, more "
                         "memory)")
        if coll.get("all-reduce", 0) > 0.5 * grads:
            notes.append(
                f"the gradient reduce-scatter is an all-reduce + dynamic-slice ({r_:.2f}·Ψ·p; "
                "the CPU backend never emits reduce-scatter), which a ring sends twice. Wire: "
                f"(a + 2r)(N-1)/N·Ψ·p with a = {a_:.2f}, r = {r_:.2f}, i.e. {(a_ + 2 * r_) / 3:.3f}"
                f" of the theory's 3(N-1)/N·Ψ·p; with a real reduce-scatter (GPU, TPU) the same "
                f"program would send (a + r)/3 = {(a_ + r_) / 3:.3f} of it")
    return row, max(ratio, wire_ratio), "; ".join(notes)


def _dtype_notes(dtypes: list[dict[str, Any]]) -> list[str]:
    """What the dtype table shows, from its own numbers."""
    if not dtypes:
        return ["(The dtype check did not run.)"]
    notes = [
        "- **Optimized HLO (CPU):** every bf16 collective the partitioner emits is widened to "
        "f32 by XLA:CPU's `all-reduce-promotion` and `float-normalization-bf16` passes (the CPU "
        "runtime has no bf16 collectives), so on this backend bytes are f32 whatever the "
        "policy. The partitioned HLO is what backends with bf16 collectives (GPU, TPU) move.",
    ]
    mixed = next((d for d in dtypes if "params=float32" in d["policy"]), None)
    if mixed:
        bf16 = {k: v for k, v in mixed["partitioned"].items() if k.endswith("bf16")}
        if bf16:
            notes.append(
                "- **params=f32, compute=bf16:** the policy casts the (sharded) parameters to "
                "bf16 before use, so the partitioner gathers the layer weights in bf16 and "
                "reduces their gradients in bf16 (" + ", ".join(
                    f"{k} {_mib(v)}" for k, v in bf16.items()) + "): half the bytes of the "
                "parameter dtype; the gradient sum itself is then in bf16.")
    for d in dtypes:
        big = d.get("partitioned_f32_big", [])
        table = d.get("table_f32_bytes", 0)
        if big and all(abs(b - table) <= 1024 for _, b in big):
            kinds = " and ".join(sorted({k for k, _ in big}))
            notes.append(
                f"- **{d['label']}:** the f32 collectives over 1 MiB left after partitioning "
                f"({kinds}, {len(big)} of {_mib(table)} each) are all the embedding table in "
                "f32. `Llama.__call__` computes the tied output logits with "
                "`einsum(..., preferred_element_type=float32)`; JAX differentiates that dot in "
                "f32 (it upcasts the bf16 operand), so the backward gathers an f32 copy of the "
                "table and all-reduces the table's gradient in f32 before casting it back."
                + (" With bf16 parameters that is wider than the parameters: **flagged**. A fix "
                   "in the model (not made here): compute the logits in the compute dtype and "
                   "cast the result to f32, or give the projection a custom VJP that casts the "
                   "cotangent to bf16 first." if "params=bfloat16" in d["policy"] else
                   " That is the parameter dtype here, so it is not flagged."))
        elif big:
            notes.append(f"- **{d['label']}:** f32 collectives over 1 MiB after partitioning: "
                         + ", ".join(f"{k} {_mib(b)}" for k, b in big) + ".")
    return notes


def _flag(d: dict[str, Any]) -> str:
    """Are collectives (over 1 MiB) in a wider float dtype than the parameters?"""
    if "params=bfloat16" not in d["policy"]:
        return "ok"

    def wide(totals: dict[str, int]) -> bool:
        return any(k.endswith("f32") and v > 1 << 20 for k, v in totals.items())

    if not wide(d["optimized"]):
        return "ok"
    if not wide(d["partitioned"]):
        return "f32 in the optimized HLO only (CPU backend widens bf16 collectives)"
    return "**wider than params**"


def render_comm(cases, tp, tp_mlp_rows, dtypes) -> str:
    lines = [
        "## 2. Communication: bytes per step by collective kind",
        "",
        "From the optimized HLO (`ShardingPlan.collectives`). **Convention:** the plan counts "
        "the *full buffer* of each collective per device (an all-reduce of a Ψ-byte gradient "
        "counts Ψ, an all-gather counts the gathered size). The bytes a device actually sends "
        "on a ring are (N-1)/N of that for all-gather and reduce-scatter and 2(N-1)/N for "
        "all-reduce; both ratios are shown (*buffer* and *wire*). Theory, with p the "
        "parameter bytes per element: DP all-reduces the gradients once (Ψ·p buffer, "
        "2(N-1)/N·Ψ·p on the wire, the textbook '2Ψ'); FSDP all-gathers the parameters for "
        "the forward and again for the backward and reduce-scatters the gradients ('3Ψ'). "
        "Goal: both ratios ≤ 1.05.",
        "",
        "| case | mesh | theory (buffer) | measured (buffer) | ratio buffer | ratio wire | "
        "goal met |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for c in filter(_in_comm_table, cases):
        row, ratio, note = _comm_row(c)
        lines.append(row)
        if note and ratio > GOAL:
            notes.append(f"- {c['label']}: {note}.")
        elif note:
            notes.append(f"- {c['label']} (within goal): {note}.")
    lines += ["", *notes, ""]

    fsdp_tp = next(c for c in cases if c["label"] == "fsdp_tp")
    lines += [
        f"`fsdp_tp` ({', '.join(f'{k}={v}' for k, v in fsdp_tp['mesh'].items())}) mixes "
        "both kinds and has no single textbook number; measured: " + ", ".join(
            f"{k} {_mib(v['bytes'])} ({v['count']} ops)"
            for k, v in fsdp_tp["collectives"].items()) + ".",
        "",
        "### Megatron tensor parallelism",
        "",
        "Theory: 2 all-reduces of b·s·h per layer in the forward pass (after the attention "
        "output projection and after the MLP down projection), b the per-replica batch.",
        "",
        "| what | mesh | theory | measured | ratio | goal met |",
        "|---|---|---|---|---|---|",
    ]
    ratio = tp["all_reduce_bytes"] / tp["theory_bytes"]
    mesh = ",".join(f"{k}={v}" for k, v in tp["mesh"].items())
    lines.append(
        f"| llama forward loss, `tp` preset | {mesh} | 2·{tp['n_layers']} layers x "
        f"b·s·h ({_mib(tp['bsh_bytes'])}) = {_mib(tp['theory_bytes'])} | all-reduce "
        f"{_mib(tp['all_reduce_bytes'])} ({tp['all_reduce_count']} ops, {tp['bsh_sized']} of "
        f"exactly b·s·h) | {ratio:.3f} | {_ok(ratio)} |")
    for r in tp_mlp_rows:
        measured = ", ".join(f"{k} {_mib(v['bytes'])} ({v['count']})"
                             for k, v in r["collectives"].items())
        theory = " + ".join(f"{k} {_mib(v)}" for k, v in r["theory"].items())
        got = sum(v["bytes"] for v in r["collectives"].values())
        ratio_mlp = got / sum(r["theory"].values())
        lines.append(f"| `parallel.tp_mlp` forward, {r['mode']} | tp=8 | {theory} | {measured} "
                     f"| {ratio_mlp:.3f} | {_ok(ratio_mlp)} |")
    extra = tp["bsh_sized"] - 2 * tp["n_layers"]
    lines += [
        "",
        f"The model has {tp['bsh_sized']} all-reduces of exactly b·s·h = 2·{tp['n_layers']} "
        f"+ {extra}: the extra one is the embedding lookup, whose table is split over `tp` "
        "along the vocabulary (each rank looks up its rows, zeros elsewhere, then an "
        "all-reduce); the rest are small [b, s] reductions of the cross-entropy over "
        "vocabulary-split logits. Per layer the count is the Megatron one."
        if ratio > GOAL else "",
        "",
        "### Collective dtypes (mixed precision)",
        "",
        "Parameters in bf16 should be gathered and reduced in bf16. The table shows the "
        "collectives by dtype right after XLA's SPMD partitioner (dumped with "
        "`--xla_dump_hlo_pass_re=spmd-partitioning`) and in the final optimized HLO.",
        "",
        "| case | precision | after SPMD partitioning | optimized HLO | flag |",
        "|---|---|---|---|---|",
    ]
    for d in dtypes:
        flag = _flag(d)
        fmt = lambda t: ", ".join(f"{k} {_mib(v)}" for k, v in t.items()) or "(no dump)"  # noqa: E731
        lines.append(f"| {d['label']} | {d['policy']} | {fmt(d['partitioned'])} | "
                     f"{fmt(d['optimized'])} | {flag} |")
    lines += ["", *_dtype_notes(dtypes), ""]
    return "\n".join(lines)


def summary(result: dict[str, Any], dtypes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in result["cases"][:MEMORY_CASES]:
        ratio = c["state_bytes"] / c["formula_bytes"]
        rows.append(goal_row("1 memory", f"{c['label']}: state bytes / (p+m+v)Ψ/S", ratio,
                             "≤ 1.05", ratio <= GOAL))
    for c in filter(_in_comm_table, result["cases"]):
        _, ratio, _ = _comm_row(c)
        rows.append(goal_row("2 communication", f"{c['label']}: max(buffer, wire) / theory",
                             ratio, "≤ 1.05", ratio <= GOAL))
    tp = result["tp_forward"]
    ratio = tp["all_reduce_bytes"] / tp["theory_bytes"]
    rows.append(goal_row("2 communication", "tp forward: all-reduce / 2L·b·s·h", ratio, "≤ 1.05",
                         ratio <= GOAL))
    for r in result["tp_mlp"]:
        ratio = sum(v["bytes"] for v in r["collectives"].values()) / sum(r["theory"].values())
        rows.append(goal_row("2 communication", f"tp_mlp {r['mode']}: bytes / theory", ratio,
                             "≤ 1.05", ratio <= GOAL))
    for d in dtypes:
        wide = _flag(d)
        rows.append(goal_row("2 communication", f"{d['label']}: collectives wider than params",
                             float("nan"), "none", wide == "ok"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here (default: stdout)")
    parser.add_argument("--dtypes", action="store_true",
                        help="only the collective-dtype check (needs the XLA dump flags)")
    args = parser.parse_args()
    if args.dtypes:
        match = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
        if not match:
            raise SystemExit("--dtypes needs XLA_FLAGS='--xla_dump_to=DIR "
                             "--xla_dump_hlo_pass_re=spmd-partitioning'")
        emit({"dtypes": dtype_check(Path(match.group(1)))}, args.json)
        return
    result = {
        "cases": [compile_case(*case) for case in CASES],
        "tp_forward": tp_forward(),
        "tp_mlp": tp_mlp_forward(),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
