"""FSDP (ZeRO-3) for a Llama language model with path rules, on 8 devices.

    python examples/llama_fsdp.py

``shardax.models.Llama`` (RMSNorm, RoPE, SwiGLU, grouped-query attention) learns to continue
Python source, byte by byte, from the standard library's own files. The sharding is a
``TreePathShardingRule``: regular expressions on the parameter paths (``params/layers/attn/wq``,
``opt_state/0/mu/layers/attn/wq``...) as in scalax's examples. Because the paths of the Adam
moments end like the parameters' paths, one rule shards parameters, gradients and optimizer
state the same way. The layers are one stack: each layer weight has a leading 'layers' axis,
which the rules keep whole. ``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from functools import partial  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import layout, models  # noqa: E402
from shardax.data.lm_data import TokenBatches, default_corpus, load_bytes  # noqa: E402
from shardax.sharding import LogicalAxisRules, MeshShardingHelper, TreePathShardingRule  # noqa: E402
from shardax.sharding import PartitionSpec as P  # noqa: E402
from shardax.train.step import init_state, train_step  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 40))

# Each matrix is split over 'fsdp' on one dimension; norms are small and stay replicated.
# Scalars (the step, Adam's count) are always replicated.
RULES = TreePathShardingRule(
    ("embed", P(None, "fsdp")),               # [vocab, dim]
    ("attn/(wq|wk|wv)", P(None, "fsdp")),     # [layers, dim, heads, head_dim]
    ("attn/wo", P(None, None, None, "fsdp")), # [layers, heads, head_dim, dim]
    ("mlp/(w_gate|w_up)", P(None, "fsdp")),   # [layers, dim, mlp]
    ("mlp/w_down", P(None, None, "fsdp")),    # [layers, mlp, dim]
    ("lm_head", P("fsdp")),                   # [dim, vocab]
    ("norm", P()),
)


def main():
    mesh = MeshShardingHelper([-1], ["fsdp"])
    config = models.get_config("llama-tiny", n_layers=2)  # 2 layers: quick to compile on CPU
    tx = optax.adam(3e-3)
    create = lambda: models.create(config, nnx.Rngs(0))  # noqa: E731

    graphdef, _ = nnx.split(nnx.eval_shape(create))
    state = mesh.sjit(lambda: init_state(create, tx)[1], out_shardings=RULES)()
    # The model names its activations ('batch', 'length', 'embed'...); these rules say the
    # batch is split over 'fsdp' and the rest is whole, so XLA gathers weights, not activations.
    activations = LogicalAxisRules(layout.PRESETS["fsdp"])
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx),
                     in_shardings=(RULES, P("fsdp")), out_shardings=(RULES, None),
                     logical_axis_rules=activations, donate_argnums=0)

    tokens = load_bytes(default_corpus("train")[:40])
    data = TokenBatches(tokens, seq_len=64, batch_size=16, seed=0)
    batch = next(data)
    print(f"{jax.device_count()} devices, mesh {mesh.shape}, "
          f"{models.param_count(config):,} parameters\n")
    plan = step.plan(state, batch)
    print(plan.where(lambda row: row.kind == "input" and row.path.startswith("state/params")))
    print()
    for i in range(STEPS):
        state, metrics = step(state, batch)
        if i % 5 == 0 or i == STEPS - 1:
            print(f"step {i:3d}  loss {float(metrics['loss']):.4f}")
        batch = next(data)


if __name__ == "__main__":
    main()
