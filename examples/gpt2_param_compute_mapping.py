"""Parameters sharded one way, computation another: Levanter's two axis mappings, for GPT-2.

    python examples/gpt2_param_compute_mapping.py

Levanter trains with two mappings from logical axes to the mesh:

    param_mapping   = {"embed": "data"}   # parameters and optimizer state: FSDP over 'embed'
    compute_mapping = {"batch": "data"}   # activations: split by batch, features whole

Here both are ``LogicalAxisRules``. The train state's in/out shardings use the parameter rules;
the model's activation names (``with_logical_constraint`` inside ``shardax.models.GPT2``) are
mapped by the compute rules (``logical_axis_rules=``); and the gradients, named with
``with_sharding_annotation``, are put back into the parameter layout (``annotation_shardings``),
which is where FSDP reduce-scatters them. Parameters stay float32 and the forward pass runs in
bfloat16 (``Policy``, a jmp-style policy). ``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import models  # noqa: E402
from shardax.data.lm_data import TokenBatches, default_corpus, load_bytes  # noqa: E402
from shardax.precision import Policy  # noqa: E402
from shardax.sharding import (  # noqa: E402
    LogicalAxisRules,
    MeshShardingHelper,
    with_sharding_annotation,
)

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 40))

param_mapping = LogicalAxisRules([("embed", "data")])
compute_mapping = LogicalAxisRules([("batch", "data")])
policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
config = models.get_config("gpt2-tiny", n_layers=2, param_dtype=policy.params, dtype=policy.compute)
tx = optax.adamw(3e-3, weight_decay=0.01)
graphdef, _ = nnx.split(nnx.eval_shape(lambda: models.GPT2(config, nnx.Rngs(0))))


# ---- single-device code (the annotation is a no-op outside sjit) ------------------------------
def init_state():
    params = nnx.state(models.GPT2(config, nnx.Rngs(0)))
    return {"params": params, "opt_state": tx.init(params)}


def train_step(state, inputs, targets):
    def loss_fn(params):
        model = nnx.merge(graphdef, policy.cast_to_compute(params))
        logits = policy.cast_to_output(model(inputs))
        return models.cross_entropy(logits, targets)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    grads = with_sharding_annotation(grads, "params")  # float32, like the parameters
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss


# ---- scaling it -------------------------------------------------------------------------------
def main():
    mesh = MeshShardingHelper([-1], ["data"])
    batch_spec = compute_mapping.spec_for(("batch", "length"), mesh.mesh)
    state = mesh.sjit(init_state, out_shardings=param_mapping)()
    step = mesh.sjit(
        train_step,
        in_shardings=(param_mapping, batch_spec, batch_spec),
        out_shardings=(param_mapping, None),
        logical_axis_rules=compute_mapping,
        annotation_shardings={"params": param_mapping},
        donate_argnums=0,
    )

    print(f"{jax.device_count()} devices, mesh {mesh.shape}, precision {policy}")
    for what, names in [("parameter wte", ("vocab", "embed")),
                        ("parameter w_fc", ("embed", "mlp")),
                        ("activation x", ("batch", "length", "embed")),
                        ("activation mlp hidden", ("batch", "length", "mlp"))]:
        rules = param_mapping if what.startswith("parameter") else compute_mapping
        print(f"  {what:22s} {names!s:28s} -> {rules.spec_for(names, mesh.mesh)}")

    data = TokenBatches(load_bytes(default_corpus("train")[:40]), seq_len=64, batch_size=16)
    batch = next(data)
    plan = step.plan(state, *batch)
    print(plan.where(lambda row: row.kind == "input" and "layers/mlp" in row.path
                     and "opt_state" not in row.path))
    print()
    for i in range(STEPS):
        state, loss = step(state, *batch)
        if i % 5 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")
        batch = next(data)
    w = state["params"]["layers"]["mlp"]["w_fc"]  # [layers, embed, mlp]
    print(f"\nw_fc after training: {w.dtype}, {w[...].sharding.spec}")


if __name__ == "__main__":
    main()
