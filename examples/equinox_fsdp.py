"""FSDP for an Equinox model: rules on plain pytrees, no metadata needed.

    python examples/equinox_fsdp.py

Equinox modules are pytrees whose leaves are arrays *and* other things (activation functions,
sizes). ``sjit`` takes a module whole and keeps those static, as ``eqx.filter_jit`` does
(docs/models_and_rules.md); here it is split the Equinox way instead,
``params, static = eqx.partition(model, eqx.is_array)``: ``params`` goes through ``sjit`` with
an ``FSDPShardingRule`` (which looks only at shapes, so it shards the optax state built from
``params`` the same way), and ``static`` is a static argument (it is hashable). Path rules work
too: the paths are Equinox attribute names, ``layers/0/weight``. ``SHARDAX_EXAMPLE_STEPS`` sets
the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax.sharding import FSDPShardingRule, MeshShardingHelper, PartitionSpec  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 40))
tx = optax.adam(2e-3)


# ---- single-device Equinox code -------------------------------------------------------------
def loss_fn(params, static, x, y):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train_step(params, opt_state, static, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, static, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss


# ---- scaling it -------------------------------------------------------------------------------
def main():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    fsdp = FSDPShardingRule(min_fsdp_size=2**12)  # biases and other small leaves: replicated

    model = eqx.nn.MLP(64, 64, 512, depth=3, activation=jax.nn.gelu, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    params = mesh.sjit(lambda p: p, out_shardings=fsdp)(params)  # onto the mesh, sharded
    opt_state = mesh.sjit(tx.init, out_shardings=fsdp)(params)

    step = mesh.sjit(train_step,
                     in_shardings=(fsdp, fsdp, PartitionSpec("fsdp"), PartitionSpec("fsdp")),
                     out_shardings=(fsdp, fsdp, None),
                     static_argnums=2, donate_argnums=(0, 1))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    y = np.sin(2 * x) * np.cos(np.roll(x, 3, axis=1))  # a smooth function to fit

    print(f"{jax.device_count()} devices, mesh {mesh.shape}\n")
    plan = step.plan(params, opt_state, static, x, y)
    print(plan.where(lambda row: row.kind == "input" and row.path.startswith("params")), "\n")
    for i in range(STEPS):
        params, opt_state, loss = step(params, opt_state, static, x, y)
        if i % 5 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")
    model = eqx.combine(params, static)  # an ordinary Equinox module again, sharded weights
    print(f"\nlayers[1].weight: {model.layers[1].weight.shape}, "
          f"{model.layers[1].weight.sharding.spec}")


if __name__ == "__main__":
    main()
