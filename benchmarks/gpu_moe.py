"""The dropless MoE's grouped matmul on a GPU: equal to `jax.lax.ragged_dot`, and how fast.

    python benchmarks/gpu_moe.py                 # checks, then timings
    python benchmarks/gpu_moe.py --json out.json

A check, not a CPU benchmark: on a GPU, `shardax.parallel.grouped_kernel.grouped_matmul` runs
the rows grouped by expert as one batched matmul over a capacity bucket (`bucketed_matmul`),
a path CPU tests reach only by pretending to be a GPU. XLA:GPU (JAX 0.11) expands
``ragged_dot`` into a dense matmul against every expert (experts times the work), which is
what this replaced. First ``bucketed_matmul`` against ``ragged_dot`` in float32 at the highest
matmul precision, forward and both gradients, for balanced groups, each capacity bucket, an
empty expert, rows past the groups and one expert past every bucket (``ragged_dot`` again);
then the forward + backward time of ``ragged_dot``, the buckets, the CPU path's tiled scan
and a plain batched matmul of the same rows (the floor), bf16, at a llama-1b-sized expert
layer (8,192 tokens, top-2 of 8 experts, 2048 -> 2816; medians of interleaved rounds).
Exits 1 on a failed check.

The whole train step, dropless against the capacity-based MoE, is `gpu_llama_1b.py`'s:

    python benchmarks/gpu_llama_1b.py --set n_layers=8 --set n_experts=8 --set top_k=2 \\
        --set mlp_dim=2816 --set moe_impl=dropless      # and moe_impl=capacity
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# (name, rows per expert) of 8 experts and 512 rows: capacities 80 and 128 (1.25 and 2 x 64).
CHECKS = (
    ("balanced", [64] * 8),
    ("second bucket, an empty expert", [120, 40, 0, 100, 52, 60, 70, 70]),
    ("rows past the groups", [60, 0, 70, 50, 50, 50, 50, 10]),
    ("past every bucket: ragged_dot", [400, 16, 16, 16, 16, 16, 16, 16]),
)
TOKENS, TOP_K, DIM, HIDDEN, EXPERTS = 8192, 2, 2048, 2816, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import jax
    import jax.numpy as jnp

    from shardax.parallel.grouped_kernel import bucketed_matmul, grouped_matmul, sort_by_expert

    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit(f"gpu_moe.py needs a GPU; JAX sees {device.platform}")
    keys = jax.random.split(jax.random.key(0), 4)

    errors, failed = {}, False
    with jax.default_matmul_precision("highest"):
        x, w = jax.random.normal(keys[0], (512, 64)), jax.random.normal(keys[1], (8, 64, 32))
        ct = jax.random.normal(keys[2], (512, 32))
        for name, sizes in CHECKS:
            sizes = jnp.asarray(sizes, jnp.int32)

            def both(fn, sizes=sizes):
                y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
                return y, *vjp(ct)

            want = jax.jit(lambda both=both: both(jax.lax.ragged_dot))()
            got = jax.jit(lambda both=both: both(bucketed_matmul))()
            errors[name] = [float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
                            for g, r in zip(got, want, strict=True)]
            ok = max(errors[name]) < 1e-5
            failed |= not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: largest error over the largest value "
                  f"(y, dx, dw): {', '.join(f'{e:.1e}' for e in errors[name])}")

    experts = jax.lax.top_k(jax.random.normal(keys[0], (TOKENS, EXPERTS)), TOP_K)[1]
    tokens = jax.random.normal(keys[1], (TOKENS, DIM), jnp.bfloat16)
    weights = (jax.random.normal(keys[2], (EXPERTS, DIM, HIDDEN)) * 0.02).astype(jnp.bfloat16)

    def program(product, x):
        cotangent = jax.random.normal(keys[3], (*x.shape[:-1], HIDDEN), jnp.bfloat16)

        def loss(x, w):
            return jnp.sum(product(x, w).astype(jnp.float32) * cotangent)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return lambda: step(x, weights)

    def grouped(tile, raw=False):
        lay = sort_by_expert(experts, EXPERTS, tile)
        groups = lay.groups.sizes if raw else lay.groups
        product = jax.lax.ragged_dot if raw else grouped_matmul
        return program(lambda x, w: product(x, w, groups), jnp.take(tokens, lay.rows, axis=0))

    same_rows = tokens.reshape(EXPERTS, -1, DIM).repeat(TOP_K, axis=1)
    runs = {"ragged_dot": grouped(1, raw=True), "buckets (grouped_matmul)": grouped(1),
            "tiled scan, 512 rows": grouped(512),
            "batched matmul, same rows": program(
                lambda x, w: jnp.einsum("ecd,edf->ecf", x, w), same_rows)}
    for run in runs.values():
        jax.block_until_ready(run())
    samples = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            jax.block_until_ready(run())
            start = time.perf_counter()
            for _ in range(5):
                out = run()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / 5)
    flops = 3 * 2 * TOKENS * TOP_K * DIM * HIDDEN  # forward, dx, dw
    seconds = {name: statistics.median(s) for name, s in samples.items()}
    print(f"\nforward + backward, {TOKENS} tokens top-{TOP_K} of {EXPERTS} experts, "
          f"{DIM} -> {HIDDEN}, bf16, {device.device_kind}:")
    for name, s in seconds.items():
        print(f"  {name:28s} {s * 1e3:7.2f} ms  {flops / s / 1e12:5.0f} TFLOP/s  "
              f"{s / seconds['batched matmul, same rows']:5.1f}x the batched matmul")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": device.device_kind, "errors": errors, "seconds": seconds}, indent=2) + "\n")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
