"""The train step for an NNX language model, as pure functions of a train-state pytree.

The train state is a `TrainState` ``(params, rest, opt_state, step)``: NNX parameters
(``nnx.State`` with their logical-name metadata, so one ``LogicalAxisRules`` shards parameters,
gradients and optimizer moments alike), the model's other state, the optax state and the step
counter.

The loss is `shardax.layout.forward.training_loss` of the model under a `Layout` and follows
the mesh: on a 'cp' axis the tokens, targets and RoPE positions are put in ``load_balance``
order once (so ring attention gives every device equal work, and the mean loss needs no
undoing), and an MoE model's load-balancing loss, weighted by ``moe_aux_weight``, is added to
the cross-entropy.

>>> from shardax.models import CONFIGS, Llama
>>> graphdef, state = init_state(lambda: Llama(CONFIGS["llama-tiny"], nnx.Rngs(0)),
...                              optax.sgd(0.1))
>>> batch = (jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))
>>> state, metrics = train_step(state, batch, graphdef=graphdef, tx=optax.sgd(0.1))
>>> int(state.step), metrics["loss"].shape
(1, ())
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.data import packing
from shardax.layout import forward
from shardax.layout.spec import Layout
from shardax.models.lora import trainable
from shardax.parallel import axis_size, load_balance
from shardax.precision import Policy
from shardax.train import balance

__all__ = ["TrainState", "apply_gradients", "eval_loss", "init_state", "train_step"]

FULL_PRECISION = Policy()
ONE_DEVICE = Layout()  # the default layout: the rules and XLA decide everything


class TrainState(NamedTuple):
    """The train state, a pytree; its tree paths (``params.…``, ``rest.…``, ``opt_state.…``,
    ``step``) are the keys a checkpoint stores, as they were when the state was a dict."""

    params: Any
    rest: Any
    opt_state: Any
    step: Any


def init_state(create: Callable[[], nnx.Module], tx: optax.GradientTransformation):
    """``(graphdef, state)`` of a fresh model and optimizer. Call it inside ``sjit`` (with the
    rules as ``out_shardings``) to create the state directly in its sharded layout."""
    model = create()
    # Under LoRA only the adapters train: the frozen base joins the model's other state.
    graphdef, params, rest = nnx.split(model, trainable(getattr(model, "config", None)), ...)
    return graphdef, TrainState(params, rest, tx.init(params), jnp.int32(0))


def _with_weights(batch: tuple, end_id: int | None) -> tuple:
    """``(inputs, targets, *extra)``: a packed-conversation batch ``(inputs, targets,
    segment_ids, loss_mask)`` becomes ``(inputs, targets, weights, segment_ids)``; packed
    documents (``end_id``) get the weights of the whole batch; else the batch is unchanged."""
    inputs, targets = batch[:2]
    if len(batch) == 4:
        return inputs, targets, packing.loss_weights(batch[3]), batch[2]
    if end_id is not None:  # weights of the whole batch: any split of it averages to its mean
        return inputs, targets, packing.loss_weights(packing.documents(inputs, end_id)[2])
    return tuple(batch)


def _with_positions(inputs, targets, weights=None, segment_ids=None, *,
                    end_id: int | None = None) -> tuple:
    """``(inputs, targets, kwargs)``, ``kwargs`` the rest of ``training_loss``'s arguments:
    RoPE ``positions`` and ``load_balanced``, and with packed documents (``end_id``: the
    end-of-text id) ``segment_ids`` and ``loss_weights`` (``weights``, else those of these
    rows alone), or with packed conversations the given ``segment_ids`` and ``weights``; with
    a 'cp' axis, all in ring attention's load-balanced order."""
    cp = axis_size("cp")
    if segment_ids is not None:
        positions = packing.segment_positions(segment_ids)
        docs = {"segment_ids": segment_ids, "loss_weights": weights}
    elif end_id is None:
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




def train_step(
    state: TrainState,
    batch: tuple[jax.Array, ...],
    *,
    graphdef: Any,
    tx: optax.GradientTransformation,
    policy: Policy = FULL_PRECISION,
    grad_accum: int = 1,
    param_rules: Any = None,
    end_id: int | None = None,
    skip_nonfinite: bool = False,
    offload_optimizer: bool = False,
    layout: Layout = ONE_DEVICE,
) -> tuple[TrainState, dict]:
    """One optimizer step over ``batch = (inputs, targets)`` (or packed conversations
    ``(inputs, targets, segment_ids, loss_mask)``: `shardax.data.chat_data`), optionally in
    ``grad_accum`` microbatches accumulated in the parameter dtype and (with
    ``param_rules``) sharding.
    ``metrics["loss"]`` is the training objective (cross-entropy plus any MoE loss).
    ``layout``: how the model runs on the mesh (`shardax.layout.Layout`). Its explicit FSDP
    mode computes loss and gradients with ``shardax.parallel.fsdp`` (``param_rules`` give the
    parameters' sharding; gradients of the microbatches are reduce-scattered one by one into a
    sharded float32 accumulator); without its recompute (and remat) the gathered layers are
    kept from forward to backward instead of re-gathered and recomputed (more memory, fewer
    FLOPs).

    ``end_id``: packed documents (``--pack documents``): the rows' documents end with this
    token id; attention and RoPE positions restart after it and the loss is the mean over the
    batch's targets that do not start a new document (``shardax.data.packing``). None: the
    rows are one stream.

    ``metrics["finite"]`` says whether the loss and the gradient norm are finite; with
    ``skip_nonfinite`` a step where they are not leaves the parameters and the optimizer
    state as they were (only ``step`` advances: ``--on-nan skip``).

    ``offload_optimizer``: the optimizer state comes in (and, by the caller's
    ``out_shardings``, goes back) in pinned host memory; it is moved to the device for the
    update.

    A mixture of experts reports its expert load (``moe/...``: `shardax.train.balance`) and,
    with ``router_bias_update``, moves its router bias after the optimizer step (in ``rest``;
    not under a 'pp' pipeline or explicit FSDP, which do not return the load)."""
    loss, grads, load = forward.value_and_grad(
        graphdef, state.params, state.rest, layout, _with_weights(batch, end_id),
        partial(_with_positions, end_id=end_id), policy=policy, param_rules=param_rules,
        grad_accum=grad_accum, stats=True)
    config = getattr(nnx.merge(graphdef, state.params, state.rest), "config", None)
    rest = state.rest
    if getattr(config, "router_bias_update", 0):
        if load is None:
            raise ValueError("router_bias_update needs the expert load of each step, which a "
                             "'pp' pipeline and fsdp_mode='explicit' do not return")
        rest = balance.update_router_bias(graphdef, state.params, rest, load.expert_tokens,
                                          config)
    state, metrics = apply_gradients(state, loss, grads, tx=tx, skip_nonfinite=skip_nonfinite,
                                     offload_optimizer=offload_optimizer, rest=rest)
    return state, {**metrics, **balance.load_metrics(load, config)}


def apply_gradients(state: TrainState, loss: jax.Array, grads: Any, *,
                    tx: optax.GradientTransformation, skip_nonfinite: bool = False,
                    offload_optimizer: bool = False, rest: Any = None
                    ) -> tuple[TrainState, dict]:
    """The tail of every objective's step: the optimizer update of ``grads``, the gradient
    norm and the ``finite`` flag (with ``skip_nonfinite`` a non-finite step leaves the
    parameters, the optimizer state and ``rest`` as they were), the optimizer state moved
    from host memory first under ``offload_optimizer``. ``rest``: the non-trained state after
    the step (a moved router bias), default unchanged. Returns ``(new state, {"loss",
    "grad_norm", "finite"})``.

    Example::

        state, metrics = apply_gradients(state, loss, grads, tx=optax.sgd(0.1))
    """
    rest = state.rest if rest is None else rest
    old_opt_state = state.opt_state
    if offload_optimizer:
        old_opt_state = jax.device_put(old_opt_state, jax.memory.Space.Device)
    updates, opt_state = tx.update(grads, old_opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:  # a select, not a branch: the step's program stays one
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, old_opt_state))
        if rest is not state.rest:  # the moved router bias
            rest = jax.tree.map(lambda new, old: jnp.where(finite, new, old), rest,
                                state.rest)
    new_state = state._replace(params=params, rest=rest, opt_state=opt_state,
                               step=state.step + 1)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}


def eval_loss(state: TrainState, batch: tuple[jax.Array, jax.Array], *, graphdef: Any,
              policy: Policy = FULL_PRECISION, end_id: int | None = None,
              layout: Layout = ONE_DEVICE) -> jax.Array:
    """Mean cross-entropy of ``batch`` under the current parameters (without the MoE loss);
    ``end_id`` and ``layout`` as for `train_step`."""
    rows = _with_positions(*_with_weights(batch, end_id), end_id=end_id)
    return forward.params_loss(state.params, state.rest, graphdef, layout, policy, *rows)[1]
