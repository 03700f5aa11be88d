"""The Levanter document's GPT-2 in Haliax named tensors, scaled with shardax rules on data x model.

    python examples/haliax_gpt2.py

The model and train step are the single-device code of the Levanter design document (seed 003):
``hax.Axis`` everywhere, ``hnn.Linear`` with several output axes, a ``Stacked`` stack of blocks
with dropout, ``hax.vmap`` over the batch, ``eqx.filter_value_and_grad``. Scaling it needs no
change to that code: the model goes to ``mesh.sjit`` whole (its Python fields, such as
``Dropout.inference``, stay static, as under ``eqx.filter_jit``), and two mappings from its own
axis names to the mesh decide the layout, as in Levanter:

    param_mapping   = {"embed": "data", "mlp": "model", "heads": "model"}  # FSDP + tensor parallel
    compute_mapping = {"batch": "data", "mlp": "model", "heads": "model"}  # activations

The parameter rules shard the model and its optimizer state (every ``NamedArray`` by its axis
names, exactly as ``haliax.partitioning.infer_resource_partitions`` does); the compute mapping is
Haliax's ``axis_mapping`` while the step traces, so the model's own ``hax.auto_sharded`` calls
constrain its activations. The script trains the same model on one device and on the 8-device
mesh and prints both losses. ``SHARDAX_EXAMPLE_STEPS`` sets the number of steps.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # drop this line to run on your GPUs / TPUs
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import haliax.nn as hnn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from haliax import Axis, NamedArray  # noqa: E402

from shardax.sharding import LogicalAxisRules, MeshShardingHelper, PartitionSpec  # noqa: E402

STEPS = int(os.environ.get("SHARDAX_EXAMPLE_STEPS", 20))


# ---- the model: single-device Haliax code (seed 003) ----------------------------------------
@dataclass(frozen=True)
class Gpt2Config:
    seq_len: int = 16
    vocab_size: int = 64
    hidden_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    mlp_scale: int = 4
    dropout: float = 0.1
    shard_activations: bool = True  # the blocks' own hax.auto_sharded calls

    Pos = property(lambda self: Axis("position", self.seq_len))
    KeyPos = property(lambda self: Axis("key_position", self.seq_len))
    Vocab = property(lambda self: Axis("vocab", self.vocab_size))
    Embed = property(lambda self: Axis("embed", self.hidden_dim))
    Heads = property(lambda self: Axis("heads", self.num_heads))
    HeadDim = property(lambda self: Axis("head_dim", self.hidden_dim // self.num_heads))
    Mlp = property(lambda self: Axis("mlp", self.hidden_dim * self.mlp_scale))
    Layers = property(lambda self: Axis("layers", self.num_layers))


class Gpt2Attention(eqx.Module):
    c_attn: hnn.Linear  # [embed] -> [qkv, heads, head_dim]
    c_proj: hnn.Linear  # [heads, head_dim] -> [embed]
    dropout: hnn.Dropout
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Attention":
        k_c, k_proj = jax.random.split(key)
        qkv = Axis("qkv", 3)
        c_attn = hnn.Linear.init(In=config.Embed, Out=(qkv, config.Heads, config.HeadDim),
                                 key=k_c)
        c_proj = hnn.Linear.init(In=(config.Heads, config.HeadDim), Out=config.Embed, key=k_proj)
        return Gpt2Attention(c_attn, c_proj, hnn.Dropout(config.dropout), config)

    def __call__(self, x: NamedArray, *, inference: bool, key) -> NamedArray:
        c = self.config
        q, k, v = self.c_attn(x).unbind("qkv")
        k = k.rename({c.Pos: c.KeyPos})
        v = v.rename({c.Pos: c.KeyPos})
        scores = hax.dot(q, k, axis=c.HeadDim) * jax.lax.rsqrt(float(c.HeadDim.size))
        causal = hax.tril(hax.ones((c.Pos, c.KeyPos), dtype=bool), c.Pos, c.KeyPos)
        scores = hax.where(causal, scores, -1e9)
        weights = hnn.softmax(scores, axis=c.KeyPos)
        weights = self.dropout(weights, key=key, inference=inference)
        return self.c_proj(hax.dot(weights, v, axis=c.KeyPos))


class Gpt2Mlp(eqx.Module):
    c_fc: hnn.Linear  # [embed] -> [mlp]
    c_proj: hnn.Linear  # [mlp] -> [embed]
    act: Callable = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Mlp":
        k_fc, k_proj = jax.random.split(key)
        return Gpt2Mlp(hnn.Linear.init(In=config.Embed, Out=config.Mlp, key=k_fc),
                       hnn.Linear.init(In=config.Mlp, Out=config.Embed, key=k_proj),
                       hnn.gelu)

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.c_proj(self.act(self.c_fc(x)))


class Gpt2Block(eqx.Module):
    ln_1: hnn.LayerNorm
    attn: Gpt2Attention
    ln_2: hnn.LayerNorm
    mlp: Gpt2Mlp
    resid_dropout: hnn.Dropout
    shard_activations: bool  # a plain field: a Python bool leaf of the module

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Block":
        k_attn, k_mlp = jax.random.split(key)
        return Gpt2Block(hnn.LayerNorm.init(config.Embed),
                         Gpt2Attention.init(config, key=k_attn),
                         hnn.LayerNorm.init(config.Embed),
                         Gpt2Mlp.init(config, key=k_mlp),
                         hnn.Dropout(config.dropout), config.shard_activations)

    def __call__(self, x: NamedArray, inference: bool, *, key) -> NamedArray:
        k1, k2, k3 = hax.jax_utils.maybe_rng_split(key, 3)
        attn = self.attn(self.ln_1(x), inference=inference, key=k1)
        x = x + self.resid_dropout(attn, key=k2, inference=inference)
        ff = self.mlp(self.ln_2(x))
        x = x + self.resid_dropout(ff, key=k3, inference=inference)
        return hax.auto_sharded(x) if self.shard_activations else x


class Gpt2LMHeadModel(eqx.Module):
    token_embeddings: hnn.Embedding
    position_embeddings: hnn.Embedding
    blocks: hnn.Stacked[Gpt2Block]
    ln_f: hnn.LayerNorm
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2LMHeadModel":
        k_tok, k_pos, k_blocks = jax.random.split(key, 3)
        return Gpt2LMHeadModel(
            hnn.Embedding.init(config.Vocab, config.Embed, key=k_tok),
            hnn.Embedding.init(config.Pos, config.Embed, key=k_pos),
            hnn.Stacked.init(config.Layers, Gpt2Block)(
                config, key=jax.random.split(k_blocks, config.num_layers)),
            hnn.LayerNorm.init(config.Embed),
            config,
        )

    def __call__(self, input_ids: NamedArray, *, inference: bool, key) -> NamedArray:
        c = self.config
        x = self.token_embeddings(input_ids) + self.position_embeddings.weight
        keys = hax.jax_utils.maybe_rng_split(key, c.num_layers)
        x = self.ln_f(self.blocks.fold(x, inference, key=keys))
        return hax.dot(x, self.token_embeddings.weight, axis=c.Embed)  # tied head: [pos, vocab]


def next_token_loss(config: Gpt2Config, logits: NamedArray, input_ids: NamedArray) -> NamedArray:
    targets = hax.roll(input_ids, -1, config.Pos)
    not_last = hax.arange(config.Pos) < config.seq_len - 1
    return hnn.cross_entropy_loss(logits, config.Vocab, hnn.one_hot(targets, config.Vocab),
                                  reduction=hax.mean, where=not_last)


def make_train_step(config: Gpt2Config, optimizer: optax.GradientTransformation):
    """The seed's train step: per-example loss under ``hax.vmap``, Equinox gradients."""

    def compute_loss(model, input_ids, key, inference):
        return next_token_loss(config, model(input_ids, key=key, inference=inference), input_ids)

    def train_batch_loss(model, input_ids, keys):
        per_example = hax.vmap(compute_loss, "batch")(model, input_ids, keys, inference=False)
        return hax.mean(per_example, "batch").scalar()

    def train_step(model, opt_state, input_ids, keys):
        loss, grads = eqx.filter_value_and_grad(train_batch_loss)(model, input_ids, keys)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    return train_step


def init_opt_state(optimizer: optax.GradientTransformation):
    """The optimizer state of a model's arrays (the Equinox idiom: its Python fields have none)."""
    return lambda model: optimizer.init(eqx.filter(model, eqx.is_array))


def batches(config: Gpt2Config, batch_size: int, steps: int, seed: int = 0):
    """Token ids (counting up from a random start: a pattern to learn) and per-example
    dropout keys for each step: the same on any mesh."""
    rng = np.random.default_rng(seed)
    Batch = Axis("batch", batch_size)
    key = jax.random.key(seed)
    for _ in range(steps):
        starts = rng.integers(0, config.vocab_size, size=(batch_size, 1))
        ids = ((starts + np.arange(config.seq_len)) % config.vocab_size).astype(np.int32)
        key, step_key = jax.random.split(key)
        yield hax.named(ids, (Batch, config.Pos)), jax.random.split(step_key, batch_size)


# ---- scaling it -------------------------------------------------------------------------------
param_mapping = {"embed": "data", "mlp": "model", "heads": "model"}
compute_mapping = {"batch": "data", "mlp": "model", "heads": "model"}


def train_sharded(mesh: MeshShardingHelper, config: Gpt2Config, optimizer, steps: int,
                  batch_size: int = 8, params=None, compute=compute_mapping):
    """The model, its optimizer state and the losses of ``steps`` steps on ``mesh``.

    ``params`` shards the model and optimizer state (default ``LogicalAxisRules`` from
    ``param_mapping``; Haliax's dict itself works as the rule too); ``compute`` is Haliax's
    axis mapping while the step traces (None: ``params``'s, as under
    ``hax.named_jit(axis_resources=param_mapping)``).
    """
    params = LogicalAxisRules(param_mapping) if params is None else params
    batch = LogicalAxisRules(compute_mapping).spec_for(("batch", "position"), mesh.mesh)
    model = mesh.sjit(lambda key: Gpt2LMHeadModel.init(config, key=key),
                      out_shardings=params)(jax.random.key(0))
    opt_state = mesh.sjit(init_opt_state(optimizer), out_shardings=params)(model)
    step = mesh.sjit(make_train_step(config, optimizer),
                     in_shardings=(params, params, batch, PartitionSpec("data")),
                     out_shardings=(None, params, params),
                     logical_axis_rules=compute)
    losses = []
    for input_ids, keys in batches(config, batch_size, steps):
        loss, model, opt_state = step(model, opt_state, input_ids, keys)
        losses.append(float(loss))
    return model, opt_state, losses


def train_one_device(config: Gpt2Config, optimizer, steps: int, batch_size: int = 8):
    """The same training with plain ``eqx.filter_jit`` on one device."""
    with jax.default_device(jax.devices()[0]):
        model = eqx.filter_jit(lambda key: Gpt2LMHeadModel.init(config, key=key))(
            jax.random.key(0))
        opt_state = eqx.filter_jit(init_opt_state(optimizer))(model)
        step = eqx.filter_jit(make_train_step(config, optimizer))
        losses = []
        for input_ids, keys in batches(config, batch_size, steps):
            loss, model, opt_state = step(model, opt_state, input_ids, keys)
            losses.append(float(loss))
    return model, opt_state, losses


def main():
    config = Gpt2Config()
    optimizer = optax.adamw(3e-3)
    mesh = MeshShardingHelper([-1, 2], ["data", "model"])
    print(f"{jax.device_count()} devices, mesh {mesh.shape}\n")
    model, opt_state, losses = train_sharded(mesh, config, optimizer, STEPS)
    _, _, reference = train_one_device(config, optimizer, STEPS)
    for path, spec in [("blocks.stacked.mlp.c_fc.weight", model.blocks.stacked.mlp.c_fc.weight),
                       ("blocks.stacked.attn.c_attn.weight",
                        model.blocks.stacked.attn.c_attn.weight),
                       ("token_embeddings.weight", model.token_embeddings.weight)]:
        print(f"{path}: axes {spec.axis_names} -> {spec.array.sharding.spec}")
    mu = opt_state[0].mu.blocks.stacked.mlp.c_fc.weight
    print(f"Adam mu of c_fc: {mu.array.sharding.spec}\n")
    for i, (loss, ref) in enumerate(zip(losses, reference)):
        print(f"step {i:3d}  loss {loss:.5f}   one device {ref:.5f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    print(f"\nlargest relative difference from one device: {worst:.1e} "
          f"(equal within 1e-5: {worst <= 1e-5})")


if __name__ == "__main__":
    main()
