"""Explicit parallelism building blocks under ``jax.shard_map`` (need only JAX).

Each block is manual over its own mesh axis only (``tp``, ``pp``, ``cp``, ``ep``) and leaves
the others to XLA, so blocks compose with each other and with rule-based sharding inside
``sjit``. Without a mesh, or when its axis is absent or of size 1, each computes the plain
single-device result. Every block takes ``mesh=`` (default: the ``jax.set_mesh`` context mesh)
and reads axis sizes through :func:`axis_size`.
"""

from shardax.parallel._stages import from_microbatches, to_microbatches
from shardax.parallel.axes import axis_size, manual_axes
from shardax.parallel.context import attention, load_balance, ring_attention, unload_balance
from shardax.parallel.expert import expert_capacity, init_moe_params, moe_mlp, moe_param_specs
from shardax.parallel.pipeline import (
    Schedule,
    bubble_fraction,
    from_stage_layout,
    pipeline,
    sequential,
    stage_specs,
    to_stage_layout,
)
from shardax.parallel.tensor import Mode, column_parallel, row_parallel, tp_mlp

__all__ = [
    "axis_size",
    "manual_axes",
    "to_microbatches",
    "from_microbatches",
    "Mode",
    "column_parallel",
    "row_parallel",
    "tp_mlp",
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
]
