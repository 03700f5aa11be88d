"""Train a small MLP classifier with pipeline parallelism (pp=4, dp=2).

Runs anywhere: without an accelerator it emulates 8 CPU devices. The residual hidden layers are
one stacked parameter tree ``[L, ...]`` split over the ``pp`` axis; the batch is split over
``dp`` and into microbatches. The embedding runs before the pipeline and the classifier head
plus cross-entropy run on the stage that holds the pipeline output (``loss_fn=``). Data: sklearn
digits if sklearn is installed, else synthetic Gaussian clusters. The first step is checked
against the same model on one device (plain ``lax.scan`` over the layers).
``--steps`` (default: ``SHARDAX_EXAMPLE_STEPS``, else 60) sets the number of steps.

    python examples/pipeline_classifier.py                                  # gpipe, M=8
    python examples/pipeline_classifier.py --schedule circular --virtual 2
    python examples/pipeline_classifier.py --schedule 1f1b --microbatches 16
"""

import argparse
import os
import time

_ACCELERATOR = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/accel0", "/dev/kfd"))
if not _ACCELERATOR and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):  # must happen before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardax.parallel.pipeline import (  # noqa: E402
    bubble_fraction,
    from_stage_layout,
    pipeline,
    sequential,
    stage_specs,
    to_stage_layout,
)


def load_data(num_classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return (x / 16.0).astype(np.float32), y.astype(np.int32), "sklearn digits"
    except ImportError:
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(num_classes, 64)).astype(np.float32)
        y = rng.integers(0, num_classes, size=2048).astype(np.int32)
        x = centers[y] + 1.5 * rng.normal(size=(len(y), 64)).astype(np.float32)
        return x, y, "synthetic clusters"


def init(key: jax.Array, din: int, width: int, num_layers: int, num_classes: int) -> dict:
    k = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k[0], (din, width)) / np.sqrt(din),
        "layers": {  # one stacked tree [L, ...]: the layout lax.scan / nnx.scan produce
            "w": jax.random.normal(k[1], (num_layers, width, width)) / np.sqrt(width) * 0.5,
            "b": jnp.zeros((num_layers, width)),
        },
        "head": jax.random.normal(k[2], (width, num_classes)) / np.sqrt(width),
    }


def layer(p: dict, h: jax.Array) -> jax.Array:
    return h + jax.nn.gelu(h @ p["w"] + p["b"])


def xent(h: jax.Array, y: jax.Array, head: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(h @ head)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=("gpipe", "circular", "1f1b"),
                        default="gpipe")
    parser.add_argument("--virtual", type=int, default=1, help="virtual stages (circular)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int,
                        default=int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 60)))
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    devices = jax.devices()
    if len(devices) < 8:  # e.g. one GPU: fall back to the emulated CPU devices
        devices = jax.devices("cpu")
    mesh = jax.sharding.Mesh(
        np.array(devices[:8]).reshape(4, 2),
        ("pp", "dp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    pp, batch = mesh.shape["pp"], 128
    v = args.virtual if args.schedule == "circular" else 1
    kw = dict(num_microbatches=args.microbatches, schedule=args.schedule, virtual_stages=v)

    x_all, y_all, name = load_data()
    params = init(jax.random.key(0), x_all.shape[1], 64, args.layers, int(y_all.max()) + 1)
    # Stage layout: a plain P('pp') on the layer axis gives each stage its layers.
    params["layers"] = to_stage_layout(params["layers"], pp, v)
    specs = {"embed": P(), "layers": stage_specs(params["layers"]), "head": P()}
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["embed"])
        return pipeline(layer, p["layers"], h, **kw, loss_fn=xent, loss_batch_args=(y,),
                        loss_args=(p["head"],))

    @jax.jit
    def train_step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), loss

    def reference_loss(p, x, y):  # one device, sequential layer order
        p = jax.device_get(p)
        h = sequential(layer, from_stage_layout(p["layers"], pp, v), jnp.tanh(x @ p["embed"]))
        return xent(h, y, p["head"])

    print(
        f"data: {name} {x_all.shape}, mesh {dict(mesh.shape)}, schedule={args.schedule} V={v} "
        f"M={args.microbatches}, L={args.layers}"
    )
    print(f"bubble fraction: {bubble_fraction(args.schedule, pp, args.microbatches, v):.3f}")
    rng = np.random.default_rng(1)
    data = NamedSharding(mesh, P("dp"))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        for step in range(args.steps):
            idx = rng.choice(len(x_all), batch, replace=False)
            x, y = jax.device_put(x_all[idx], data), jax.device_put(y_all[idx], data)
            if step == 0:
                ref = float(reference_loss(params, x_all[idx], y_all[idx]))
            params, loss = train_step(params, x, y)
            if step == 0:
                print(f"step 0: pipeline loss {float(loss):.6f}, single-device {ref:.6f}")
                assert abs(float(loss) - ref) < 1e-5 * max(1.0, abs(ref))
            if step % 10 == 9 or step == args.steps - 1:
                print(f"step {step + 1:3d}  loss {float(loss):.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
