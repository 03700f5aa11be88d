"""Logical-axis rule presets, one per parallelism strategy, for meshes with axes 'dp', 'fsdp', 'tp'.

Each preset is a plain list of ``(logical_name, mesh_axis | tuple of mesh axes | None)`` pairs in
priority order, read the way ``flax.linen.logical_to_mesh_axes`` reads them: rules are tried in
list order, and a rule applies to a dimension only if that dimension is still unassigned and none
of its mesh axes is already used by another dimension of the same array. So a name may appear
several times; later entries are fallbacks. Names no rule assigns are replicated.

The batch rule comes first: an activation ``('batch', 'length', 'embed')`` gives 'batch' the
('dp', 'fsdp') axes, so 'embed' falls back to ``None`` (replicated features, as in the compute
mapping of FSDP), while a parameter ``('embed', 'mlp')`` has no batch dim and takes 'fsdp' (the
parameter mapping). One preset covers both mappings.

Axes 'pp', 'cp', 'ep' are reserved for pipeline, context and expert parallelism; the presets
here keep 'layers' and 'length' replicated. To pipeline, put ``('layers', 'pp')`` first.

Example::

    from shardax.rules import LogicalAxisRules
    rules = LogicalAxisRules(PRESETS['fsdp_tp'])
"""

from __future__ import annotations

Rule = tuple[str, str | tuple[str, ...] | None]

_BATCH: list[Rule] = [("batch", ("dp", "fsdp"))]

_REPLICATED: list[Rule] = [
    ("length", None),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
]

# Pure data parallelism: batch split over every data axis, all parameters replicated.
DP: list[Rule] = [
    *_BATCH,
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("vocab", None),
    *_REPLICATED,
]

# ZeRO-3 / FSDP: parameters (and so gradients and optimizer state) split on their 'embed'
# dim over 'fsdp'; activations keep 'embed' whole because 'batch' already holds 'fsdp'.
FSDP: list[Rule] = [
    *_BATCH,
    ("embed", "fsdp"),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("vocab", None),
    *_REPLICATED,
]

# Megatron tensor parallelism: MLP hidden, attention heads and vocabulary split over 'tp',
# for parameters and activations alike; 'embed' replicated.
TP: list[Rule] = [
    *_BATCH,
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("vocab", "tp"),
    ("embed", None),
    *_REPLICATED,
]

# 2-D: FSDP over 'fsdp' and tensor parallelism over 'tp' (e.g. 'embed' x 'mlp' weights are
# split on both dims).
FSDP_TP: list[Rule] = [
    *_BATCH,
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("embed", None),
    *_REPLICATED,
]

PRESETS: dict[str, list[Rule]] = {"dp": DP, "fsdp": FSDP, "tp": TP, "fsdp_tp": FSDP_TP}
