"""Sharded init of a Flax NNX model (Flax's NNX sharding guide): never build it on one device.

    python examples/nnx_sharded_init.py

The model is written as the Flax guide teaches: logical names on every parameter through
``nnx.with_partitioning``, Flax's eager sharding left on. The guide then creates it inside an
``nnx.jit`` that reads the specs (``nnx.get_partition_spec``), constrains the state and
``nnx.update``s the module, under a mesh context. With shardax the create function is compiled
with the rules as its output shardings, and that is all:

    model, optimizer = mesh.sjit(create, out_shardings=LogicalAxisRules(rules))()

Each device computes only its own shard of every parameter (the random numbers too), so the
compiled init holds about one copy of the per-device state, never the full model; and the same
seed gives the same bits on one device and on any mesh. ``SHARDAX_EXAMPLE_STEPS`` sets the
number of training steps that follow.
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
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax.sharding import LogicalAxisRules, MeshShardingHelper, PartitionSpec  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 20))
DIM, HIDDEN, LAYERS = 256, 1024, 4


# ---- the model, as in the Flax guide (no mesh, no device anywhere) ------------------------------
class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("embed", "hidden")))
        self.down = nnx.Linear(HIDDEN, DIM, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("hidden", "embed")))

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x))) / LAYERS


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def create():
    model = Model(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return model, optimizer, loss


def main():
    # The guide's rules: ('batch', 'data'), ('hidden', 'model'); 'embed' is left replicated.
    mesh = MeshShardingHelper([2, 4], ["data", "model"])
    rules = LogicalAxisRules([("batch", "data"), ("hidden", "model")])

    try:
        Model(nnx.Rngs(0))
    except ValueError as e:
        print(f"eager creation without a mesh fails, as Flax intends: {str(e)[:80]}...")

    init = mesh.sjit(create, out_shardings=rules)
    memory = init.lower().compile().memory_analysis()
    model, optimizer = init()

    params = nnx.state(model, nnx.Param)
    full = sum(x.nbytes for x in jax.tree.leaves(params))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    train_state = sum(x.addressable_shards[0].data.nbytes
                      for x in jax.tree.leaves((params, nnx.state(optimizer))))
    print(f"\n{jax.device_count()} devices, mesh {mesh.shape}")
    up, down = model.blocks[0].up.kernel, model.blocks[0].down.kernel
    print(f"blocks/0/up/kernel   {up.get_metadata('out_sharding')} -> {up[...].sharding.spec}, "
          f"{up[...].shape} split into {up[...].addressable_shards[0].data.shape} per device")
    print(f"blocks/0/down/kernel {down.get_metadata('out_sharding')} -> "
          f"{down[...].sharding.spec}")
    mu = optimizer.opt_state[0].mu["blocks"][0]["up"]["kernel"]
    print(f"Adam mu of up/kernel -> {mu[...].sharding.spec}")
    print(f"params: {full / 2**20:.1f} MiB in all, {per_device / 2**20:.2f} MiB per device; "
          f"params + Adam state per device: {train_state / 2**20:.2f} MiB")
    held = memory.temp_size_in_bytes + memory.output_size_in_bytes
    print(f"compiled init per device: temp {memory.temp_size_in_bytes / 2**20:.2f} MiB + "
          f"output {memory.output_size_in_bytes / 2**20:.2f} MiB "
          f"= {held / train_state:.2f}x the per-device state")

    # Mesh-invariant randomness: the same seed on a single device gives the same bits.
    with nnx.use_eager_sharding(False):
        single = nnx.state(jax.jit(create)()[0], nnx.Param)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(single)))
    print(f"bit-identical to the single-device init: {same}\n")

    batch = PartitionSpec("data")
    step = mesh.sjit(train_step, in_shardings=(rules, rules, batch, batch),
                     out_shardings=(rules, rules, None), donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, DIM)).astype(np.float32)
    y = np.roll(x, 1, axis=1)  # learn to rotate the features by one
    for i in range(STEPS):
        model, optimizer, loss = step(model, optimizer, x, y)
        if i % 4 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
