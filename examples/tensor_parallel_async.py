"""Sync vs sequence-parallel vs async (collective matmul) tensor parallelism on one MLP block.

Runs anywhere: without an accelerator it emulates 8 CPU devices. The same parameters (global
layout, sharded over `tp`) are used by every mode; the script checks that outputs and gradients
agree with the single-device computation and prints the collectives in each optimized HLO.

    PYTHONPATH=src python examples/tensor_parallel_async.py            # mesh dp=2, tp=4
    PYTHONPATH=src python examples/tensor_parallel_async.py --tp 8     # mesh tp=8

The fwd+bwd counts include XLA's all-reduces of the weight gradients over `dp`.
"""

import argparse
import os
import re
import time
from collections import Counter

# Must happen before jax is imported. The flag only affects the CPU backend: without an
# accelerator it gives 8 emulated devices, and with fewer than 8 accelerators the script
# falls back to those CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardax.parallel import tp_mlp  # noqa: E402

COLLECTIVES = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"


def collectives(hlo: str) -> dict[str, int]:
    return dict(Counter(re.findall(rf"\s({COLLECTIVES})(?:-start)?\(", hlo)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=4, help="tp size; dp = devices // tp")
    args = parser.parse_args()

    devices = jax.devices()
    if len(devices) < 8:  # e.g. one GPU: fall back to the emulated CPU devices
        devices = jax.devices("cpu")
    devices = devices[:8]
    dp = len(devices) // args.tp
    mesh = jax.sharding.Mesh(
        np.asarray(devices).reshape(dp, args.tp),
        ("dp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    print(f"mesh {dict(mesh.shape)} on {devices[0].platform}")

    b, s, d, f = 2 * dp, 64, 128, 512
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, s, d), np.float32)
    params = {  # global logical layout; the same tree serves every mode
        "w_in": rng.standard_normal((d, f), np.float32) / np.sqrt(d),
        "w_out": rng.standard_normal((f, d), np.float32) / np.sqrt(f),
    }
    x = jax.device_put(x, NamedSharding(mesh, P("dp")))
    params = {
        "w_in": jax.device_put(params["w_in"], NamedSharding(mesh, P(None, "tp"))),
        "w_out": jax.device_put(params["w_out"], NamedSharding(mesh, P("tp", None))),
    }

    def loss_fn(params, x, mode, sp):
        # batch_axes: the dp-sharded batch stays local in the sync all-gather/reduce-scatter
        y = tp_mlp(
            x, params["w_in"], params["w_out"], mode=mode, sequence_parallel=sp, batch_axes="dp"
        )
        return jnp.mean(y**2), y

    # single-device reference: no mesh set, so tp_mlp is plain x @ w
    host = jax.tree.map(np.asarray, (params, x))
    (_, y_ref), g_ref = jax.value_and_grad(loss_fn, has_aux=True)(*host, "sync", False)

    variants = [("sync", False), ("sync", True), ("async", True), ("async_bidi", True)]
    outputs = {}
    with jax.set_mesh(mesh):
        for mode, sp in variants:
            step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(2, 3))
            t0 = time.perf_counter()
            (_, y), g = step(params, x, mode, sp)
            jax.block_until_ready(g)
            secs = time.perf_counter() - t0
            err = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(r))))
                for a, r in zip(jax.tree.leaves((y, g)), jax.tree.leaves((y_ref, g_ref)))
            )
            fwd = jax.jit(lambda p, x, m=mode, sp=sp: loss_fn(p, x, m, sp)[1])
            fwd_ops = collectives(fwd.lower(params, x).compile().as_text())
            step_ops = collectives(step.lower(params, x, mode, sp).compile().as_text())
            name = f"{mode}{'+SP' if sp and mode == 'sync' else ''}"
            print(f"{name:11s} max|diff| vs 1 device {err:.1e}  compile+run {secs:5.2f}s")
            print(f"{'':11s} forward HLO: {fwd_ops}")
            print(f"{'':11s} fwd+bwd HLO: {step_ops}")
            assert err < 1e-4, (name, err)
            outputs[name] = np.asarray(y)
            if mode != "sync":
                assert "all-gather" not in fwd_ops and "collective-permute" in fwd_ops
    for name in ("async", "async_bidi"):
        diff = float(np.max(np.abs(outputs[name] - outputs["sync"])))
        print(f"max|{name} - sync| = {diff:.1e}")
        np.testing.assert_allclose(outputs[name], outputs["sync"], rtol=1e-5, atol=1e-5)
    print("all modes agree with each other and with the single-device result")


if __name__ == "__main__":
    main()
