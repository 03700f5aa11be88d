"""Builds the train state and the compiled train step of a resolved run.

Shared by the training loop (`shardax.train.loop`), the planner and sampling
(`shardax.train.generate`); the run comes from `shardax.train.resolve.resolve`, nothing here
reads the config's strings or the training data.

>>> from shardax.train.config import TrainConfig, check
>>> from shardax.train.resolve import resolve
>>> run = resolve(check(TrainConfig(batch_size=8)))
>>> graphdef, state_shape = abstract(run.model_config, run.tx, run.config.seed, run.mesh)
>>> step = step_function(run, graphdef, end_id=0)  # call it with (state, batch), or .plan() it
>>> int(state_shape.step.size)
1
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
from flax import nnx

from shardax import hf, models
from shardax.errors import UsageError
from shardax.mesh import MeshShardingHelper
from shardax.models.lora import add_lora, trainable
from shardax.train.resolve import Resolved, state_shape
from shardax.train.step import TrainState, init_state, train_step

__all__ = ["abstract", "create", "create_from_hf", "initial_state", "step_function"]


def step_function(run: Resolved, graphdef: Any, *, end_id: int | None):
    """The sharded train step of a resolved config (a ``ShardedFunction``: call it with
    ``(state, batch)``, or ``.plan()`` it); the state is donated. ``end_id``: the tokenizer's
    end-of-text id, which separates packed documents under ``--pack documents`` (required
    there; ignored under ``--pack concat``; planning may pass any id: same program)."""
    if run.config.pack == "documents" and end_id is None:
        raise ValueError("step_function: --pack documents needs the tokenizer's end-of-text "
                         "id (end_id)")
    rules, mesh = run.rules, run.mesh
    return mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=run.tx, policy=run.policy,
                grad_accum=run.config.grad_accum, param_rules=rules, layout=run.layout,
                end_id=end_id if run.config.pack == "documents" else None,
                skip_nonfinite=run.config.on_nan == "skip",
                offload_optimizer=run.config.offload_optimizer),
        in_shardings=(run.state_rules, rules.spec_for(("batch", "length"), mesh.mesh)),
        out_shardings=(run.state_rules, None),
        donate_argnums=0,
    )


def create(model_config: Any, tx: Any, seed: int) -> tuple[Any, TrainState]:
    """``(graphdef, state)`` of a fresh model and optimizer (call under ``sjit``)."""
    return init_state(lambda: models.create(model_config, nnx.Rngs(seed)), tx)


def create_from_hf(run: Resolved) -> TrainState:
    """The train state of step 0 with the parameters of ``--init-from hf:DIR``, read straight
    into their sharding under the run's rules (each process reads only its devices' slices)
    and the optimizer state created sharded alike."""
    mesh, rules, config = run.mesh, run.rules, run.model_config
    try:
        graphdef, loaded = hf.load_params(run.init_dir, dataclasses.replace(config, lora=None),
                                          mesh, rules)
    except ValueError as e:
        raise UsageError(f"--init-from {run.config.init_from}: {e}") from None
    if config.lora is not None:  # the adapters, created sharded around the loaded weights
        base_graphdef = graphdef

        def adapt(state):
            model = nnx.merge(base_graphdef, state)
            add_lora(model, config.lora, nnx.Rngs(run.config.seed))
            return nnx.state(model)

        graphdef = nnx.graphdef(nnx.eval_shape(
            lambda: models.create(config, nnx.Rngs(0))))
        loaded = mesh.sjit(adapt, in_shardings=(rules,), out_shardings=rules)(loaded)
    _, params, rest = nnx.split(nnx.merge(graphdef, loaded), trainable(config), ...)
    opt_state = mesh.sjit(run.tx.init, in_shardings=(rules,),
                          out_shardings=run.state_rules.opt_state)(params)
    step = jax.device_put(jax.numpy.int32(0),
                          jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec()))
    return TrainState(params, rest, opt_state, step)


def initial_state(run: Resolved) -> TrainState:
    """The state of step 0 of a resolved run, sharded by its rules: ``--init-from``'s weights,
    or a fresh model created on the mesh."""
    if run.config.init_from is not None:
        return create_from_hf(run)
    return run.mesh.sjit(lambda: create(run.model_config, run.tx, run.config.seed)[1],
                         out_shardings=run.state_rules)()


def abstract(model_config: Any, tx: Any, seed: int, mesh: MeshShardingHelper
             ) -> tuple[Any, Any]:
    """The model's graphdef and the train state's shapes, without computing anything; LoRA
    settings that do not fit the model are a UsageError here, before anything is allocated
    (`shardax.train.resolve.state_shape`)."""
    return state_shape(model_config, tx, seed, mesh)
