"""Explicit parallelism building blocks under ``jax.shard_map`` (need only JAX).

Each block is manual over its own mesh axis only (``tp``, ``pp``, ``cp``, ``ep``) and leaves
the others to XLA, so blocks compose with each other and with rule-based sharding inside
``sjit``. Without a mesh, or when its axis is absent or of size 1, each computes the plain
single-device result.
"""

from shardax.parallel.context import attention, load_balance, ring_attention, unload_balance
from shardax.parallel.expert import expert_capacity, init_moe_params, moe_mlp, moe_param_specs
from shardax.parallel.pipeline import (
    Schedule,
    bubble_fraction,
    from_stage_layout,
    pipeline,
    pipeline_size,
    sequential,
    stage_specs,
    to_stage_layout,
)
from shardax.parallel.tensor import Mode, column_parallel, row_parallel, tp_mlp, tp_size

__all__ = [
    "Mode",
    "column_parallel",
    "row_parallel",
    "tp_mlp",
    "tp_size",
    "attention",
    "ring_attention",
    "load_balance",
    "unload_balance",
    "moe_mlp",
    "init_moe_params",
    "moe_param_specs",
    "expert_capacity",
    "Schedule",
    "pipeline",
    "sequential",
    "bubble_fraction",
    "to_stage_layout",
    "from_stage_layout",
    "stage_specs",
    "pipeline_size",
]
