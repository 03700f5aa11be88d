"""The planner against published training runs: predicted vs published tokens/s per device and
memory per device, one row per configuration, with the ratio.

    python benchmarks/published.py [--all] [--json out.json]

Each row is planned as a user would (`shardax plan` in a subprocess, `--devices N` emulated CPU
devices, the target's table numbers, no calibration). The default runs the 8-device rows; `--all`
adds the 256-device MaxText row (a llama-8b compile over 256 emulated devices: many minutes).

Published figures (quoted, with what each row assumes where the source is silent):

- torchtitan, Llama 3.1 8B on 8 x H100 (FSDP, local batch 2, sequence 8192, selective
  activation checkpointing, bf16 compute with fp32 parameters, AdamW): 5,762 tokens/s/GPU,
  82.4 GiB memory, 33-39% MFU (torchtitan's performance table). Its selective checkpointing
  (the "op" policy: most matmul outputs kept) is planned twice, as 'names:q,k,v,attn_out'
  (less kept) and as 'save_dots' (every matmul output kept), which bracket it.
- MaxText, Llama 3.1 8B on TPU v6e-256 (BF16, sequence 8192): 45.46% MFU, ~7,207
  tokens/s/device, memory not published (MaxText's "optimized models tiering" table). The
  per-device batch is not in the table: planned with 3 (an assumption), FSDP over all chips,
  full remat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, emit, goal_row

GiB = 2**30
ROWS: list[dict[str, Any]] = [
    {"source": "torchtitan Llama 3.1 8B, 8 x H100, FSDP, local batch 2, seq 8192, selective AC",
     "devices": 8, "target": "h100", "flags": [
         "--model", "llama-8b", "--mesh", "fsdp=8", "--batch-size", "16", "--seq-len", "8192",
         "--precision", "params=float32,compute=bfloat16", "--remat", "names:q,k,v,attn_out",
         "--scan-layers", "--optimizer", "adamw"],
     "tokens_per_s_per_device": 5762.0, "memory_gib": 82.4},
    {"source": "the same, selective AC planned as save_dots (every matmul output kept)",
     "devices": 8, "target": "h100", "flags": [
         "--model", "llama-8b", "--mesh", "fsdp=8", "--batch-size", "16", "--seq-len", "8192",
         "--precision", "params=float32,compute=bfloat16", "--remat", "save_dots",
         "--scan-layers", "--optimizer", "adamw"],
     "tokens_per_s_per_device": 5762.0, "memory_gib": 82.4},
    {"source": "MaxText Llama 3.1 8B, TPU v6e-256, seq 8192 (batch 3 per chip assumed)",
     "devices": 256, "target": "v6e", "flags": [
         "--model", "llama-8b", "--mesh", "fsdp=256", "--batch-size", "768", "--seq-len", "8192",
         "--precision", "bfloat16", "--remat", "full", "--scan-layers", "--optimizer", "adamw"],
     "tokens_per_s_per_device": 7207.0, "memory_gib": None, "slow": True},
]


def plan_row(row: dict[str, Any]) -> dict[str, Any]:
    """Plans one row in a subprocess; predicted tokens/s per device and peak memory."""
    out = Path(tempfile.mkdtemp(prefix="shardax-published-")) / "plan.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "shardax.cli", "plan", *row["flags"],
                           "--devices", str(row["devices"]), "--target", row["target"],
                           "--json", str(out)], env=env, capture_output=True, text=True)
    if proc.returncode:
        return {**row, "error": proc.stderr.strip().splitlines()[-1:]}
    plan = json.loads(out.read_text())
    batch = int(row["flags"][row["flags"].index("--batch-size") + 1])
    seq = int(row["flags"][row["flags"].index("--seq-len") + 1])
    tokens = batch * seq / row["devices"] / plan["step_s"]
    memory = plan["peak_bytes"] / GiB
    result = {**row, "predicted_tokens_per_s_per_device": tokens, "predicted_memory_gib": memory,
              "tokens_ratio": tokens / row["tokens_per_s_per_device"],
              "step_s": plan["step_s"], "compute_s": plan["compute_s"], "comm_s": plan["comm_s"],
              "compile_s": plan["compile_s"]}
    if row["memory_gib"]:
        result["memory_ratio"] = memory / row["memory_gib"]
    return result


def render(result: dict[str, Any]) -> str:
    """Section 12 of RESULTS.md: one table row per planned configuration."""
    lines = ["## 13. Planner: against published runs", "",
             "`shardax plan` (uncalibrated, the target's table defaults) on published "
             "configurations; goal: tokens/s within ±30%, memory within ±25%.", "",
             "| configuration | tokens/s/device: predicted / published (ratio) | memory GiB: "
             "predicted / published (ratio) |", "|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['source']} | plan failed: {r['error']} | |")
            continue
        memory = (f"{r['predicted_memory_gib']:.1f} / {r['memory_gib']} "
                  f"({r['memory_ratio']:.2f})" if r["memory_gib"] else
                  f"{r['predicted_memory_gib']:.1f} / not published")
        lines.append(f"| {r['source']} | {r['predicted_tokens_per_s_per_device']:,.0f} / "
                     f"{r['tokens_per_s_per_device']:,.0f} ({r['tokens_ratio']:.2f}) | "
                     f"{memory} |")
    return "\n".join(lines) + "\n"


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result["goals"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the 256-device row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results, goals = [], []
    for row in ROWS:
        if row.get("slow") and not args.all:
            continue
        result = plan_row(row)
        results.append(result)
        if "error" in result:
            print(f"{row['source']}: plan failed: {result['error']}")
            continue
        memory = (f"memory {result['predicted_memory_gib']:.1f} GiB vs published "
                  f"{row['memory_gib']} GiB (ratio {result['memory_ratio']:.2f})"
                  if row["memory_gib"] else
                  f"memory {result['predicted_memory_gib']:.1f} GiB (none published)")
        print(f"{row['source']}: predicted {result['predicted_tokens_per_s_per_device']:,.0f} "
              f"tokens/s/device vs published {row['tokens_per_s_per_device']:,.0f} (ratio "
              f"{result['tokens_ratio']:.2f}); {memory}")
        goals.append(goal_row("13 published", f"tokens/s/device, {row['source']}",
                              result["tokens_ratio"], "0.7-1.3",
                              0.7 <= result["tokens_ratio"] <= 1.3))
        if row["memory_gib"]:
            goals.append(goal_row("13 published", f"memory, {row['source']}",
                                  result["memory_ratio"], "0.75-1.25",
                                  0.75 <= result["memory_ratio"] <= 1.25))
    emit({"rows": results, "goals": goals}, args.json)


if __name__ == "__main__":
    main()
