"""FSDP modes against ZeRO-3: per-device peak memory, bytes moved and step time.

Peak = argument + temp bytes of the compiled train step (``memory_analysis()``); bytes moved
from the optimized HLO (``ShardingPlan.collectives``). Rows: ``dp``, XLA FSDP (the partitioner,
from the shardings) and explicit FSDP (``shardax.parallel.fsdp``), same model, same batch.
Step time: explicit over XLA FSDP, paired per round.

    python benchmarks/fsdp.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from functools import partial
from typing import Any

from _common import (
    LogicalAxisRules,
    MeshShardingHelper,
    Policy,
    abstract_train_state,
    adamw,
    batch_shape,
    emit,
    goal_row,
    interleaved,
    jax,
    llama_config,
    median,
    models,
    real_batch,
    real_train_state,
)

from shardax import layout
from shardax.layout import Layout
from shardax.train.step import train_step

MODEL = "llama-small"
BATCH, SEQ = 16, 128
N = 8
PEAK_GOAL, BYTES_GOAL = 1.15, 1.05
FP32 = Policy()
SCAN = True  # every layout here scans the layers (Layout.scan_layers)

# (label, preset, mesh, fsdp_mode, config overrides, grad_accum)
CASES = [
    ("dp", "dp", "dp=8", "xla", {}, 1),
    ("fsdp xla", "fsdp", "fsdp=8", "xla", {}, 1),
    ("fsdp explicit", "fsdp", "fsdp=8", "explicit", {}, 1),
    ("fsdp explicit, untied embeddings", "fsdp", "fsdp=8", "explicit",
     {"tie_embeddings": False}, 1),
    ("fsdp explicit, grad_accum=2", "fsdp", "fsdp=8", "explicit", {}, 2),
    ("fsdp_tp explicit", "fsdp_tp", "fsdp=4,tp=2", "explicit", {}, 1),
    # Explicit FSDP composed with the other axes (the formula and the bytes theory add each
    # axis' own memory and traffic: `formula`, `theory`).
    ("fsdp x cp explicit", "fsdp", "fsdp=4,cp=2", "explicit", {}, 1),
    ("fsdp x pp explicit", "fsdp", "fsdp=4,pp=2", "explicit", {}, 1),
    ("fsdp x ep explicit (MoE, 4 experts)", "fsdp", "fsdp=4,ep=2", "explicit",
     {"n_experts": 4, "top_k": 2}, 1),
]
COMPOSED = ("pp", "cp", "ep")
MICROBATCHES = 2  # the pipeline's microbatches on a 'pp' mesh
DEPTHS = (2, 8, 32)
ROUNDS = 3  # a llama-small step takes ~10-20 s on 2 shared cores


def _step(mesh, rules, graphdef, tx, mode, grad_accum):
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    micro = MICROBATCHES if mesh.shape.get("pp", 1) > 1 else 1
    return mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=tx, policy=FP32, grad_accum=grad_accum,
                param_rules=rules,
                layout=Layout(fsdp_mode=mode, pp_microbatches=micro, scan_layers=SCAN)),
        in_shardings=(rules, batch_spec), out_shardings=(rules, None))


def _setup(preset, mesh_text, overrides):
    config = llama_config(MODEL, FP32, **overrides)
    mesh = MeshShardingHelper.from_string(mesh_text)
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS[preset], mesh.shape, heads=config.n_heads, kv_heads=config.n_kv_heads))
    return config, mesh, rules


def formula(config: Any, preset: str, batch: int = BATCH, seq: int = SEQ,
            mesh_shape: dict[str, int] | None = None) -> dict[str, float]:
    """ZeRO-3 peak per device, float32: state/N + the two largest gathered tensors' layers
    (plus the gradient of the one being reduced) + activations, all in bytes. With a 'pp',
    'cp' or 'ep' axis in ``mesh_shape``: `_composed_formula`."""
    c = config
    if any((mesh_shape or {}).get(a, 1) > 1 for a in COMPOSED):
        return _composed_formula(c, batch, seq, mesh_shape)
    psi = models.param_count(c)
    layer = models.param_count(dataclasses.replace(c, n_layers=1)) - models.param_count(
        dataclasses.replace(c, n_layers=0))
    embed = c.vocab_size * c.dim
    split = 1 if preset == "dp" else N
    b = batch // N
    state = 3 * 4 * psi / split  # params + Adam mu + nu, float32
    # Gathered: the embedding table (the largest "layer"; tied, it serves the lookup and the
    # head, so it stays gathered for the step) and one decoder layer, each with its gradient
    # before the reduce-scatter.
    largest = sorted([embed, layer] + ([] if c.tie_embeddings else [embed]))[-2:]
    gathered = 0.0 if preset == "dp" else 2 * 4 * sum(largest)
    # Activations: every layer's input is kept (b*s*d), one layer is live with its
    # internals (q/k/v/o and norms ~6 b*s*d, SwiGLU 3 b*s*mlp, scores+probs 2 b*h*s*s), and
    # the float32 logits with their gradient (2 b*s*V) plus the tokens.
    act = 4 * (c.n_layers * b * seq * c.dim + 6 * b * seq * c.dim + 3 * b * seq * c.mlp_dim
               + 2 * b * c.n_heads * seq * seq + 2 * b * seq * c.vocab_size)
    if preset == "dp":
        gathered = 4 * psi  # the full gradient
    return {"state": state, "gathered": gathered, "activations": act,
            "total": state + gathered + act, "psi": psi, "layer": layer, "embed": embed}


def _layer_sizes(c: Any) -> tuple[int, int]:
    """(parameters of one decoder layer, of which expert weights)."""
    layer = models.param_count(dataclasses.replace(c, n_layers=1)) - models.param_count(
        dataclasses.replace(c, n_layers=0))
    return layer, 3 * c.dim * c.mlp_dim * c.n_experts


def _capacity(c: Any, seq: int) -> int:
    """Expert slots per routing group (one row of ``seq`` tokens; `llama_moe.MoE`)."""
    return math.ceil(c.capacity_factor * seq * c.top_k / c.n_experts)


def _composed_formula(c: Any, batch: int, seq: int, shape: dict[str, int]) -> dict[str, float]:
    """ZeRO-3 over 'fsdp' with another axis, float32, per device: every parameter's state
    split over 'fsdp', the stacked layers over 'pp' too and the experts over 'ep' too; one
    gathered layer holds its experts' 1/ep; the rows split over dp x fsdp x ep and the
    sequence over 'cp'; each axis' own buffers added: ring attention's K/V blocks in flight
    (with dK/dV in the backward), the pipeline's per-step layer inputs and its microbatched
    input copy, the MoE's dispatch/combine masks and expert buffers (replacing the SwiGLU)."""
    fsdp, tp, pp, cp, ep, dp = (shape.get(a, 1) for a in ("fsdp", "tp", "pp", "cp", "ep", "dp"))
    psi = models.param_count(c)
    layer, experts = _layer_sizes(c)
    embed = c.vocab_size * c.dim
    stored = psi - c.n_layers * layer + c.n_layers * ((layer - experts) / pp
                                                       + experts / (pp * ep))
    state = 3 * 4 * stored / (fsdp * tp)
    one = layer - experts + experts / ep
    # On a 'pp' mesh the stage's L/pp layers are gathered once and kept for the step.
    block = c.n_layers / pp * one if pp > 1 else one
    largest = sorted([embed, block] + ([] if c.tie_embeddings else [embed]))[-2:]
    gathered = 2 * 4 * sum(largest)
    b, s = batch / (dp * fsdp * ep), seq / cp
    hd = c.dim // c.n_heads
    if c.n_experts:
        slots = b * c.n_experts * _capacity(c, s)
        mlp = 3 * slots * c.mlp_dim + 4 * slots * c.dim + 2 * b * s * c.n_experts * _capacity(c, s)
    else:
        mlp = 3 * b * s * c.mlp_dim
    m = MICROBATCHES if pp > 1 else 1
    saved = c.n_layers / pp * b * s * c.dim * (m + pp - 1) / m  # a layer input per step
    act = 4 * (saved + 6 * b * s * c.dim + mlp + 2 * b * c.n_heads * s * s
               + 2 * b * s * c.vocab_size)
    if cp > 1:
        act += 4 * 8 * b * s * c.n_kv_heads * hd
    if pp > 1:
        act += 4 * 2 * b * s * (c.dim + hd)  # the microbatched input copy and the state
    return {"state": state, "gathered": gathered, "activations": act,
            "total": state + gathered + act, "psi": psi, "layer": layer, "embed": embed}


def theory(config: Any, mesh_shape: dict[str, int], grad_accum: int = 1, batch: int = BATCH,
           seq: int = SEQ) -> tuple[dict[str, float], str]:
    """Bytes per step ZeRO-3 moves per device (all-gather 2Ψ·p + reduce-scatter Ψ·p per
    microbatch, Ψ what one device gathers) plus the other axis' own traffic, and that term
    in words."""
    c, shape = config, mesh_shape
    fsdp, pp, cp, ep, dp = (shape.get(a, 1) for a in ("fsdp", "pp", "cp", "ep", "dp"))
    psi = models.param_count(c)
    layer, experts = _layer_sizes(c)
    rest = psi - c.n_layers * layer
    one = layer - experts + experts / ep
    m = MICROBATCHES if pp > 1 else 1
    moved = 4 * grad_accum * (rest + c.n_layers / pp * one)  # Ψ: the stage's share
    out = {"all-gather": 2 * moved, "reduce-scatter": moved}
    b, s = batch / (dp * fsdp * ep), seq / cp
    hd = c.dim // c.n_heads
    note = "FSDP only"
    if cp > 1:
        kv = 4 * b * s * c.n_kv_heads * hd
        ids = 4 * b * s  # the positions and segment ids travel with K/V
        ring = c.n_layers * ((cp - 1) * (2 * kv + 2 * ids)
                             + (cp - 1) * (4 * kv + 2 * ids) + 2 * kv)
        out["collective-permute"] = ring
        out["all-reduce"] = 4 * psi / fsdp  # the shards' gradients summed over 'cp'
        note = (f"+ ring attention's K/V hops ({_mib(ring)}) and the gradient shards' "
                f"all-reduce over 'cp' (Ψ/fsdp·4 = {_mib(4 * psi / fsdp)})")
    if ep > 1:
        a2a = c.n_layers * 4 * 4 * b * c.n_experts * _capacity(c, s) * c.dim
        dense = 4 * (psi - c.n_layers * experts) / fsdp
        out["all-to-all"] = a2a
        out["all-reduce"] = dense
        note = (f"+ the MoE's all-to-alls, 2 forward + 2 backward per layer ({_mib(a2a)}), and "
                f"the non-expert gradient shards' all-reduce over 'ep' ({_mib(dense)})")
    if pp > 1:
        hops = 2 * (m + pp - 1) * 4 * (b / m) * s * (c.dim + hd)
        out["collective-permute"] = hops
        note = (f"Ψ = the stage's {c.n_layers // pp} layers + the rest, gathered once per step "
                f"and kept through the pipeline (each moves in a ring of collective-permutes "
                f"over 'fsdp'), + the stage-to-stage sends ({_mib(hops)})")
    return out, note


_STEPS: dict[str, Any] = {}  # label -> (step, mesh, rules, config): reused for timing


def compile_case(label, preset, mesh_text, mode, overrides, grad_accum) -> dict[str, Any]:
    config, mesh, rules = _setup(preset, mesh_text, overrides)
    tx = adamw()
    graphdef, state = abstract_train_state(config, tx)
    step = _step(mesh, rules, graphdef, tx, mode, grad_accum)
    _STEPS[label] = (step, mesh, rules, config, tx)
    plan = step.plan(state, batch_shape(BATCH, SEQ))
    arg = plan.memory.get("argument_size_in_bytes", 0)
    temp = plan.memory.get("temp_size_in_bytes", 0)
    return {
        "label": label, "preset": preset, "mesh": mesh_text, "mode": mode,
        "n_layers": config.n_layers, "tied": config.tie_embeddings, "grad_accum": grad_accum,
        "argument": arg, "temp": temp, "peak": arg + temp,
        "formula": formula(config, preset, mesh_shape=mesh.shape),
        **({"theory": theory(config, mesh.shape, grad_accum)}
           if any(mesh.shape.get(a, 1) > 1 for a in COMPOSED) else {}),
        "collectives": {k: {"count": v.count, "bytes": v.bytes}
                        for k, v in plan.collectives.items() if v.count},
    }


def depth_sweep(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peaks at 2, 8 and 32 layers (llama-small has 8: those rows are the main cases')."""
    rows = []
    for n_layers in DEPTHS:
        for mode in ("xla", "explicit"):
            main = next((c for c in cases if c["label"] == f"fsdp {mode}"), None)
            if main is not None and main["n_layers"] == n_layers:
                rows.append(main)
                continue
            rows.append(compile_case(f"{mode}, {n_layers} layers", "fsdp", "fsdp=8", mode,
                                     {"n_layers": n_layers}, 1))
    return rows


def step_times() -> dict[str, Any]:
    """The two fsdp=8 steps planned above (same compiled programs), on real arrays."""
    _, mesh, rules, config, tx = _STEPS["fsdp xla"]
    _, shape = abstract_train_state(config, tx)
    shardings = mesh.match_sharding_rule(rules, shape)
    _, state = real_train_state(config, tx, shardings)
    spec = rules.spec_for(("batch", "length"), mesh.mesh)
    batch = jax.device_put(real_batch(BATCH, SEQ, config.vocab_size),
                           jax.sharding.NamedSharding(mesh.mesh, spec))
    fns = {mode: partial(_STEPS[f"fsdp {mode}"][0], state, batch)
           for mode in ("xla", "explicit")}
    samples = interleaved(fns, rounds=ROUNDS, warmup=1)
    paired = median([e / x for e, x in zip(samples["explicit"], samples["xla"])])
    return {"step_s": {k: median(v) for k, v in samples.items()}, "paired_ratio": paired,
            "samples": samples, "rounds": ROUNDS}


# ----------------------------------------------------------------------------- rendering

def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _wire(kind: str, nbytes: float, n: int) -> float:
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
              "reduce-scatter": (n - 1) / n}.get(kind, 1.0)
    return nbytes * factor


def peak_ratio(c: dict[str, Any]) -> float:
    return c["peak"] / c["formula"]["total"]


def bytes_ratios(c: dict[str, Any]) -> tuple[float, float]:
    """(buffer, wire) bytes over ZeRO-3's all-gather 2Ψ·p + reduce-scatter Ψ·p, per
    microbatch (each microbatch gathers the layers and reduce-scatters its gradient)."""
    coll = {k: v["bytes"] for k, v in c["collectives"].items()}
    grads = c["formula"]["psi"] * 4 * c.get("grad_accum", 1)
    want = ({"all-gather": 2 * grads, "reduce-scatter": grads} if "theory" not in c
            else c["theory"][0])
    buffer = sum(coll.values()) / sum(want.values())
    wire = (sum(_wire(k, v, N) for k, v in coll.items())
            / sum(_wire(k, v, N) for k, v in want.items()))
    return buffer, wire


def render(result: dict[str, Any]) -> str:
    cases, sweep, steps = result["cases"], result["depth"], result["step"]
    f0 = cases[0]["formula"]
    lines = [
        "## 7. FSDP: explicit ZeRO-3 against XLA's",
        "",
        f"`benchmarks/fsdp.py`: {MODEL} (scan_layers), batch {BATCH} x {SEQ}, AdamW, float32, "
        f"{N} CPU devices. Peak = argument + temp bytes of the compiled step "
        "(`memory_analysis()`). Formula (ZeRO-3): state/N (params + Adam mu, nu: 12Ψ/N) + the "
        "two largest gathered parameter blocks with their gradients before the reduce-scatter "
        "(the tied embedding table, gathered once and used by the lookup and the head, and one "
        "decoder layer: 2·4·(V·d + Ψ_layer)) + activations, stated as 4 bytes x (L·b·s·d saved "
        "layer inputs + one live layer 6·b·s·d + 3·b·s·mlp + 2·b·h·s² + float32 logits and "
        f"their gradient 2·b·s·V), b = B/N = {BATCH // N}: "
        f"{_mib(f0['activations'])} here. The dp row's formula is the full state + full "
        "gradient + the same activations. Goal: peak ≤ "
        f"{PEAK_GOAL}x formula for the FSDP rows. The composed rows (fsdp x cp/pp/ep) "
        "state each axis' own memory in their formula: the state split over 'fsdp' (4 "
        "devices), the stacked layers over 'pp' and the experts over 'ep' too; one gathered "
        "layer holds 1/ep of its experts; b = the rows per device (B over dp x fsdp x ep), the "
        "sequence over 'cp'; cp adds ring attention's K/V blocks in flight with dK/dV "
        "(8·b·s·kv_heads·head_dim); pp the layer inputs of every pipeline step "
        "(L/pp·b·s·d·(M+P-1)/M) and the microbatched input copy, and its stage's L/pp layers "
        "gathered once for the step in place of one layer; ep the MoE's dispatch and "
        "combine masks and expert buffers (capacity slots) in place of the SwiGLU.",
        "",
        "| case | mesh | fsdp mode | argument | temp | peak | formula | peak / formula | "
        "goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        r = peak_ratio(c)
        goal = "—" if c["preset"] == "dp" else ("yes" if r <= PEAK_GOAL else "**no**")
        lines.append(f"| {c['label']} | {c['mesh']} | {c['mode']} | {_mib(c['argument'])} | "
                     f"{_mib(c['temp'])} | {_mib(c['peak'])} | {_mib(c['formula']['total'])} "
                     f"| {r:.3f} | {goal} |")
    lines += [
        "",
        "Peak memory against depth (fsdp=8; the formula's parameter term is flat, its "
        "activation term grows by b·s·d·4 bytes per layer):",
        "",
        "| layers | XLA peak | explicit peak | explicit formula | explicit / formula | "
        "explicit peak - state/N |",
        "|---|---|---|---|---|---|",
    ]
    for n_layers in DEPTHS:
        x = next(c for c in sweep if c["n_layers"] == n_layers and c["mode"] == "xla")
        e = next(c for c in sweep if c["n_layers"] == n_layers and c["mode"] == "explicit")
        lines.append(f"| {n_layers} | {_mib(x['peak'])} | {_mib(e['peak'])} | "
                     f"{_mib(e['formula']['total'])} | {peak_ratio(e):.3f} | "
                     f"{_mib(e['peak'] - e['formula']['state'])} |")
    lines += [
        "",
        "Bytes moved per step (optimized HLO, full buffer per device; wire = (N-1)/N for "
        "all-gather / reduce-scatter, 2(N-1)/N for all-reduce; a collective-permute is one "
        "hop of a ring, counted as moved). Theory: all-gather 2Ψ·p + reduce-scatter Ψ·p per "
        "microbatch (grad_accum=2: twice, each microbatch's gradient is reduce-scattered into "
        "a sharded float32 accumulator). With tp the parameters move as 'fsdp' rings of "
        "their tp shards (collective-permute, Ψ/tp each) and tp adds its own activation "
        f"all-reduces (Megatron). Goal ≤ {BYTES_GOAL}.",
        "",
        "| case | collectives | theory (beyond ZeRO-3's 3Ψ·p) | buffer / theory | "
        "wire / theory | goal |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c["preset"] == "dp":
            continue
        b, w = bytes_ratios(c)
        coll = ", ".join(f"{k} {v['count']}x {_mib(v['bytes'])}"
                         for k, v in c["collectives"].items())
        ok = "yes" if max(b, w) <= BYTES_GOAL else "**no**"
        extra = c["theory"][1] if "theory" in c else "—"
        lines.append(f"| {c['label']} | {coll} | {extra} | {b:.3f} | {w:.3f} | {ok} |")
    lines += ["", *_misses(cases)]
    lines += [
        "",
        f"Step time (real arrays, {steps['rounds']} interleaved rounds): XLA FSDP "
        f"{steps['step_s']['xla'] * 1e3:.0f} ms, explicit {steps['step_s']['explicit'] * 1e3:.0f}"
        f" ms; explicit / XLA paired per round (median): {steps['paired_ratio']:.3f}. Explicit "
        "recomputes each layer's forward in the backward pass (that is what frees its gathered "
        "parameters), about a third more layer FLOPs.",
        "",
    ]
    return "\n".join(lines)


def _misses(cases: list[dict[str, Any]]) -> list[str]:
    """One explanation per missed goal, each with its control row."""
    notes = []
    for c in cases:
        coll = {k: v["bytes"] for k, v in c["collectives"].items()}
        grads = c["formula"]["psi"] * 4
        missed = max(bytes_ratios(c)) > BYTES_GOAL or peak_ratio(c) > PEAK_GOAL
        if c["preset"] == "dp" or not missed:
            continue
        if "theory" in c:
            notes.append(f"- {c['label']}: see its theory column; the FSDP part is the "
                         "`fsdp explicit` control row's over 4 devices.")
        elif c["mode"] == "xla":
            notes.append(
                f"- {c['label']}: the partitioner keeps the gathered parameters for the backward "
                "pass and forms full-size gradients, reduced by an all-reduce + slice (the CPU "
                "backend never emits reduce-scatter; a ring all-reduce sends twice). Control: "
                "`fsdp explicit`, same program written out, meets both goals.")
        elif c["grad_accum"] > 1:
            k = c["grad_accum"]
            theory = 2 * k * grads + grads
            notes.append(
                f"- {c['label']}: by design. One reduce-scatter per step means the {k} "
                "microbatches' gradients are summed unreduced: a full-size float32 gradient "
                f"buffer ({_mib(grads)}) plus the microbatch's own, which the ZeRO-3 formula "
                f"does not have; and each microbatch gathers the parameters again, so the "
                f"theory is all-gather 2·{k}·Ψ·p + reduce-scatter Ψ·p = {_mib(theory)}, "
                f"against which this row moves {sum(coll.values()) / theory:.3f}. Control: "
                "`fsdp explicit` (grad_accum=1).")
        elif "tp" in c["mesh"]:
            notes.append(
                f"- {c['label']}: the ratio counts every collective, and the theory only "
                f"FSDP's. Tensor parallelism (from the rules, left to XLA over 'tp') adds its "
                f"own activation collectives ({_mib(coll.get('all-reduce', 0))} of all-reduce "
                "and the all-gathers of activations); the FSDP part is the `fsdp explicit` "
                "control row's, halved per device by the 'tp' split of each parameter.")
    return ["Misses:", "", *notes] if notes else []


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in result["cases"]:
        if c["preset"] == "dp":
            continue
        r = peak_ratio(c)
        rows.append(goal_row("7 fsdp", f"{c['label']}: peak / ZeRO-3 formula", r,
                             f"≤ {PEAK_GOAL}", r <= PEAK_GOAL))
        b, w = bytes_ratios(c)
        rows.append(goal_row("7 fsdp", f"{c['label']}: max(buffer, wire) bytes / 3Ψ·p",
                             max(b, w), f"≤ {BYTES_GOAL}", max(b, w) <= BYTES_GOAL))
    rows.append(goal_row("7 fsdp", "step time explicit / XLA FSDP (paired)",
                         result["step"]["paired_ratio"], "reported", True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here (default: stdout)")
    args = parser.parse_args()
    assert jax.device_count() == N, f"expected {N} devices, got {jax.device_count()}"
    cases = [compile_case(*case) for case in CASES]
    result = {"cases": cases, "depth": depth_sweep(cases), "step": step_times()}
    emit(result, args.json)


if __name__ == "__main__":
    main()
