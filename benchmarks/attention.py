"""Attention: temporaries against sequence length, and step time of each implementation.

    python benchmarks/attention.py --json out.json

Memory: llama-small (8 layers, batch 1), forward + backward of ``training_loss`` (chunked
loss included), compiled on one CPU device; ``memory_analysis().temp_size_in_bytes`` at seq
1024 and 8192 for each attention implementation. Goal: the default ('auto') grows at most
10x for 8x the sequence (linear is 8x; the einsum's [s, s] scores grow 64x).
Time: the same forward + backward, llama-small shapes with 2 layers, at seq 1024 and 2048,
each implementation relative to 'einsum' (median of interleaved rounds).
Plans (``shardax plan`` in a subprocess, emulated devices, float32 parameters, bfloat16
compute): torchtitan's long-context Llama 3.1 8B run (FSDP over 8 devices, seq 32768, local
batch 1, full remat; goal: fits in 96 GiB per device), and llama-8b on 64 devices at seq 2048
(batch 64, no remat) with the einsum and with the default attention (goal: temporaries drop by
at least the score buffers the einsum keeps for the backward: one float32 [s, s] per head,
layer and local sequence).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import emit, goal_row, interleaved, jax, jnp, machine, median, models, nnx, np

from shardax.layout import Layout, forward

IMPLS = ("einsum", "xla", "blockwise", "auto")
MEMORY_SEQS = (1024, 8192)
TIME_SEQS = (1024, 2048)


def _loss_grad(cfg, seq, impl):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0))),
                                 nnx.Param)

    def loss(p, t):
        return forward.training_loss(nnx.merge(graphdef, p), Layout(attention=impl),
                                     t[:, :-1], t[:, 1:])[0]

    return jax.jit(jax.grad(loss)), params, jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)


def temp_bytes(impl: str, seq: int, n_layers: int = 8) -> int:
    cfg = models.get_config("llama-small", max_seq_len=seq, n_layers=n_layers)
    fn, params, tokens = _loss_grad(cfg, seq, impl)
    return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def step_times(seq: int, rounds: int) -> dict[str, float]:
    """Seconds per forward + backward of each implementation (2-layer llama-small)."""
    fns = {}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32000, (1, seq + 1)), jnp.int32)
    for impl in IMPLS:
        cfg = models.get_config("llama-small", max_seq_len=seq, n_layers=2)
        graphdef, params = nnx.split(models.create(cfg, nnx.Rngs(0)), nnx.Param)

        def loss(p, t, g=graphdef, i=impl):
            return forward.training_loss(nnx.merge(g, p), Layout(attention=i), t[:, :-1],
                                         t[:, 1:])[0]

        fn = jax.jit(jax.grad(loss))
        fns[impl] = functools.partial(fn, params, tokens)
    samples = interleaved(fns, rounds=rounds, warmup=1)
    return {impl: median(s) for impl, s in samples.items()}


PRECISION = "params=float32,compute=bfloat16"
PLANS = {
    # torchtitan's published long-context run: Llama 3.1 8B, FSDP over 8 H100, seq 32768,
    # local batch 1, full activation checkpointing.
    "torchtitan_32k": ["--model", "llama-8b", "--mesh", "fsdp=8", "--devices", "8",
                       "--batch-size", "8", "--seq-len", "32768", "--remat", "full"],
    "torchtitan_32k_scanned": ["--model", "llama-8b", "--mesh", "fsdp=8", "--devices", "8",
                               "--batch-size", "8", "--seq-len", "32768", "--remat", "full",
                               "--scan-layers"],
    "8b_64dev_einsum": ["--model", "llama-8b", "--devices", "64", "--batch-size", "64",
                        "--seq-len", "2048", "--attention", "einsum"],
    "8b_64dev_auto": ["--model", "llama-8b", "--devices", "64", "--batch-size", "64",
                      "--seq-len", "2048", "--attention", "auto"],
}


def plan(args: list[str]) -> dict:
    """``shardax plan ARGS --json`` in a fresh process (it sets up its emulated devices)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, "-m", "shardax.cli", "plan", *args, "--precision",
                        PRECISION, "--hbm", "96GiB", "--json", str(out)], check=True,
                       capture_output=True, text=True)
        return json.loads(out.read_text())


def score_bytes(seq: int, batch: int, devices: int) -> int:
    """The einsum's [s, s] float32 scores that the backward keeps, per device: one per head,
    layer and local sequence (llama-8b: 32 layers, 32 heads)."""
    cfg = models.get_config("llama-8b")
    return cfg.n_layers * cfg.n_heads * max(batch // devices, 1) * seq * seq * 4


def measure(rounds: int) -> dict:
    memory = {impl: {str(s): temp_bytes(impl, s) for s in MEMORY_SEQS} for impl in IMPLS}
    times = {str(s): step_times(s, rounds) for s in TIME_SEQS}
    from shardax.models.attention import BLOCKWISE_MIN_LEN

    plans = {name: {k: p[k] for k in ("memory", "peak_bytes", "mesh", "command")}
             for name, p in ((name, plan(args)) for name, args in PLANS.items())}
    return {"memory": memory, "times": times, "blockwise_min_len": BLOCKWISE_MIN_LEN,
            "device": jax.devices()[0].device_kind, "plans": plans,
            "score_bytes_8b_64dev": score_bytes(2048, 64, 64)}


def _temp(p: dict) -> int:
    return p["memory"]["temp_size_in_bytes"]


def _growth(r: dict, impl: str) -> float:
    m = r["memory"][impl]
    return m[str(MEMORY_SEQS[1])] / m[str(MEMORY_SEQS[0])]


def render(r: dict) -> str:
    lo, hi = MEMORY_SEQS
    mib = lambda b: f"{b / 2**20:,.0f}"
    mem_rows = [f"| {impl} | {mib(r['memory'][impl][str(lo)])} | {mib(r['memory'][impl][str(hi)])}"
                f" | {_growth(r, impl):.1f} |" for impl in IMPLS]
    t = {s: r["times"][str(s)] for s in TIME_SEQS}
    time_rows = [f"| {impl} | " + " | ".join(
        f"{t[s][impl]:.2f} s ({t[s][impl] / t[s]['einsum']:.2f})" for s in TIME_SEQS) + " |"
        for impl in IMPLS]
    return "\n".join([
        "## 11. Attention: temporaries against sequence length, step time per implementation",
        "",
        "`benchmarks/attention.py`: llama-small (batch 1) forward + backward of "
        "`training_loss` (chunked cross-entropy), compiled on one CPU device; temporaries from "
        f"`memory_analysis()`. 'auto' is xla below {r['blockwise_min_len']} keys, blockwise "
        "from there (cudnn on NVIDIA GPUs). Goal: 'auto' grows at most 10x from seq "
        f"{lo} to {hi} (linear is 8x).",
        "",
        f"| attention | temp MiB at {lo} | temp MiB at {hi} | growth |",
        "|---|---|---|---|",
        *mem_rows,
        "",
        "Step time (2 layers, batch 1; in brackets: relative to einsum):",
        "",
        "| attention | " + " | ".join(f"seq {s}" for s in TIME_SEQS) + " |",
        "|---|" + "---|" * len(TIME_SEQS),
        *time_rows,
        "",
        *_render_plans(r),
    ])


def _render_plans(r: dict) -> list[str]:
    gib = lambda b: f"{b / 2**30:.1f}"
    p = r["plans"]
    drop = _temp(p["8b_64dev_einsum"]) - _temp(p["8b_64dev_auto"])
    rows = [f"| {name} | `{p[name]['command']}` | {gib(_temp(p[name]))} | "
            f"{gib(p[name]['peak_bytes'])} |" for name in PLANS]
    return [
        "`shardax plan` (float32 parameters, bfloat16 compute), GiB per device:",
        "",
        "| case | command | temporaries | peak |",
        "|---|---|---|---|",
        *rows,
        "",
        "torchtitan's long-context run against 96 GiB: peak "
        f"{gib(p['torchtitan_32k']['peak_bytes'])} GiB. llama-8b on 64 devices: the default "
        f"attention holds {gib(drop)} GiB fewer "
        f"temporaries than the einsum; the einsum's score buffers are "
        f"{gib(r['score_bytes_8b_64dev'])} GiB (32 layers x 32 heads x [2048, 2048] float32).",
        "",
    ]


def summary(r: dict) -> list[dict]:
    g = _growth(r, "auto")
    p = r["plans"]
    peak = p["torchtitan_32k"]["peak_bytes"] / 2**30
    drop = (_temp(p["8b_64dev_einsum"]) - _temp(p["8b_64dev_auto"])) / r["score_bytes_8b_64dev"]
    return [goal_row("11 attention", f"temp growth seq {MEMORY_SEQS[0]} -> {MEMORY_SEQS[1]}, "
                     "default attention", g, "≤ 10", g <= 10),
            goal_row("11 attention", "torchtitan 8B seq 32768 fsdp=8: peak GiB per device",
                     peak, "≤ 96", peak <= 96),
            goal_row("11 attention", "llama-8b 64 devices seq 2048: temporaries dropped / "
                     "einsum score buffers", drop, "≥ 1", drop >= 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = measure(args.rounds)
    result["machine"] = machine()
    print(render(result))
    emit(result, args.json)


if __name__ == "__main__":
    main()
