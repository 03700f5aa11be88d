"""The train step for an NNX language model, as pure functions of a train-state pytree.

The train state is a `TrainState` ``(params, rest, opt_state, step)``: NNX parameters
(``nnx.State`` with their logical-name metadata, so one ``LogicalAxisRules`` shards parameters,
gradients and optimizer moments alike), the model's other state, the optax state and the step
counter.

The loss is the model's ``training_loss`` and follows the mesh: on a 'cp' axis the tokens,
targets and RoPE positions are put in ``load_balance`` order once (so ring attention gives
every device equal work, and the mean loss needs no undoing), and an MoE model's
load-balancing loss, weighted by ``moe_aux_weight``, is added to the cross-entropy.

>>> from shardax.models import CONFIGS
>>> graphdef, state = init_state(lambda: Llama(CONFIGS["llama-tiny"], nnx.Rngs(0)),
...                              optax.sgd(0.1))
>>> batch = (jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))
>>> state, metrics = train_step(state, batch, graphdef=graphdef, tx=optax.sgd(0.1))
>>> int(state.step), metrics["loss"].shape
(1, ())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.constraints import with_sharding_constraint
from shardax.logical import with_logical_constraint
from shardax.models import Llama, embedding
from shardax.models._layers import remat_policy
from shardax.parallel import axis_size, fsdp, load_balance, to_microbatches
from shardax.precision import Policy
from shardax.train import packing

__all__ = ["FSDP_MODES", "TrainState", "init_state", "train_step", "eval_loss", "make_optimizer",
           "make_schedule"]

FULL_PRECISION = Policy()
# 'xla': FSDP from the parameter shardings, left to the partitioner; 'explicit': ZeRO-3 written
# out (shardax.parallel.fsdp): per-layer gathers and reduce-scatters under a shard_map.
FSDP_MODES = ("xla", "explicit")


class TrainState(NamedTuple):
    """The train state, a pytree; its tree paths (``params.…``, ``rest.…``, ``opt_state.…``,
    ``step``) are the keys a checkpoint stores, as they were when the state was a dict."""

    params: Any
    rest: Any
    opt_state: Any
    step: Any


def make_schedule(name: str, lr: float, steps: int, warmup: int = 0) -> optax.Schedule:
    """The learning rate ``make_optimizer(name, ...)`` applies at each update (0-based count):
    constant for ``sgd``, linear warm-up then cosine decay to ``lr / 10`` for ``adamw``."""
    if name == "sgd":
        return optax.constant_schedule(lr)
    if name == "adamw":
        warmup = max(warmup, 1)  # the decay needs >= 1 step after the warm-up: --steps 1 works
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1
        )
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'sgd'")


def make_optimizer(
    name: str, lr: float, steps: int, warmup: int = 0
) -> optax.GradientTransformation:
    """``adamw`` (cosine decay after a linear warm-up, clipped at norm 1) or plain ``sgd``."""
    schedule = make_schedule(name, lr, steps, warmup)
    if name == "sgd":
        return optax.sgd(lr)
    adamw = optax.adamw(schedule, weight_decay=0.01)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def init_state(create: Callable[[], nnx.Module], tx: optax.GradientTransformation):
    """``(graphdef, state)`` of a fresh model and optimizer. Call it inside ``sjit`` (with the
    rules as ``out_shardings``) to create the state directly in its sharded layout."""
    graphdef, params, rest = nnx.split(create(), nnx.Param, ...)
    return graphdef, TrainState(params, rest, tx.init(params), jnp.int32(0))


def _loss(params, rest, graphdef, inputs, targets, policy: Policy, weights=None,
          end_id: int | None = None):
    """``(training loss, cross-entropy)``; they differ by an MoE model's auxiliary loss. Every
    shardax language model has ``training_loss`` (``shardax.models``)."""
    model = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
    inputs, targets, kwargs = _with_positions(inputs, targets, weights, end_id)
    return model.training_loss(inputs, targets, cast=policy.cast_to_output, **kwargs)


def _with_positions(inputs, targets, weights=None, end_id: int | None = None) -> tuple:
    """``(inputs, targets, kwargs)``, ``kwargs`` the rest of ``training_loss``'s arguments:
    RoPE ``positions`` and ``load_balanced``, and with packed documents (``end_id``: the
    end-of-text id) ``segment_ids`` and ``loss_weights`` (``weights``, else those of these
    rows alone); with a 'cp' axis, all in ring attention's load-balanced order."""
    cp = axis_size("cp")
    if end_id is None:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        docs = {}
    else:
        segment_ids, positions, mask = packing.documents(inputs, end_id)
        docs = {"segment_ids": segment_ids,
                "loss_weights": packing.loss_weights(mask) if weights is None else weights}
    if cp > 1:
        inputs, targets, positions = (load_balance(a, cp) for a in (inputs, targets, positions))
        docs = {k: load_balance(a, cp) for k, a in docs.items()}
    return inputs, targets, {"positions": positions, "load_balanced": cp > 1, **docs}


def _explicit_fsdp(state, batch, graphdef, policy: Policy, grad_accum, param_rules,
                   end_id: int | None, recompute: bool = True):
    """``(loss, grads)`` under explicit ZeRO-3 FSDP over 'fsdp' (HSDP over 'dp'): the stacked
    layers are gathered one at a time (in the compute dtype) and their gradients reduce-scattered
    in float32; the other parameters (embedding, head, final norm) are gathered once."""
    if param_rules is None:
        raise ValueError("fsdp_mode='explicit' needs param_rules (the parameters' sharding)")
    rest = state.rest
    # An untied embedding table stays sharded: each device looks up its own columns of the
    # tokens of its FSDP group and the rows move (embedding.lookup_manual), not the table. A
    # tied one is gathered for the head anyway.
    untied = "lm_head" in state.params
    local = ("layers", "embed") if untied else ("layers",)
    table_dim = fsdp.fsdp_dim(param_rules.spec_for(("vocab", "embed")))

    def lookup(table, tokens):
        if policy.compute is not None:
            table = table.astype(policy.compute)
        return embedding.lookup_manual(table, tokens, "fsdp", table_dim)

    def loss_fn(gather, params, inputs, targets, *weights):
        top = jax.tree_util.tree_map_with_path(
            lambda path, leaf: gather.local(leaf) if _key(path) in local else gather(leaf),
            params, is_leaf=lambda x: not isinstance(x, (dict, nnx.State)))
        model = nnx.merge(graphdef, top, rest)
        if not isinstance(model, Llama):
            raise ValueError("fsdp_mode='explicit' needs a llama model")
        c = model.config
        # With ``recompute`` each layer is recomputed in the backward pass (that is what
        # frees its gathered parameters); a remat policy that saves more (dots) applies within
        # it. Without, the gathered layers are kept from forward to backward.
        policy_ = remat_policy(c.remat) if c.remat not in ("none", "full") else None
        layers = params["layers"]
        keep = dict(policy=policy_, reshard_after_forward=recompute or c.remat != "none")

        def stack(layer_fn, x):
            if c.scan_layers:
                return fsdp.scan_layers(gather, layer_fn, layers, x, **keep)
            return fsdp.loop_layers(gather, layer_fn, [layers[i] for i in range(c.n_layers)],
                                    x, **keep)

        inputs, targets, kwargs = _with_positions(inputs, targets, *weights, end_id=end_id)
        return model.training_loss(inputs, targets, cast=policy.cast_to_output, stack=stack,
                                   lookup=lookup if untied else None, **kwargs)[0]

    return fsdp.value_and_grad(
        loss_fn, state.params, param_rules.apply(state.params), *batch,
        grad_accum=grad_accum, dtype=policy.compute, reduce_dtype=jnp.float32)


def _key(path) -> str:
    """The first key of a tree path, as a string."""
    k = path[0]
    return str(getattr(k, "key", getattr(k, "name", k)))


def train_step(
    state: TrainState,
    batch: tuple[jax.Array, jax.Array],
    *,
    graphdef: Any,
    tx: optax.GradientTransformation,
    policy: Policy = FULL_PRECISION,
    grad_accum: int = 1,
    param_rules: Any = None,
    fsdp_mode: str = "xla",
    end_id: int | None = None,
    fsdp_recompute: bool = True,
) -> tuple[TrainState, dict]:
    """One optimizer step over ``batch = (inputs, targets)``, optionally in ``grad_accum``
    microbatches accumulated in the parameter dtype and (with ``param_rules``) sharding.
    ``metrics["loss"]`` is the training objective (cross-entropy plus any MoE loss).
    ``fsdp_mode='explicit'`` computes loss and gradients with ``shardax.parallel.fsdp``
    (a dense llama; ``param_rules`` give the parameters' sharding; gradients
    of the microbatches are reduce-scattered one by one into a sharded float32 accumulator).
    ``fsdp_recompute=False`` (explicit, with ``remat='none'``): the gathered layers are kept
    from forward to backward instead of re-gathered and recomputed (more memory, fewer FLOPs).

    ``end_id``: packed documents (``--pack documents``): the rows' documents end with this
    token id; attention and RoPE positions restart after it and the loss is the mean over the
    batch's targets that do not start a new document (``shardax.train.packing``). None: the
    rows are one stream."""
    if fsdp_mode not in FSDP_MODES:
        raise ValueError(f"fsdp_mode must be one of {FSDP_MODES}, got {fsdp_mode!r}")
    inputs, targets = batch
    if end_id is not None:  # weights of the whole batch: any split of it averages to its mean
        batch = (inputs, targets, packing.loss_weights(packing.documents(inputs, end_id)[2]))
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    if fsdp_mode == "explicit":
        loss, grads = _explicit_fsdp(state, batch, graphdef, policy, grad_accum, param_rules,
                                     end_id, fsdp_recompute)
    elif grad_accum == 1:
        (loss, _), grads = grad_fn(state.params, state.rest, graphdef, *batch[:2], policy,
                                   *batch[2:], end_id=end_id)
    else:
        def accumulate(carry, micro):
            loss_sum, grad_sum = carry
            micro = [with_logical_constraint(a, ("batch", "length")) for a in micro]
            (loss, _), grads = grad_fn(state.params, state.rest, graphdef, *micro[:2],
                                       policy, *micro[2:], end_id=end_id)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            if param_rules is not None:
                grad_sum = with_sharding_constraint(grad_sum, param_rules)
            return (loss_sum + loss, grad_sum), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        micro = tuple(to_microbatches(a, grad_accum) for a in batch)
        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros), micro)
        loss = loss / grad_accum
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state._replace(params=params, opt_state=opt_state, step=state.step + 1)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def eval_loss(state: TrainState, batch: tuple[jax.Array, jax.Array], *, graphdef: Any,
              policy: Policy = FULL_PRECISION, end_id: int | None = None) -> jax.Array:
    """Mean cross-entropy of ``batch`` under the current parameters (without the MoE loss);
    ``end_id`` as for `train_step`."""
    return _loss(state.params, state.rest, graphdef, *batch, policy, end_id=end_id)[1]
