"""Train a tiny mixture-of-experts regression with expert parallelism on an (ep=4, fsdp=2) mesh.

Experts are sharded over ``ep`` (and their d_model dim over ``fsdp``), tokens over both axes.
Prints the loss, the load-balancing loss, the dropped fraction, and the all-to-all traffic read
from the optimized HLO next to the textbook estimate. ``SHARDAX_EXAMPLE_STEPS`` sets the number
of steps (300). Runs on 8 emulated CPU devices when there is no accelerator:

    PYTHONPATH=src python examples/moe_expert_parallel.py
"""

import os
import re
import time

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"
if os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardax.parallel.expert import expert_capacity, init_moe_params, moe_mlp  # noqa: E402

BATCH, SEQ, D, H, E, TOP_K, CF = 32, 16, 32, 64, 8, 2, 1.25
STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 300))
LR, LB_WEIGHT = 2.0, 0.01
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4}


def all_to_all_traffic(hlo: str) -> tuple[int, int]:
    """(number of all-to-all ops, bytes they return per device) in an optimized HLO text."""
    count = nbytes = 0
    for line in hlo.splitlines():
        if " all-to-all(" not in line:
            continue
        count += 1
        result_type = line.split("=", 1)[1].split(" all-to-all(")[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result_type):
            nbytes += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return count, nbytes


def main():
    mesh = jax.make_mesh((4, 2), ("ep", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((D, D), np.float32) / np.sqrt(D)

    def batch():
        x = rng.standard_normal((BATCH, SEQ, D), np.float32)
        return x, x + np.tanh(x @ teacher) * np.sign(x[..., :1])

    def loss_fn(params, x, y):
        out, aux = moe_mlp(x, **params, top_k=TOP_K, capacity_factor=CF, batch_axes=("fsdp",))
        return jnp.mean((x + out - y) ** 2) + LB_WEIGHT * aux["load_balancing_loss"], aux

    @jax.jit
    def step(params, x, y):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss, aux

    with jax.set_mesh(mesh):
        expert_spec = P("ep", "fsdp")  # experts over ep, d_model of each expert over fsdp
        params = init_moe_params(jax.random.key(0), D, H, E)
        shardings = {k: P() if k == "router_w" else expert_spec for k in params}
        params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in shardings.items()})
        tokens = NamedSharding(mesh, P(("ep", "fsdp")))
        put = lambda a: jax.device_put(a, tokens)

        x, y = map(put, batch())
        hlo = step.lower(params, x, y).compile().as_text()
        start = time.perf_counter()
        for i in range(STEPS):
            params, loss, aux = step(params, x, y)
            if i % 60 == 0 or i == STEPS - 1:
                print(
                    f"step {i:3d}  loss {float(loss):.4f}  "
                    f"load_balancing {float(aux['load_balancing_loss']):.3f}  "
                    f"dropped {float(aux['dropped_fraction']):.3f}"
                )
            x, y = map(put, batch())
        elapsed = time.perf_counter() - start

    count, nbytes = all_to_all_traffic(hlo)
    groups = mesh.size  # tokens are split over ep x fsdp: one routing group per device
    capacity = expert_capacity(BATCH * SEQ // groups, E, TOP_K, CF)
    # Each all-to-all moves every group's [E, C, d] dispatch (or combine) buffer once.
    theory = groups * E * capacity * D * 4 / mesh.size
    print(f"{STEPS} steps in {elapsed:.1f}s on {mesh.size} {jax.devices()[0].platform} devices")
    print(
        f"train step HLO: {count} all-to-all ops (forward: dispatch + combine; backward: the "
        f"combine's transpose; the dispatch's transpose only carries d/dx, unused here), "
        f"{nbytes / max(count, 1):.0f} bytes per op per device"
    )
    print(
        f"theory per op per device: G*E*C*d*4/devices = {groups}*{E}*{capacity}*{D}*4/"
        f"{mesh.size} = {theory:.0f} ~ tokens*top_k*capacity_factor*d*4/devices = "
        f"{BATCH * SEQ * TOP_K * CF * D * 4 / mesh.size:.0f}"
    )


if __name__ == "__main__":
    main()
