"""The train step of a preference objective (DPO, SimPO, ORPO) and its reference log-probabilities.

A batch is ``(inputs, labels, completion_mask, reference)`` of
`shardax.train.post.preference_batches`: ``2B`` rows, the ``B`` chosen sequences then their
``B`` rejected ones, and each row's reference log-probability (zeros for the reference-free
SimPO and ORPO). One forward over all ``2B`` rows gives the logits,
`shardax.train.post.objectives.sequence_logps` the summed log-probability of each completion,
and `PREFERENCE_LOSSES` the objective's loss as TRL defines it
(`shardax.train.post.objectives`); its gradient goes through the optimizer as in the SFT step
(`shardax.train.step.apply_gradients`). The metrics are TRL's (``rewards/chosen``, ...), batch
means, beside ``loss``.

The reference (DPO) is the model the run starts from, evaluated once before the first step by
`reference_logps` with the same forward; under LoRA the adapters start at zero, so that is the
base model with the adapters off, and no second copy of the weights is ever held.

Example::

    step = step_function(run, graphdef)            # sharded, the state donated
    state, metrics = step(state, batch)            # metrics["rewards/margins"], ...
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from shardax.layout import forward
from shardax.layout.spec import Layout
from shardax.precision import Policy
from shardax.train.config import TrainConfig
from shardax.train.post.objectives import dpo_loss, orpo_loss, sequence_logps, simpo_loss
from shardax.train.resolve import Resolved
from shardax.train.step import FULL_PRECISION, ONE_DEVICE, TrainState, apply_gradients

__all__ = ["PREFERENCE_LOSSES", "completion_logps", "preference_step", "reference_logps",
           "step_function"]

Losses = tuple[jax.Array, dict]


def completion_logps(params: Any, rest: Any, graphdef: Any, layout: Layout, policy: Policy,
                     inputs: jax.Array, labels: jax.Array, mask: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logps, counts, aux)``: each row's summed log-probability of its completion tokens
    and their number (`sequence_logps`) under the model ``nnx.merge(graphdef, params, rest)``
    on ``layout``, and the model's weighted auxiliary loss (an MoE's load balancing times
    its ``aux_weight``; 0 without one)."""
    rest = jax.tree.map(lambda x: x, rest)  # fresh Variables at this trace level (LoRA's base)
    model = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
    logits, aux = forward.logits(model, layout, inputs, return_aux=True)
    logps, counts = sequence_logps(policy.cast_to_output(logits), labels, mask)
    return (logps, jnp.maximum(counts, 1.0),
            model.aux_weight * aux if model.has_aux else jnp.float32(0))


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = x.shape[0] // 2
    return x[:n], x[n:]


def _dpo(logps: jax.Array, counts: jax.Array, ref: jax.Array, config: TrainConfig) -> Losses:
    losses, metrics = dpo_loss(*_halves(logps), *_halves(ref), beta=config.beta,
                               label_smoothing=config.label_smoothing,
                               loss_type=config.dpo_loss)
    if config.dpo_loss == "ipo":  # TRL's IPO loss takes per-token averages, the reference's
        # too; its logged rewards and logps stay those of the sums
        losses, _ = dpo_loss(*_halves(logps / counts), *_halves(ref / counts),
                             beta=config.beta, loss_type="ipo")
    return losses, metrics


def _simpo(logps: jax.Array, counts: jax.Array, ref: jax.Array, config: TrainConfig) -> Losses:
    return simpo_loss(*_halves(logps / counts), beta=config.beta, gamma=config.simpo_gamma,
                      label_smoothing=config.label_smoothing)


def _orpo(logps: jax.Array, counts: jax.Array, ref: jax.Array, config: TrainConfig) -> Losses:
    # TRL's NLL: the token-mean cross-entropy over the batch's chosen completions
    nll = -_halves(logps)[0].sum() / _halves(counts)[0].sum()
    return orpo_loss(*_halves(logps / counts), nll, lam=config.beta)


#: ``--objective`` -> ``(logps, counts, reference logps, config) -> (per-pair losses,
#: metrics)``, each ``[2B]`` argument chosen rows first.
PREFERENCE_LOSSES: dict[str, Callable[..., Losses]] = {"dpo": _dpo, "simpo": _simpo,
                                                        "orpo": _orpo}


def preference_step(state: TrainState, batch: tuple[jax.Array, ...], *, graphdef: Any,
                    tx: optax.GradientTransformation, config: TrainConfig,
                    policy: Policy = FULL_PRECISION, layout: Layout = ONE_DEVICE,
                    skip_nonfinite: bool = False, offload_optimizer: bool = False
                    ) -> tuple[TrainState, dict]:
    """One optimizer step of ``config.objective`` on ``batch = (inputs, labels,
    completion_mask, reference)``; ``metrics`` hold ``loss`` (the mean per-pair loss, plus an
    MoE model's weighted auxiliary loss), ``grad_norm``, ``finite`` and the objective's TRL
    metrics. The other arguments as for `shardax.train.step.train_step`.

    Example::

        state, metrics = preference_step(state, batch, graphdef=graphdef, tx=optax.sgd(0.1),
                                         config=check(TrainConfig(objective="dpo", data=[p])))
    """
    inputs, labels, mask, ref = batch
    loss_fn = PREFERENCE_LOSSES[config.objective]

    def objective(params):
        logps, counts, aux = completion_logps(params, state.rest, graphdef, layout, policy,
                                              inputs, labels, mask)
        losses, metrics = loss_fn(logps, counts, ref, config)
        return losses.mean() + aux, metrics

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    state, out = apply_gradients(state, loss, grads, tx=tx, skip_nonfinite=skip_nonfinite,
                                 offload_optimizer=offload_optimizer)
    return state, {**out, **metrics}


def _batch_specs(run: Resolved) -> tuple[PartitionSpec, ...]:
    """The shardings of a preference batch's fields: rows split like the SFT batch's."""
    rows = run.rules.spec_for(("batch", "length"), run.mesh.mesh)
    return rows, rows, rows, PartitionSpec(*rows[:1])


def step_function(run: Resolved, graphdef: Any, *, end_id: int | None = None):
    """The sharded preference step of a resolved run (call it with ``(state, batch)``, or
    ``.plan()`` it); the state is donated. ``end_id`` is unused (the SFT step's signature)."""
    return run.mesh.sjit(
        partial(preference_step, graphdef=graphdef, tx=run.tx, config=run.config,
                policy=run.policy, layout=run.layout,
                skip_nonfinite=run.config.on_nan == "skip",
                offload_optimizer=run.config.offload_optimizer),
        in_shardings=(run.state_rules, _batch_specs(run)),
        out_shardings=(run.state_rules, None),
        donate_argnums=0,
    )


def reference_logps(run: Resolved, graphdef: Any, state: TrainState,
                    chunks: Callable[[], Any]) -> np.ndarray:
    """The summed completion log-probability of every row under ``state`` (the model the run
    starts from), sharded as the step is: ``chunks()`` yields ``(batch, valid)``, a global
    ``(inputs, labels, mask)`` batch and how many of its first rows are real; returns their
    float32 log-probabilities concatenated in order."""
    rows = _batch_specs(run)[0]
    fn = run.mesh.sjit(
        lambda state, *batch: completion_logps(state.params, state.rest, graphdef, run.layout,
                                               run.policy, *batch)[0],
        in_shardings=(run.state_rules, rows, rows, rows), out_shardings=PartitionSpec())
    parts = [np.asarray(jax.device_get(fn(state, *batch)))[:valid] for batch, valid in chunks()]
    return np.concatenate(parts).astype(np.float32)
