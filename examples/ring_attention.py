"""Ring attention on a (cp=8) mesh against plain single-device attention.

    PYTHONPATH=src python examples/ring_attention.py

Without an accelerator it emulates 8 CPU devices. Prints the max error of the output and of
the gradients, and per-device memory read from the compiled programs.
"""

import os
import time

if not os.environ.get("JAX_PLATFORMS") and not any(
    os.path.exists(p) for p in ("/dev/nvidia0", "/dev/accel0")
):
    os.environ["JAX_PLATFORMS"] = "cpu"
if os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardax.parallel.context import (  # noqa: E402
    attention,
    load_balance,
    ring_attention,
    unload_balance,
)

CP = 8
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 1, 2048, 4, 2, 32


def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) ** 2)


def main() -> None:
    t0 = time.perf_counter()
    mesh = jax.make_mesh((CP,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((BATCH, SEQ, h, HEAD_DIM), np.float32)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )

    # Reference: one device, full [seq, seq] scores.
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(attention, *a), argnums=(0, 1, 2)))
    ref_c = ref.lower(q, k, v).compile()
    (ref_loss, ref_grads), ref_out = ref_c(q, k, v), jax.jit(attention)(q, k, v)

    # Ring: tokens in load-balanced order (device i holds chunks i and 2*CP-1-i), sharded over cp.
    # A real model would permute token ids, RoPE positions and labels once, at the input.
    sharding = NamedSharding(mesh, P(None, "cp"))
    qb, kb, vb = (jax.device_put(load_balance(x, CP), sharding) for x in (q, k, v))
    ring = lambda q, k, v: ring_attention(q, k, v, causal=True, load_balanced=True)
    with jax.set_mesh(mesh):
        fwd_c = jax.jit(ring).lower(qb, kb, vb).compile()
        grad_c = (
            jax.jit(jax.value_and_grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2)))
            .lower(qb, kb, vb)
            .compile()
        )
        out = unload_balance(fwd_c(qb, kb, vb), CP)
        ring_loss, ring_grads = grad_c(qb, kb, vb)

    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, mesh {dict(mesh.shape)}")
    print(f"q [b, s, h, d] = {q.shape}, k/v = {k.shape}, causal, load-balanced")
    rel = lambda a, r: float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r)))
    print(f"out  max abs err         : {float(jnp.max(jnp.abs(out - ref_out))):.2e}")
    print(f"loss ring / ref          : {float(ring_loss):.6f} / {float(ref_loss):.6f}")
    for name, g, r in zip("qkv", ring_grads, ref_grads):
        label = f"d{name} max err / max |d{name}|"
        print(f"{label:25s}: {rel(unload_balance(g, CP), r):.2e}")

    mib = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
    ref_fwd = jax.jit(attention).lower(q, k, v).compile()
    print(f"temp MiB/device forward  : ring {mib(fwd_c):7.2f}   reference {mib(ref_fwd):7.2f}")
    print(f"temp MiB/device fwd+bwd  : ring {mib(grad_c):7.2f}   reference {mib(ref_c):7.2f}")
    kv_block = BATCH * (SEQ // CP) * KV_HEADS * HEAD_DIM * 2 * 4  # k and v, float32
    hlo = fwd_c.as_text()
    print(
        f"K/V sent per device/fwd  : {CP - 1} blocks x {kv_block / 2**10:.0f} KiB"
        f" = {(CP - 1) * kv_block / 2**10:.0f} KiB (collective-permute in HLO:"
        f" {'collective-permute' in hlo}, all-gather: {'all-gather' in hlo})"
    )
    print(f"wall time: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
