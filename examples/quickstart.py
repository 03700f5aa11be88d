"""Quickstart: a plain-JAX MLP train step, written for one device, run on 8 with rules.

    python examples/quickstart.py

Without an accelerator it emulates 8 CPU devices. The only shardax-specific lines are the mesh,
the rules and ``mesh.sjit`` in place of ``jax.jit``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shardax.sharding import (  # noqa: E402
    FSDPShardingRule,
    MeshShardingHelper,
    PartitionSpec,
    with_sharding_annotation,
)


# ---- single-device code: nothing here knows about devices --------------------------------
def init_params(key, sizes=(64, 512, 512, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, batch):
    h = batch["x"]
    for layer in params[:-1]:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        h = with_sharding_annotation(h, "activations")  # a name, not a sharding
    logits = h @ params[-1]["w"] + params[-1]["b"]
    labels = jax.nn.one_hot(batch["y"], logits.shape[-1])
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


def train_step(params, batch, lr=0.05):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params, loss


# ---- scaling it: a mesh and rules ------------------------------------------------------------
def main():
    mesh = MeshShardingHelper([-1], ["fsdp"])  # all devices on one FSDP axis
    fsdp = FSDPShardingRule(min_fsdp_size=1024)  # small leaves stay replicated

    step = mesh.sjit(
        train_step,
        in_shardings=(fsdp, None),
        out_shardings=(fsdp, None),
        args_sharding_constraint=(fsdp, PartitionSpec("fsdp")),  # batch split over devices
        annotation_shardings={"activations": PartitionSpec("fsdp")},
        donate_argnums=0,
    )
    params = mesh.sjit(init_params, out_shardings=fsdp)(jax.random.key(0))

    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 64)).astype(np.float32) * 0.3

    def batch_at(step_index):
        r = np.random.default_rng(step_index)
        y = r.integers(0, 10, size=256)
        x = centers[y] + r.normal(size=(256, 64)).astype(np.float32)
        return {"x": x, "y": y.astype(np.int32)}

    print(f"{jax.device_count()} devices, mesh {mesh.shape}\n")
    print(step.plan(params, batch_at(0)), "\n")
    for i in range(30):
        params, loss = step(params, batch_at(i))
        if i % 5 == 0 or i == 29:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
