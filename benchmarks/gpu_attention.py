"""cuDNN attention on an NVIDIA GPU: equal to the float32 reference, and how fast.

    python benchmarks/gpu_attention.py                 # checks, then timings
    python benchmarks/gpu_attention.py --json out.json

A check, not a CPU benchmark: ``'auto'`` picks ``'cudnn'`` on NVIDIA GPUs, a path CPU tests can
only refuse. For each case (causal, sliding window, not causal; GQA; head_dim 64 and 128; packed
documents' segment ids and padded keys, which cuDNN takes as a dense mask), the bfloat16
forward and the gradients of q, k, v of ``'cudnn'``, ``'xla'`` and ``'blockwise'`` are compared
with ``'einsum'`` on the same inputs in float32: the error is the largest absolute difference
over the largest absolute reference value. cuDNN passes when its error is at most
twice the bfloat16 ``'xla'`` path's plus 1e-3 (the two round differently; neither is exact).
Then the forward + backward time of each implementation at 2k..16k tokens, causal and with
packed documents (medians of interleaved rounds). Exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CASES = (  # name, batch, seq, heads, kv_heads, head_dim, causal, window, mask
    ("causal gqa d64", 2, 1024, 8, 2, 64, True, None, None),
    ("causal mha d128", 2, 1024, 8, 8, 128, True, None, None),
    ("window 256 gqa", 2, 1024, 8, 2, 64, True, 256, None),
    ("not causal", 2, 512, 4, 4, 64, False, None, None),
    ("packed gqa", 2, 1024, 8, 2, 64, True, None, "segments"),
    ("packed window 256", 2, 1024, 8, 2, 64, True, 256, "segments"),
    ("padded keys", 2, 512, 4, 4, 64, True, None, "kv_mask"),
)
IMPLS = ("cudnn", "xla", "blockwise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,4096,8192,16384", help="timed sequence lengths")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import jax
    import jax.numpy as jnp

    from shardax.models.attention import attention, resolve_implementation

    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit(f"gpu_attention.py needs an NVIDIA GPU; JAX sees {device.platform}")

    def documents(b, s, key):
        """Segment ids of rows packed with documents of ~s/6 tokens on average."""
        return jnp.cumsum(jax.random.randint(key, (b, s), 0, s // 6) == 0, axis=1)

    def run(impl, q, k, v, ct, causal, window, masks):
        def f(q, k, v):
            return attention(q, k, v, causal=causal, window=window, implementation=impl,
                             **masks)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))

    results = {"device": device.device_kind, "jax": jax.__version__, "checks": [], "timings": []}
    failed = False
    for name, b, s, h, kvh, d, causal, window, mask in CASES:
        keys = jax.random.split(jax.random.key(len(results["checks"])), 5)
        masks = ({"segment_ids": documents(b, s, keys[4])} if mask == "segments" else
                 {"kv_mask": jax.random.bernoulli(keys[4], 0.7, (b, s))} if mask else {})
        q, ct = (jax.random.normal(key, (b, s, h, d), jnp.float32) for key in keys[:2])
        k, v = (jax.random.normal(key, (b, s, kvh, d), jnp.float32) for key in keys[2:4])
        bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        # the reference sees the same (bf16-rounded) inputs, computed in float32
        ref = jax.jit(run, static_argnums=(0, 5, 6))(
            "einsum", *(x.astype(jnp.float32) for x in bf), ct, causal, window, masks)
        errors = {}
        for impl in IMPLS:
            got = jax.jit(run, static_argnums=(0, 5, 6))(impl, *bf, ct, causal, window, masks)
            errors[impl] = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))
                                  / jnp.max(jnp.abs(r))) for g, r in zip(got, ref, strict=True)]
        ok = all(c <= 2 * x + 1e-3 for c, x in zip(errors["cudnn"], errors["xla"], strict=True))
        failed |= not ok
        auto = resolve_implementation("auto", bf[0], bf[1], custom_mask=bool(mask))
        results["checks"].append({"case": name, "ok": ok, "auto": auto,
                                  **{f"err_{i}": e for i, e in errors.items()}})
        print(f"{'ok  ' if ok else 'FAIL'} {name:<18} auto={results['checks'][-1]['auto']:<6} "
              + "  ".join(f"{i} out/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errors[i])
                          for i in IMPLS), flush=True)

    for s, packed in ((int(x), p) for x in args.seqs.split(",") for p in (False, True)):
        b, h, kvh, d = max(1, 16384 // s), 16, 4, 128
        keys = jax.random.split(jax.random.key(s), 5)
        q, ct = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys[:2])
        k, v = (jax.random.normal(key, (b, s, kvh, d), jnp.bfloat16) for key in keys[2:4])
        masks = {"segment_ids": documents(b, s, keys[4])} if packed else {}
        steps = {impl: jax.jit(run, static_argnums=(0, 5, 6)) for impl in IMPLS}
        for impl in IMPLS:
            jax.block_until_ready(steps[impl](impl, q, k, v, ct, True, None, masks))
        times = {impl: [] for impl in IMPLS}
        for r in range(args.rounds):
            for impl in IMPLS[r % 3:] + IMPLS[:r % 3]:
                start = time.perf_counter()
                jax.block_until_ready(steps[impl](impl, q, k, v, ct, True, None, masks))
                times[impl].append(time.perf_counter() - start)
        med = {impl: statistics.median(t) for impl, t in times.items()}
        # causal fwd+bwd: 4 matmuls forward-equivalent x 2.5 (bwd = 2 fwd + recompute) / 2 (mask)
        flops = 4 * b * h * s * s * d * 2.5 / 2
        row = {"seq": s, "batch": b, "packed": packed, **{f"{i}_ms": med[i] * 1e3 for i in IMPLS},
               **{f"{i}_tflops": flops / med[i] / 1e12 for i in IMPLS}}
        results["timings"].append(row)
        print(f"seq {s:>6} b {b:>2}{' packed' if packed else ' causal'}: " + "  ".join(
            f"{i} {med[i] * 1e3:7.2f} ms ({row[f'{i}_tflops']:5.0f} TFLOP/s)" for i in IMPLS),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
