"""GRPO on a verifiable toy reward: a tiny Llama learns to answer in digits, on an fsdp x tp mesh.

    python examples/grpo_toy.py

A randomly initialised byte-level Llama (``llama-tiny`` shapes, 2 layers) is post-trained
with GRPO (`shardax.train.post.grpo`, TRL's algorithm and metric names): each step samples
``group_size`` completions of each prompt with the sharded KV-cache decoder, scores them with
a reward function written as for TRL (``digits``: the fraction of the completion's bytes
that are digits), and takes a clipped policy-gradient step on the group-normalised
advantages. Rollouts and updates run on the same 8-device mesh (fsdp=4 x tp=2). The mean
reward starts near the chance rate of a digit byte (10 / 256) and rises.
``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import layout, models  # noqa: E402
from shardax.data.tokenizer import load_tokenizer  # noqa: E402
from shardax.sharding import LogicalAxisRules, MeshShardingHelper  # noqa: E402
from shardax.train.post.grpo import GRPOConfig, train_grpo  # noqa: E402
from shardax.train.post.rewards import RewardSet  # noqa: E402
from shardax.train.step import init_state  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 20))
PROMPTS = [f"{a}+{b}=" for a, b in [(2, 3), (7, 1), (4, 4), (9, 5), (1, 8), (6, 2)]]


def digits(prompts, completions, **fields):
    """The fraction of each completion's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def main():
    mesh = MeshShardingHelper([-1, 2], ["fsdp", "tp"])
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    config = models.get_config("llama-tiny", n_layers=2)
    tx = optax.adam(3e-2)
    create = lambda: models.create(config, nnx.Rngs(0))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(create))
    state = mesh.sjit(lambda: init_state(create, tx)[1], out_shardings=rules)()
    settings = GRPOConfig(group_size=8, prompts_per_step=2, max_new_tokens=8,
                          temperature=1.0, beta=0.04, num_iterations=2)
    print(f"{jax.device_count()} devices, mesh {mesh.shape}, "
          f"{models.param_count(config):,} parameters; {settings.prompts_per_step} prompts x "
          f"{settings.group_size} completions of {settings.max_new_tokens} bytes per step\n")

    def show(step, state, metrics):
        print(f"step {step:3d}  reward {metrics['reward']:.3f}  reward_std "
              f"{metrics['reward_std']:.3f}  kl {metrics['kl']:.4f}  clip_ratio "
              f"{metrics['clip_ratio']:.3f}  completion_length "
              f"{metrics['completion_length']:.1f}", flush=True)

    start = time.perf_counter()
    _, history = train_grpo(graphdef, state, load_tokenizer("bytes"), PROMPTS,
                            RewardSet([digits]), tx=tx, steps=STEPS, settings=settings,
                            mesh=mesh, rules=rules, on_step=show)
    third = max(len(history) // 3, 1)
    first = sum(m["reward"] for m in history[:third]) / third
    last = sum(m["reward"] for m in history[-third:]) / third
    print(f"\n{len(history)} steps in {time.perf_counter() - start:.1f}s; mean reward of the "
          f"first {third} steps {first:.3f}, of the last {third} steps {last:.3f}")
    final = history[-1]  # the first steps' speeds include compiling
    print(f"last step: generation {final['tokens_per_s/generation']:.0f} tokens/s, training "
          f"{final['tokens_per_s/train']:.0f} tokens/s")


if __name__ == "__main__":
    main()
