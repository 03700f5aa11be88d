"""LoRA against full fine-tuning: what one device holds, from the compiled train step (the
numbers `shardax plan` reports), for the same model, mesh and batch.

    python benchmarks/lora.py --json out.json

Model: llama-1b shapes (TinyLlama-1.1B), stacked layers, full remat, float32 parameters and
bfloat16 compute, AdamW, fsdp=8 over 8 emulated CPU devices, batch 8 x seq 2048; LoRA rank 16,
alpha 32 on the attention and MLP projections (the default targets). Read from the compiled
program: the trainable parameters' and optimizer state's bytes per device (the plan's input
rows), the compiled arguments, temporaries and peak. Goal: LoRA's optimizer state is AdamW's
two moments of the adapters alone (2 x adapter bytes, within 1%), and its peak is below full
fine-tuning's.
"""

from __future__ import annotations

import argparse

from _common import emit, goal_row, jax, jnp, machine

from shardax.hlo import peak_bytes
from shardax.train.build import abstract, step_function
from shardax.train.config import TrainConfig, check
from shardax.train.resolve import resolve

BASE = dict(model="llama-1b", mesh="fsdp=8", batch_size=8, seq_len=2048, remat="full",
            scan_layers=True, precision="params=float32,compute=bfloat16", optimizer="adamw")
CASES = {"full fine-tuning": {}, "LoRA r16": dict(lora_rank=16, lora_alpha=32.0)}


def measure_case(overrides: dict) -> dict:
    run = resolve(check(TrainConfig(**BASE, **overrides)))
    graphdef, state_shape = abstract(run.model_config, run.tx, run.config.seed, run.mesh)
    shardings = run.mesh.match_sharding_rule(run.state_rules, state_shape)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state_shape, shardings)
    batch = (jax.ShapeDtypeStruct((BASE["batch_size"], BASE["seq_len"]), jnp.int32),) * 2
    plan = step_function(run, graphdef, end_id=0).plan(state, batch)
    inputs = [r for r in plan.rows if r.kind == "input"]
    m = plan.memory
    return {
        "trainable_bytes": sum(r.bytes_per_device for r in inputs
                               if r.path.startswith("state/params")),
        "frozen_bytes": sum(r.bytes_per_device for r in inputs if r.path.startswith("state/rest")),
        "optimizer_bytes": sum(r.bytes_per_device for r in inputs
                               if r.path.startswith("state/opt_state")),
        "argument_bytes": m["argument_size_in_bytes"],
        "temp_bytes": m["temp_size_in_bytes"],
        "peak_bytes": peak_bytes(m),
    }


def measure() -> dict:
    return {name: measure_case(overrides) for name, overrides in CASES.items()}


def render(r: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    rows = [f"| {name} | {mib(c['trainable_bytes'])} | {mib(c['frozen_bytes'])} | "
            f"{mib(c['optimizer_bytes'])} | {mib(c['temp_bytes'])} | {mib(c['peak_bytes'])} |"
            for name, c in r.items() if name in CASES]
    return "\n".join([
        "## 14. LoRA against full fine-tuning: memory per device (compiled step)",
        "",
        "llama-1b shapes, fsdp=8, batch 8 x seq 2048, full remat, float32 parameters, bfloat16 "
        "compute, AdamW; LoRA rank 16 on the attention and MLP projections.",
        "",
        "| run | trainable MiB | frozen MiB | optimizer state MiB | temporaries MiB | peak MiB |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def summary(r: dict) -> list[dict]:
    lora, full = r["LoRA r16"], r["full fine-tuning"]
    ratio = lora["optimizer_bytes"] / max(2 * lora["trainable_bytes"], 1)
    peak = lora["peak_bytes"] / full["peak_bytes"]
    return [goal_row("14 lora", "LoRA optimizer state / (2 x adapter bytes)", ratio,
                     "1 ± 0.01", abs(ratio - 1) <= 0.01),
            goal_row("14 lora", "LoRA peak / full fine-tuning peak", peak, "< 1", peak < 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = measure()
    result["machine"] = machine()
    print(render(result))
    emit(result, args.json)


if __name__ == "__main__":
    main()
