"""Compile time of the llama train step at 2 and 32 layers, with and without scan-over-layers.

    python benchmarks/compile_depth.py [--json out.json]
"""

from __future__ import annotations

import argparse
import time
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
    llama_config,
    llama_step,
    models,
)

from shardax import layout

DEPTHS = (2, 32)
GOAL = 1.5  # scanned: 32 layers may cost at most 1.5x the 2-layer compile
REPEATS = 2  # fresh builds per cell; the one with least CPU time is kept (interference only adds)


def measure(n_layers: int, scan: bool) -> dict[str, Any]:
    """Seconds to trace + lower and to compile one fresh train step (nothing is cached)."""
    policy, tx = Policy(), adamw()
    config = llama_config("llama-tiny", policy, n_layers=n_layers)
    graphdef, state = abstract_train_state(config, tx)
    mesh = MeshShardingHelper.from_string("fsdp=-1")
    step = llama_step(mesh, LogicalAxisRules(layout.PRESETS["fsdp"]), graphdef, tx, policy,
                      layout=layout.Layout(scan_layers=scan))
    start, cpu = time.perf_counter(), time.process_time()
    lowered = step.lower(state, batch_shape(8, 64))
    lower, lower_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    lowered.compile()
    compile_s, compile_cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"layers": n_layers, "scan": scan, "lower_s": lower, "compile_s": compile_s,
            "cpu_s": lower_cpu + compile_cpu, "params": models.param_count(config)}


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    by = {(r["layers"], r["scan"]): r for r in rows}
    lines = [
        "## 4. Compile time vs depth",
        "",
        "llama-tiny shapes (dim 64, 4 heads) at 2 and 32 layers, train step with adamw, `fsdp` "
        "preset on 8 devices, batch 8x64; per cell the best (least CPU time) of "
        f"{REPEATS} fresh builds, the cells run back to back in one process. *lower* = trace + "
        "lower to StableHLO (includes sjit's "
        "rule resolution), *compile* = XLA, both wall-clock; *CPU s* = process CPU time of "
        "both (all threads), which other jobs on a shared machine disturb less, so the ratios "
        "use it. Goal: with `scan_layers=True` the 32-layer build costs at most "
        f"{GOAL}x the 2-layer one.",
        "",
        "| layers | scan_layers | parameters | lower s | compile s | CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['scan']} | {r['params']:,} | {r['lower_s']:.2f} | "
                     f"{r['compile_s']:.2f} | {r['cpu_s']:.2f} |")
    lo, hi = DEPTHS
    total = {k: v["cpu_s"] for k, v in by.items()}
    scan_ratio = total[(hi, True)] / total[(lo, True)]
    flat_ratio = total[(hi, False)] / total[(lo, False)]
    lines += [
        "",
        f"32 / 2 layers: scanned {scan_ratio:.2f}x (goal ≤ {GOAL}: "
        f"{'met' if scan_ratio <= GOAL else '**missed**'}), unrolled {flat_ratio:.2f}x. At 32 "
        f"layers scanning compiles {total[(hi, False)] / total[(hi, True)]:.1f}x faster than "
        "unrolling.",
        "",
    ]
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(r["layers"], r["scan"]): r["cpu_s"] for r in result["rows"]}
    lo, hi = DEPTHS
    ratio = by[(hi, True)] / by[(lo, True)]
    return [goal_row("4 compile time", f"scanned {hi} / {lo} layers (CPU s)", ratio,
                     f"≤ {GOAL}", ratio <= GOAL)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here (default: stdout)")
    args = parser.parse_args()
    measure(2, True)  # warm JAX's one-time start-up costs so the first cell is not penalized
    rows = [min((measure(n, scan) for _ in range(REPEATS)), key=lambda r: r["cpu_s"])
            for n in DEPTHS for scan in (False, True)]
    emit({"rows": rows}, args.json)


if __name__ == "__main__":
    main()
