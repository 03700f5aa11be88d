"""Data parallelism: an NNX MLP that guesses the next byte of Python source, on 8 devices.

    python examples/mlp_data_parallel.py

Real data, no download: the Python standard library's own source files (the corpus of
``shardax train``). Each example is the previous 8 bytes of a file (one-hot) and its label is the
byte that follows: a 256-way classifier that learns a byte 8-gram model of Python code.

Data parallelism is one rule: the ``dp`` preset puts the logical 'batch' axis on the mesh and
replicates every parameter (so each device computes the gradient of its share of the batch and
XLA all-reduces them). ``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import layout, models  # noqa: E402
from shardax.data.lm_data import default_corpus, load_bytes  # noqa: E402
from shardax.sharding import LogicalAxisRules, MeshShardingHelper  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 60))
CONTEXT, BATCH = 8, 512


# ---- single-device code ---------------------------------------------------------------------
def features(context: jax.Array) -> jax.Array:
    """[batch, CONTEXT] bytes -> [batch, CONTEXT * 256] one-hot."""
    return jax.nn.one_hot(context, 256).reshape(context.shape[0], -1)


def train_step(model, optimizer, context, label):
    def loss_fn(model):
        logits = model(features(context))
        return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, optimizer, loss


def eval_loss(model, context, label):
    logits = model(features(context))
    return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()


def batches(tokens: np.ndarray, seed: int):
    """Random (context, next byte) pairs, BATCH at a time."""
    rng = np.random.default_rng(seed)
    while True:
        ends = rng.integers(CONTEXT, len(tokens), size=BATCH)
        context = tokens[ends[:, None] - np.arange(CONTEXT, 0, -1)]
        yield context.astype(np.int32), tokens[ends].astype(np.int32)


# ---- scaling it: a mesh and one rule --------------------------------------------------------
def main():
    train_tokens = load_bytes(default_corpus("train")[:60])
    val_tokens = load_bytes(default_corpus("val")[:10])
    print(f"data: {len(train_tokens):,} training bytes and {len(val_tokens):,} held-out bytes "
          f"of Python stdlib source")

    mesh = MeshShardingHelper([-1], ["dp"])
    rules = LogicalAxisRules(layout.PRESETS["dp"])  # 'batch' -> ('dp', 'fsdp'); params: replicated
    batch_spec = rules.spec_for(("batch",), mesh.mesh)

    def create():
        model = models.MLP(din=CONTEXT * 256, dhidden=256, dout=256, depth=2, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(2e-3), wrt=nnx.Param)

    model, optimizer = mesh.sjit(create, out_shardings=rules)()
    step = mesh.sjit(train_step, in_shardings=(rules, rules, batch_spec, batch_spec),
                     out_shardings=(rules, rules, None), donate_argnums=(0, 1))
    evaluate = mesh.sjit(eval_loss, in_shardings=(rules, batch_spec, batch_spec))

    data, val = batches(train_tokens, seed=0), batches(val_tokens, seed=1)
    val_set = [next(val) for _ in range(4)]
    first = next(data)
    print(f"{jax.device_count()} devices, mesh {mesh.shape}\n")
    plan = step.plan(model, optimizer, *first)
    print(plan.where(lambda row: row.kind == "input" and "opt_state" not in row.path), "\n")
    for i in range(STEPS):
        model, optimizer, loss = step(model, optimizer, *(first if i == 0 else next(data)))
        if i % 10 == 0 or i == STEPS - 1:
            val_loss = np.mean([float(evaluate(model, *b)) for b in val_set])
            print(f"step {i:3d}  loss {float(loss):.4f}  held-out loss {val_loss:.4f}")


if __name__ == "__main__":
    main()
