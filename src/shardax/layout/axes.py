"""Mesh-axis name groups, defined once for the layout, rule presets and the train loop.

Example::

    from shardax.layout.axes import BATCH_AXES
    rules = [("batch", BATCH_AXES), ...]
"""

from __future__ import annotations

# Every mesh axis shardax's models know, in the order `shardax train --mesh` lists them.
MESH_AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
# Axes that split the batch (data-parallel replicas and FSDP shards), major to minor.
BATCH_AXES = ("dp", "fsdp")
# Axes a sharded batch may span once expert parallelism splits tokens over 'ep' too.
TOKEN_AXES = ("ep", *BATCH_AXES)
# The axis explicit FSDP shards parameters over.
FSDP_AXIS = "fsdp"
# Axes of the explicit parallel modes: tensor, pipeline, context, expert.
TENSOR_AXIS, PIPELINE_AXIS, CONTEXT_AXIS, EXPERT_AXIS = "tp", "pp", "cp", "ep"

__all__ = ["BATCH_AXES", "CONTEXT_AXIS", "EXPERT_AXIS", "FSDP_AXIS", "MESH_AXES", "PIPELINE_AXIS",
           "TENSOR_AXIS", "TOKEN_AXES"]
