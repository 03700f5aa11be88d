"""Flax linen with logical axis names (Flax's "Scale up on multiple devices" guide).

    python examples/linen_logical.py

The guide's ``LogicalMLP`` as written there: ``nn.with_logical_partitioning`` on the kernels,
``nn.with_logical_constraint`` on activations, ``nn.scan`` over layers with a 'layer' axis, and
a ``flax.training.train_state.TrainState``. The guide then needs ``nn.get_partition_spec``,
``nn.logical_to_mesh_sharding`` and a ``jax.jit`` with ``static_argnums`` per function; here the
same rules become one ``LogicalAxisRules`` given to ``sjit``, which shards params, optimizer
state and (through Flax's rule context, which ``sjit`` sets from the same rules) the activations.
``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from collections.abc import Callable  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

from shardax.sharding import LogicalAxisRules, MeshShardingHelper, PartitionSpec  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 30))
LAYERS, DEPTH, DIM, BATCH = 4, 256, 128, 64


# ---- the guide's model, unchanged -----------------------------------------------------------
class LogicalDotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.depth,
                     kernel_init=nn.with_logical_partitioning(self.dense_init, ("embed", "hidden")),
                     use_bias=False)(x)
        y = jax.nn.relu(y)
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        w2 = self.param("W2", nn.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, w2) / 4.0  # scaled so a deep residual-free stack stays well conditioned
        z = nn.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class LogicalMLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(LogicalDotReluDot, length=self.num_layers,
                           variable_axes={"params": 0}, split_rngs={"params": True},
                           metadata_params={nn.PARTITION_NAME: "layer"})(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = LogicalDotReluDot(self.depth)(x)
        return x


# ---- single-device training code ---------------------------------------------------------------
model = LogicalMLP(LAYERS, DEPTH, use_scan=True)
tx = optax.adam(1e-2)


def init_fn(key, x):
    params = model.init(key, x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# ---- scaling it: the guide's rules, as shardax rules --------------------------------------------
def main():
    mesh = MeshShardingHelper([2, 4], ["data", "model"])
    rules = LogicalAxisRules([("batch", "data"), ("hidden", "model")])  # the guide's rules
    batch = PartitionSpec("data")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    target_map = rng.normal(size=(DIM, DIM)).astype(np.float32) / np.sqrt(DIM)
    y = np.tanh(x @ target_map)  # learn a fixed nonlinear map

    state = mesh.sjit(init_fn, out_shardings=rules)(jax.random.key(0), x)
    kernel = state.params["ScanLogicalDotReluDot_0"]["Dense_0"]["kernel"]
    print(f"{jax.device_count()} devices, mesh {mesh.shape}")
    print(f"kernel: {type(kernel).__name__}, names {kernel.names}, shape {kernel.value.shape}, "
          f"sharding {kernel.value.sharding.spec}")
    w2 = state.params["ScanLogicalDotReluDot_0"]["W2"]
    print(f"W2:     names {w2.names}, sharding {w2.value.sharding.spec}")
    mu = state.opt_state[0].mu["ScanLogicalDotReluDot_0"]["W2"]
    print(f"Adam mu of W2: {mu.value.sharding.spec}\n")

    step = mesh.sjit(train_step, in_shardings=(rules, batch, batch),
                     out_shardings=(rules, None), donate_argnums=0)
    # The rules include a LogicalAxisRules, so while sjit traces, Flax's own rule context is
    # set from them too: nn.with_logical_constraint in the model follows the same rules.
    plan = step.plan(state, x, y)
    print(plan.where(lambda row: row.kind == "input" and "state/params" in row.path), "\n")
    for i in range(STEPS):
        state, loss = step(state, x, y)
        if i % 5 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(loss):.5f}")


if __name__ == "__main__":
    main()
