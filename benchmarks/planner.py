"""The planner against measurement: `shardax plan --search`'s ranking vs measured step times.

    python benchmarks/planner.py [--json out.json]           # llama-small on 8 CPU devices
    python benchmarks/planner.py --8b [--json out.json]       # llama-8b shapes, 64 and 256 devices

Default part: on the 8 emulated CPU devices, the search ranks llama-small layouts by its roofline
estimate, with the "device" numbers measured on this machine first (FLOP/s of a sharded matmul
and bytes/s of an all-gather, per emulated device); then the top 5 and the default
configuration (`shardax train`'s mesh and rules) are each built for real and timed. Reported:
Spearman's rank correlation of estimate vs measurement, and whether the first choice is within
10% of the measured best.

``--8b``: `shardax plan --search` as users run it (a subprocess with `--devices N`), llama-8b
shapes, 80 GiB H100s, at 64 and 256 devices: wall time (goal: < 10 minutes each on 2 cores) and
whether every proposed layout fits. Too slow for `make bench`; run by hand (or `run.py --only
planner_8b`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import ROOT, emit, goal_row, jax, jnp, median, np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardax._compat import make_mesh
from shardax.devices import DeviceSpec
from shardax.plan import plan_config, search
from shardax.plan.estimate import seconds, train_command
from shardax.train.build import abstract, create, step_function
from shardax.train.config import TrainConfig
from shardax.train.resolve import resolve

BASE = TrainConfig(model="llama-small", batch_size=16, seq_len=128)
MAX_COMPILES = 10
TOP = 5
TIMED_STEPS = 4
GiB = 2**30


def _best_time(fn, repeats: int = 5) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def measure_device() -> DeviceSpec:
    """This machine as 8 emulated devices: per-device FLOP/s of a sharded f32 matmul, and the
    bytes per second one device receives in an all-gather."""
    mesh = make_mesh(np.array(jax.devices()[:8]), ("d",))
    n = 512
    a = jax.device_put(jnp.ones((8 * n, n), jnp.float32), NamedSharding(mesh, P("d")))
    b = jax.device_put(jnp.ones((n, n), jnp.float32), NamedSharding(mesh, P()))
    matmul = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("d")))
    flops_s = 8 * 2 * n**3 / _best_time(lambda: matmul(a, b))
    big = jax.device_put(jnp.ones((8 * 1024, 1024), jnp.float32), NamedSharding(mesh, P("d")))
    gather = jax.jit(lambda x: x * 1, out_shardings=NamedSharding(mesh, P()))
    link = big.nbytes / _best_time(lambda: gather(big))
    # Measured numbers: achieved already (fractions 1), one "host", nothing reserved.
    return DeviceSpec("CPU (8 emulated, measured)", flops_s / 8, 64 * GiB, link, link, 8,
                      flops_fraction=1.0, link_fraction=1.0, reserved_bytes=0.0)


def measure_step(config: TrainConfig) -> float:
    """Median seconds of ``TIMED_STEPS`` real train steps (after a compile + warm-up step)."""
    run = resolve(config)
    graphdef, _ = abstract(run.model_config, run.tx, config.seed, run.mesh)
    state = run.mesh.sjit(lambda: create(run.model_config, run.tx, config.seed)[1],
                          out_shardings=run.rules)()
    step = step_function(run, graphdef, end_id=0)  # any id: the program the planner compiled
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (config.batch_size, config.seq_len + 1), 0, 32000)
    batch = (tokens[:, :-1], tokens[:, 1:])
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return median(times)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among float timings)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def small() -> dict[str, Any]:
    device = measure_device()
    start = time.perf_counter()
    result = search(BASE, device, device.hbm_bytes, max_compiles=MAX_COMPILES, budget_s=900,
                    jobs=1, cache=None)
    search_s = time.perf_counter() - start
    chosen = result.ranked[:TOP]
    default_fields = {k: getattr(BASE, k) for k in chosen[0].config} if chosen else {}
    rows = []
    for rank, est in enumerate(chosen, 1):
        rows.append({"rank": rank, "config": est.config, "command": train_command(est.config),
                     "estimate_s": est.step_s, "compute_s": est.compute_s,
                     "comm_s": est.comm_s, "peak_gib": est.compiled.peak_bytes / GiB})
    if default_fields not in [r["config"] for r in rows]:
        est = plan_config(BASE, device, device.hbm_bytes)
        rows.append({"rank": "default", "config": est.config,
                     "command": train_command(est.config), "estimate_s": est.step_s,
                     "compute_s": est.compute_s, "comm_s": est.comm_s,
                     "peak_gib": est.compiled.peak_bytes / GiB})
    for row in rows:
        row["measured_s"] = measure_step(dataclasses.replace(BASE, **row["config"]))
    est_s = [r["estimate_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    best = min(meas)
    return {"device": dataclasses.asdict(device), "search": {
                k: v for k, v in result.to_dict().items() if k != "ranked"},
            "search_s": search_s, "rows": rows, "spearman": spearman(est_s, meas),
            "first_over_best": rows[0]["measured_s"] / best}


def big(devices: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "search.json")
        cmd = [sys.executable, "-m", "shardax.cli", "plan", "--model", "llama-8b",
               "--batch-size", "256", "--seq-len", "4096",
               "--precision", "params=float32,compute=bfloat16", "--devices", str(devices),
               "--target", "h100", "--hbm", "80GiB", "--search", "--top", "5",
               "--max-compiles", "10", "--time-budget", "480", "--jobs", "2",
               "--cache", "none", "--json", out]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        env.pop("XLA_FLAGS", None)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - start
        if proc.returncode:
            return {"devices": devices, "error": proc.stderr[-2000:], "wall_s": wall}
        data = json.loads(open(out).read())
    ranked = data.pop("ranked")
    return {"devices": devices, "wall_s": wall, "search": data,
            "top": [{"command": r["command"], "step_s": r["step_s"],
                     "peak_gib": r["peak_bytes"] / GiB, "fits": r["fits"]} for r in ranked]}


def render(result: dict[str, Any]) -> str:
    lines = ["## 10. Planner: estimated vs measured", ""]
    if "small" in result:
        s = result["small"]
        d = s["device"]
        lines += [
            f"`shardax plan --search` for llama-small (batch {BASE.batch_size} x "
            f"{BASE.seq_len}, adamw, float32) on the 8 emulated CPU devices, with this "
            f"machine's numbers measured first: {d['peak_flops'] / 1e9:.1f} GFLOP/s and "
            f"{d['link_bytes_per_s'] / 1e9:.2f} GB/s per emulated device. The search compiled "
            f"{s['search']['compiled']} of {s['search']['enumerated']} layouts in "
            f"{s['search_s']:.0f} s; the top {TOP} and the default configuration were then "
            f"trained for real (median of {TIMED_STEPS} steps after a warm-up step).",
            "",
            "| rank | command | estimate | measured | peak per device |",
            "|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            lines.append(f"| {r['rank']} | `{r['command']}` | {seconds(r['estimate_s'])} | "
                         f"{seconds(r['measured_s'])} | {r['peak_gib'] * 1024:.0f} MiB |")
        lines += ["", f"Spearman correlation of estimate and measurement: "
                      f"**{s['spearman']:.2f}**; the first choice's measured time is "
                      f"{s['first_over_best']:.2f}x the measured best "
                      f"({'within' if s['first_over_best'] <= 1.10 else 'not within'} 10%).",
                  "",
                  "Where the estimate misses: pipelines on emulated devices. Each of the M + P - 1 "
                  "pipeline iterations ends in a collective-permute for which all 8 emulated "
                  "devices (threads sharing the cores) must meet, a per-iteration cost the "
                  "roofline (FLOPs / peak + bytes / bandwidth) does not model; on GPUs it is a "
                  "point-to-point send. Single measurements on a shared 2-core machine also "
                  "carry ~20% noise, enough to swap near-ties.",
                  ""]
    for b in result.get("big", []):
        if "error" in b:
            lines += [f"llama-8b on {b['devices']} devices: failed: {b['error'][-300:]}", ""]
            continue
        sr = b["search"]
        lines += [
            f"llama-8b shapes (batch 256 x 4096, fp32 params, bf16 compute, adamw) on "
            f"{b['devices']} emulated devices, target H100 80 GiB: {b['wall_s']:.0f} s wall "
            f"on this machine; {sr['enumerated']} layouts, {sr['pruned_memory']} pruned by "
            f"formula, {sr['compiled']} compiled, {sr['over_hbm']} over 80 GiB once compiled, "
            f"{len(sr['failed'])} refused, {sr['skipped_budget']} left out of the budget.",
            "",
            "| rank | command | estimated step | peak per device | fits |",
            "|---|---|---|---|---|",
        ]
        for i, t in enumerate(b["top"], 1):
            lines.append(f"| {i} | `{t['command']}` | {seconds(t['step_s'])} | "
                         f"{t['peak_gib']:.1f} GiB | {t['fits']} |")
        lines.append("")
        if sr["failed"]:
            lines += ["Refused (the compiler crashed in a worker process; the search went on): "
                      + "; ".join(f"`{f}`" for f in sr["failed"]), ""]
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    if "small" in result:
        s = result["small"]
        rows.append(goal_row("10 planner", "first choice measured / measured best",
                             s["first_over_best"], "≤ 1.10", s["first_over_best"] <= 1.10))
        rows.append(goal_row("10 planner", "Spearman(estimate, measured)", s["spearman"],
                             "> 0", s["spearman"] > 0))
    for b in result.get("big", []):
        ok = "error" not in b and b["wall_s"] <= 600 and b["top"] and all(
            t["fits"] for t in b["top"])
        rows.append(goal_row("10 planner", f"llama-8b search on {b['devices']} devices (s)",
                             b.get("wall_s", float("nan")), "≤ 600, all fit", bool(ok)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--8b", dest="big", action="store_true",
                        help="llama-8b shapes on 64 and 256 devices instead")
    parser.add_argument("--json", help="write the result here (default: stdout)")
    args = parser.parse_args()
    if args.big:
        emit({"big": [big(64), big(256)]}, args.json)
    else:
        emit({"small": small()}, args.json)


if __name__ == "__main__":
    main()
