"""Draws a timeline of a `shardax train --profile-steps` trace (its perfetto_trace.json.gz) as a
PNG: the step annotations, the XLA executor thread of each emulated device and the Eigen worker
threads, one row each, time on the x axis; collectives in red, other XLA ops in blue.

    python docs/images/render_trace.py runs/a/profile docs/images/profile_trace.png

This is a static picture of the same events Perfetto (https://ui.perfetto.dev) or XProf show
interactively; it is how docs/images/profile_trace.png was made.
"""

import gzip
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
HOUSEKEEPING = ("Wait", "Rendezvous", "ThreadpoolListener", "Handle", "end:", "Allocate",
                "CommonPjRt", "ThunkExecutor", "InvokeRendezvous")


def main(profile_dir: str, png: str) -> None:
    (trace,) = Path(profile_dir).rglob("perfetto_trace.json.gz")
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    steps = [e for e in events if e.get("name") == "train" and "step_num" in e.get("args", {})]
    t0 = min(e["ts"] for e in steps)
    t1 = max(e["ts"] + e["dur"] for e in steps)
    rows: dict[str, list] = {"train steps": []}
    for e in steps:
        rows["train steps"].append((e["ts"], e["dur"], f"step {e['args']['step_num']}", "green"))
    devices = sorted({n for n in names.values() if "PjRtCpuClient" in n})
    eigen = sorted({n for n in names.values() if "XLAEigen" in n})[:4]
    labels = {n: f"device thread {i}" for i, n in enumerate(devices)}
    labels.update({n: f"Eigen worker {i}" for i, n in enumerate(eigen)})
    for e in events:
        thread = names.get((e.get("pid"), e.get("tid")))
        if e.get("ph") != "X" or thread not in labels or not t0 <= e["ts"] <= t1:
            continue
        if e["name"].startswith(HOUSEKEEPING):
            continue
        color = "red" if e["name"].startswith(COLLECTIVES) else "tab:blue"
        rows.setdefault(labels[thread], []).append((e["ts"], e["dur"], "", color))
    order = ["train steps"] + [labels[n] for n in devices + eigen if labels[n] in rows]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(order) + 1.2))
    for y, row in enumerate(order):
        for ts, dur, text, color in rows[row]:
            ax.broken_barh([((ts - t0) / 1e3, max(dur / 1e3, 0.05))], (y - 0.4, 0.8),
                           color=color, alpha=0.85 if row == "train steps" else 1.0)
            if text:
                ax.text((ts - t0 + dur / 2) / 1e3, y, text, ha="center", va="center",
                        color="white", fontsize=9)
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms) from the start of the first traced step")
    ax.set_title(f"jax.profiler trace of {len(steps)} train steps (red: collectives, "
                 "blue: other XLA ops)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
