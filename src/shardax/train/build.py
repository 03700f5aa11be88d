"""What a `TrainConfig` describes, built on this machine: mesh, rules, model config,
optimizer, the train state's shapes, and restoring it from a checkpoint.

Shared by the training loop (`shardax.train.loop`) and sampling (`shardax.train.generate`);
nothing here reads the training data. Bad settings are a `UsageError` naming the flag.

>>> mesh = make_mesh(config)
>>> model_config, rules = model_and_rules(config, mesh.shape)
>>> graphdef, state_shape = abstract(model_config, make_tx(config), config.seed, mesh)
>>> run = resolve(config)              # all of the above, checked together (`shardax plan`)
>>> step = step_function(run, graphdef)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
from flax import nnx

from shardax import models
from shardax.mesh import MeshShardingHelper
from shardax.parallel.pipeline import bubble_fraction
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train.checkpoint import Checkpointer, Restored, abstract_state
from shardax.train.config import TrainConfig, UsageError, check, flag, hf_dir
from shardax.train.step import init_state, make_optimizer, train_step
from shardax.utils import flatten_tree

__all__ = ["Resolved", "abstract", "create", "create_from_hf", "flat", "fsdp_mode",
           "fsdp_summary", "make_mesh", "make_tx", "model_and_rules", "model_config",
           "pipeline_summary", "resolve", "restore", "step_function"]


def make_mesh(config: TrainConfig) -> MeshShardingHelper:
    """The ``--mesh`` over this machine's devices (UsageError if the sizes do not fit)."""
    try:
        return MeshShardingHelper.from_string(config.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {config.mesh!r}: {e}") from None


def make_tx(config: TrainConfig):
    """The optax optimizer of ``--optimizer``, ``--lr`` and ``--steps``."""
    return make_optimizer(config.optimizer, config.lr, config.steps, warmup=config.steps // 20)


def model_config(config: TrainConfig) -> Any:
    """The model config of ``--model`` (or of the ``--init-from hf:DIR`` model) with
    ``--precision``, ``--remat`` and ``--seq-len`` applied (no parallelism flags)."""
    policy = Policy.from_string(config.precision)
    if config.init_from is not None:
        from shardax import hf

        try:
            c = hf.load_config(hf_dir(config.init_from, "--init-from"), remat=config.remat,
                               dtype=policy.compute, param_dtype=policy.params)
        except ValueError as e:
            raise UsageError(f"--init-from {config.init_from}: {e}") from None
        c = dataclasses.replace(c, scan_layers=c.scan_layers or config.scan_layers)
        if config.seq_len > c.max_seq_len:
            raise UsageError(f"--seq-len {config.seq_len} exceeds the model's "
                             f"max_position_embeddings {c.max_seq_len} ({config.init_from})")
        return c
    return models.get_config(
        config.model, remat=config.remat, dtype=policy.compute, param_dtype=policy.params,
        max_seq_len=max(config.seq_len, models.CONFIGS[config.model].max_seq_len),
        scan_layers=config.scan_layers or models.CONFIGS[config.model].scan_layers,
    )


def model_and_rules(config: TrainConfig, mesh_shape: dict[str, int]) -> tuple[Any, list]:
    """The model config with the precision and parallelism flags applied, and the rule list
    fitted to the mesh and model (``models.presets.resolve``); UsageError on a mismatch."""
    try:
        return _parallelism(config, mesh_shape, model_config(config))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _parallelism(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any):
    pp = mesh_shape.get("pp", 1)
    if pp == 1 and (config.microbatches > 1 or config.virtual_stages > 1):
        raise ValueError("--microbatches and --virtual-stages need a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape}); use --grad-accum to split the batch without one")
    if pp == 1 and config.pp_schedule != "gpipe":
        raise ValueError(f"--pp-schedule {config.pp_schedule} needs a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape})")
    asked = {"tp_mode": config.tp_mode != "none", "sequence_parallel": config.sequence_parallel}
    if not isinstance(model_config, models.LlamaConfig):
        used = [flag(k) for k, v in asked.items() if v] + [a for a in ("pp", "cp", "ep")
                                                            if mesh_shape.get(a, 1) > 1]
        if used:
            raise ValueError(f"--model {config.model} does not support {used}; use a llama model")
        return model_config, models.PRESETS[config.rules]
    tp_mode = config.tp_mode
    if config.sequence_parallel and tp_mode == "none":
        tp_mode = "sync"  # sequence parallelism runs through the explicit TP blocks
    model_config = dataclasses.replace(
        model_config, tp_mode=tp_mode, sequence_parallel=config.sequence_parallel,
        scan_layers=model_config.scan_layers or pp > 1, pp_schedule=config.pp_schedule,
        pp_microbatches=config.microbatches or pp, pp_virtual_stages=config.virtual_stages)
    models.check_mesh(model_config, mesh_shape, batch_size=config.batch_size,
                      seq_len=config.seq_len)
    rules = models.presets.resolve(
        models.PRESETS[config.rules], mesh_shape, heads=model_config.n_heads,
        kv_heads=model_config.n_kv_heads, sequence_parallel=model_config.sp)
    return model_config, rules


def fsdp_mode(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any) -> str:
    """The FSDP mode a run uses, ``'explicit'`` or ``'xla'`` (``--fsdp-mode auto``: explicit
    where it applies); UsageError (one line naming the combination) when explicit is asked for
    where it cannot run."""
    blockers = []
    if mesh_shape.get("fsdp", 1) == 1:
        blockers.append(f"a mesh without an 'fsdp' axis of size > 1 ({config.mesh})")
    if not isinstance(model_config, models.LlamaConfig) or model_config.n_experts:
        blockers.append(f"--model {config.model} (needs a dense llama model)")
    else:
        if model_config.tp_mode != "none":
            blockers.append(f"--tp-mode {model_config.tp_mode}"
                            + (" / --sequence-parallel" if model_config.sp else "")
                            + " (explicit TP blocks cannot nest in the FSDP shard_map under "
                            "JAX 0.10; --tp-mode none shards 'tp' by --rules)")
        for axis, what in (("pp", "pipeline"), ("cp", "ring attention"), ("ep", "experts")):
            if mesh_shape.get(axis, 1) > 1:
                blockers.append(f"a '{axis}' mesh axis ({what} runs its own shard_map)")
    if config.fsdp_mode == "explicit" and blockers:
        raise UsageError(f"--fsdp-mode explicit does not run with {blockers[0]}; "
                         "use --fsdp-mode xla")
    return "xla" if config.fsdp_mode == "xla" or blockers else "explicit"


def fsdp_summary(mode: str, config: TrainConfig) -> str:
    """One line for the train plan: which FSDP mode is active."""
    if mode == "explicit":
        return ("fsdp: explicit (ZeRO-3: each layer gathered in the compute dtype right before "
                "use, its gradient reduce-scattered in float32"
                + (", once per step over the microbatches" if config.grad_accum > 1 else "")
                + ")")
    return f"fsdp: xla (the partitioner, from the shardings; --fsdp-mode {config.fsdp_mode})"


def pipeline_summary(model_config: Any, stages: int) -> str:
    """One line: the pipeline schedule and its bubble (the idle fraction of a step)."""
    c = model_config
    v = c.pp_virtual_stages if c.pp_schedule == "circular" else 1
    bubble = bubble_fraction(c.pp_schedule, stages, c.pp_microbatches, v)
    virtual = f", {v} virtual stages" if c.pp_schedule == "circular" else ""
    return (f"pipeline: {c.pp_schedule} over {stages} stages, {c.pp_microbatches} "
            f"microbatches{virtual}, bubble {bubble:.1%} of each step")


@dataclass
class Resolved:
    """What `resolve` built from a config: everything but the data and the run directory."""

    config: TrainConfig
    mesh: MeshShardingHelper
    rules: LogicalAxisRules
    model_config: Any
    policy: Policy
    tx: Any
    fsdp_mode: str


def resolve(config: TrainConfig) -> Resolved:
    """The mesh, rules, model config, precision, optimizer and FSDP mode a config asks for,
    checked against each other and this machine's devices (no data, no run directory: what
    ``shardax train`` and ``shardax plan`` share); bad input is a UsageError."""
    check(config)
    mesh = make_mesh(config)
    model_config, rule_list = model_and_rules(config, mesh.shape)
    mode = fsdp_mode(config, mesh.shape, model_config)  # UsageError if it cannot run
    rules = LogicalAxisRules(rule_list)
    batch_axes = rules.spec_for(("batch",), mesh.mesh)[0]
    batch_split = math.prod(mesh.shape[a] for a in ((batch_axes,) if isinstance(batch_axes, str)
                                                  else batch_axes or ()))
    micro = getattr(model_config, "pp_microbatches", 1) if mesh.shape.get("pp", 1) > 1 else 1
    if config.batch_size % (batch_split * config.grad_accum * micro):
        raise UsageError(
            f"--batch-size {config.batch_size} must be divisible by the data-parallel size "
            f"{batch_split} (mesh {mesh.shape}) times --grad-accum {config.grad_accum}"
            + (f" times --microbatches {micro}" if micro > 1 else ""))
    if config.batch_size % jax.process_count():
        raise UsageError(f"--batch-size {config.batch_size} must be divisible by the process "
                         f"count {jax.process_count()}")
    return Resolved(config, mesh, rules, model_config, Policy.from_string(config.precision),
                    make_tx(config), mode)


def step_function(run: Resolved, graphdef: Any):
    """The sharded train step of a resolved config (a ``ShardedFunction``: call it with
    ``(state, batch)``, or ``.plan()`` it); the state is donated."""
    rules, mesh = run.rules, run.mesh
    return mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=run.tx, policy=run.policy,
                grad_accum=run.config.grad_accum, param_rules=rules, fsdp_mode=run.fsdp_mode),
        in_shardings=(rules, rules.spec_for(("batch", "length"), mesh.mesh)),
        out_shardings=(rules, None),
        donate_argnums=0,
    )


def create(model_config: Any, tx: Any, seed: int):
    """``(graphdef, state)`` of a fresh model and optimizer (call under ``sjit``)."""
    return init_state(lambda: models.create(model_config, nnx.Rngs(seed)), tx)


def create_from_hf(config: TrainConfig, model_config: Any, tx: Any, mesh: MeshShardingHelper,
                   rules: Any) -> Any:
    """The train state of step 0 with the parameters of ``--init-from hf:DIR``, read straight
    into their sharding under ``rules`` (each process reads only its devices' slices) and the
    optimizer state created sharded alike."""
    from shardax import hf

    try:
        graphdef, loaded = hf.load_params(hf_dir(config.init_from, "--init-from"),
                                          model_config, mesh, rules)
    except ValueError as e:
        raise UsageError(f"--init-from {config.init_from}: {e}") from None
    _, params, rest = nnx.split(nnx.merge(graphdef, loaded), nnx.Param, ...)
    opt_state = mesh.sjit(tx.init, in_shardings=(rules,), out_shardings=rules)(params)
    return {"params": params, "rest": rest, "opt_state": opt_state,
            "step": jax.device_put(jax.numpy.int32(0),
                                   jax.sharding.NamedSharding(mesh.mesh,
                                                              jax.sharding.PartitionSpec()))}


def abstract(model_config: Any, tx: Any, seed: int, mesh: MeshShardingHelper
             ) -> tuple[Any, Any]:
    """The model's graphdef and the train state's shapes, without computing anything."""
    graphdefs = []

    def state_only():
        graphdef, state = create(model_config, tx, seed)
        graphdefs.append(graphdef)  # static structure, no tracers: safe to keep
        return state

    with mesh.get_context():
        state_shape = jax.eval_shape(state_only)
    return graphdefs[0], state_shape


def flat(state: Any) -> dict[str, Any]:
    """The checkpointed form of a state: a flat ``{path: array}`` dict, independent of the
    pytree node classes (NNX, optax) that hold the arrays."""
    return flatten_tree(state, sep=".")


def restore(ckpt: Checkpointer, state_shape: Any, shardings: Any, **kwargs: Any
            ) -> tuple[Restored, Any]:
    """Reads a checkpoint onto ``shardings``: ``(restored, state)`` with the state in the
    structure of ``state_shape``. ``kwargs`` go to `Checkpointer.restore` (step, fallback,
    check, on_skip)."""
    target = abstract_state(flat(state_shape), flat(shardings))
    restored = ckpt.restore(target=target, **kwargs)
    leaves = [restored.state[k] for k in flat(state_shape)]
    return restored, jax.tree_util.tree_unflatten(jax.tree.structure(state_shape), leaves)
