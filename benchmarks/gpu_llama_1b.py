"""Train llama-1b with FSDP over every local GPU and report tokens/s and MFU.

    python benchmarks/gpu_llama_1b.py                       # bf16 compute, fp32 params
    python benchmarks/gpu_llama_1b.py --precision bf16      # params=bf16 too
    python benchmarks/gpu_llama_1b.py --batch-per-device 8 --remat full --json out.json
    python benchmarks/gpu_llama_1b.py --documents 400     # packed documents, as the CLI's default
    python benchmarks/gpu_llama_1b.py --set n_experts=8 --set top_k=2 --set moe_impl=dropless

MFU = model FLOPs per second / peak dense bf16 FLOPs of all devices, with model FLOPs per token
= 6·N + 12·L·d·T and the peak from the device table, both from ``shardax.train.run.mfu`` (the same
numbers ``shardax train`` logs and ``shardax plan`` estimates with). Recomputation under remat
is not model FLOPs, so it lowers MFU. Data are random tokens: this measures speed, not
learning.

On a machine without a GPU it exits with a message; ``--allow-cpu`` runs the same code path on
CPU (use a small ``--model``) to check that it works; it then reports no MFU.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from functools import partial
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--precision", default="params=float32,compute=bfloat16",
                        help="shardax precision policy, e.g. 'bf16' or "
                             "'params=bfloat16,compute=bfloat16'")
    parser.add_argument("--batch-per-device", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile first)")
    parser.add_argument("--remat", default="save_dots",
                        choices=("none", "full", "save_dots", "offload"))
    parser.add_argument("--no-scan", action="store_true", help="unroll the layers")
    parser.add_argument("--documents", type=int, default=0,
                        help="pack documents of about this many tokens (`shardax train --pack "
                             "documents`: attention and positions restart at each end-of-text "
                             "id 0); 0: each row one stream")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="replace a field of the model's config (`shardax.models.get_config`"
                             "), e.g. n_layers=8 or moe_impl=dropless; repeatable")
    parser.add_argument("--rules", default="fsdp", help="logical-rule preset")
    parser.add_argument("--mesh", default="fsdp=-1")
    parser.add_argument("--peak-tflops", type=float,
                        help="peak bf16 TFLOP/s per device, if the table does not know it")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on CPU anyway (a smoke test of this script; no MFU)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "src"))
    import jax
    import jax.numpy as jnp

    devices = jax.devices()
    if devices[0].platform != "gpu" and not args.allow_cpu:
        raise SystemExit(
            f"gpu_llama_1b.py needs a GPU; JAX sees {len(devices)} {devices[0].platform} "
            f"device(s). Install jax with CUDA (pip install 'jax[cuda12]') on a GPU machine, "
            f"or pass --allow-cpu with a small --model to smoke-test the script.")

    from flax import nnx

    from shardax import layout, models
    from shardax.devices import device_spec
    from shardax.mesh import MeshShardingHelper
    from shardax.models.attention import resolve_implementation
    from shardax.precision import Policy
    from shardax.rules import LogicalAxisRules
    from shardax.train.optimizers import make_optimizer
    from shardax.train.run.mfu import flops_per_token, mfu
    from shardax.train.step import init_state, train_step

    policy = Policy.from_string(args.precision)
    if args.precision in ("bf16", "bfloat16"):
        policy = Policy(params=jnp.dtype("bfloat16"), compute=jnp.dtype("bfloat16"))
    overrides = dict(_field(item) for item in args.set)
    config = models.get_config(
        args.model, dtype=policy.compute, param_dtype=policy.params,
        max_seq_len=max(args.seq_len, models.CONFIGS[args.model].max_seq_len), **overrides)
    mesh = MeshShardingHelper.from_string(args.mesh)
    rules = LogicalAxisRules(layout.PRESETS[args.rules])
    batch = args.batch_per_device * len(devices)
    tx = make_optimizer("adamw", 3e-4, args.steps + args.warmup, warmup=1)

    def fresh_state():
        return init_state(lambda: models.create(config, nnx.Rngs(0)), tx)

    graphdefs = []

    def state_only():
        graphdef, state = fresh_state()
        graphdefs.append(graphdef)  # static structure, no tracers
        return state

    with mesh.get_context():
        jax.eval_shape(state_only)
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    step = mesh.sjit(partial(train_step, graphdef=graphdefs[0], tx=tx, policy=policy,
                             layout=layout.Layout(remat=args.remat, scan_layers=not args.no_scan),
                             end_id=0 if args.documents else None),
                     in_shardings=(rules, batch_spec), out_shardings=(rules, None),
                     donate_argnums=0)

    def random_batch(key):
        tokens, ends = jax.random.split(key)
        t = jax.random.randint(tokens, (batch, args.seq_len + 1), 1, config.vocab_size,
                               jnp.int32)
        if args.documents:
            t = jnp.where(jax.random.bernoulli(ends, 1 / args.documents, t.shape), 0, t)
        return t[:, :-1], t[:, 1:]

    state = mesh.sjit(lambda: fresh_state()[1], out_shardings=rules)()
    inputs, targets = mesh.sjit(random_batch, out_shardings=(batch_spec, batch_spec))(
        jax.random.key(0))

    start = time.perf_counter()
    for _ in range(args.warmup):
        state, metrics = step(state, (inputs, targets))
    warmup_loss = float(metrics["loss"])
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, (inputs, targets))
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - start

    tokens_per_s = batch * args.seq_len * args.steps / elapsed
    per_token = flops_per_token(config, args.seq_len)
    model_flops = per_token * tokens_per_s
    kind = devices[0].device_kind
    spec = device_spec(kind) if devices[0].platform == "gpu" else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else spec and spec.peak_flops
    utilisation = mfu(model_flops, peak, len(devices)) if devices[0].platform == "gpu" else None
    stats = devices[0].memory_stats() or {}
    q = jax.ShapeDtypeStruct((1, args.seq_len, config.n_heads, config.head_dim), policy.compute)
    result = {
        "model": args.model, "overrides": overrides, "params": models.param_count(config),
        "precision": str(policy),
        "devices": f"{len(devices)} x {kind}", "mesh": mesh.shape, "rules": args.rules,
        "remat": args.remat, "scan_layers": not args.no_scan, "documents": args.documents,
        "attention": resolve_implementation("auto", q, q, custom_mask=args.documents > 0),
        "global_batch": batch,
        "seq_len": args.seq_len, "timed_steps": args.steps,
        "warmup_s_incl_compile": warmup_s, "step_s": elapsed / args.steps,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / len(devices),
        "model_tflops_per_s": model_flops / 1e12, "flops_per_token": per_token,
        "peak_tflops_per_device": peak / 1e12 if peak else None, "mfu": utilisation,
        "loss_after_warmup": warmup_loss, "loss_last": float(metrics["loss"]),
        "peak_bytes_in_use_device0": stats.get("peak_bytes_in_use"),
    }
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if utilisation is None:
        print("MFU: not reported (no GPU, or unknown peak: pass --peak-tflops)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _field(item: str) -> tuple[str, object]:
    """``'n_layers=8'`` -> ``('n_layers', 8)``: a Python literal, else the text itself."""
    name, sep, text = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item}: expected FIELD=VALUE")
    try:
        return name, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return name, text


if __name__ == "__main__":
    main()
