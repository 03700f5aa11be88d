"""Logical-axis rule presets, one per parallelism strategy, for meshes with axes 'dp', 'fsdp', 'tp'
(and 'pp', 'cp', 'ep' through ``PARALLEL`` / :func:`resolve`).

Each preset is a plain list of ``(logical_name, mesh_axis | tuple of mesh axes | None)`` pairs in
priority order, read the way ``flax.linen.logical_to_mesh_axes`` reads them: rules are tried in
list order, and a rule applies to a dimension only if that dimension is still unassigned and none
of its mesh axes is already used by another dimension of the same array. So a name may appear
several times; later entries are fallbacks. Names no rule assigns are replicated.

The batch rule comes first: an activation ``('batch', 'length', 'embed')`` gives 'batch' the
('dp', 'fsdp') axes, so 'embed' falls back to ``None`` (replicated features, as in the compute
mapping of FSDP), while a parameter ``('embed', 'mlp')`` has no batch dim and takes 'fsdp' (the
parameter mapping). One preset covers both mappings.

Axes 'pp', 'cp', 'ep' belong to pipeline, context and expert parallelism. The four base presets
keep 'layers' and 'length' replicated; :func:`with_parallel_axes` adds ``('layers', 'pp')``,
``('length', 'cp')``, ``('expert', 'ep')`` and puts 'ep' in front of the batch axes (expert
parallelism splits the tokens over 'ep' too). ``PRESETS['nd']`` is ``fsdp_tp`` with all of them.
Axes the mesh lacks are dropped by ``LogicalAxisRules``, so one preset serves every mesh.
:func:`resolve` is what ``shardax train`` uses: a preset fitted to a model and a mesh.

Example::

    from shardax.rules import LogicalAxisRules
    rules = LogicalAxisRules(PRESETS['fsdp_tp'])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardax.layout.axes import BATCH_AXES

Rule = tuple[str, str | tuple[str, ...] | None]

_BATCH: list[Rule] = [("batch", BATCH_AXES)]

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



def _insert_before(rules: list[Rule], name: str, new: Sequence[Rule]) -> list[Rule]:
    """``new`` placed just before the first rule for ``name`` (at the end if there is none)."""
    at = next((i for i, (n, _) in enumerate(rules) if n == name), len(rules))
    return [*rules[:at], *new, *rules[at:]]


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def with_parallel_axes(rules: Sequence[Rule], sequence_parallel: bool = False) -> list[Rule]:
    """``rules`` plus the pipeline, context and expert axes (and Megatron sequence parallelism).

    Adds ``('layers', 'pp')`` (stacked layers split into stages), ``('expert', 'ep')``, 'ep' as
    the major batch axis, and ``('length', 'cp')`` just before the existing 'length' rules (so
    TP names listed earlier keep 'tp'). ``sequence_parallel`` also splits 'length' over 'tp'
    where no other dim of the array holds 'tp': the residual stream ``('batch', 'length',
    'embed')`` becomes ``P(batch, ('cp', 'tp'))`` while ``('batch', 'length', 'mlp')`` keeps
    'tp' on 'mlp'.

    >>> with_parallel_axes(PRESETS['fsdp'])[:2]
    [('expert', 'ep'), ('layers', 'pp')]
    """
    out: list[Rule] = [("expert", "ep"), ("layers", "pp")]
    for name, axes in rules:
        if name == "batch" and "ep" not in _axes(axes):
            axes = ("ep", *_axes(axes))
        out.append((name, axes))
    length: list[Rule] = [("length", ("cp", "tp"))] if sequence_parallel else []
    return _insert_before(out, "length", [*length, ("length", "cp")])


# Every axis: FSDP x TP x PP x CP x EP (axes the mesh lacks are dropped).
ND: list[Rule] = with_parallel_axes(FSDP_TP)

PRESETS: dict[str, list[Rule]] = {"dp": DP, "fsdp": FSDP, "tp": TP, "fsdp_tp": FSDP_TP, "nd": ND}


def resolve(
    rules: Sequence[Rule],
    mesh_shape: Mapping[str, int],
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    sequence_parallel: bool = False,
) -> list[Rule]:
    """A preset fitted to a mesh and a model: parallel axes added, head rules dropped where the
    mesh axes they name do not divide the head count (the heads are then replicated over those
    axes; the Llama model replicates heads over 'tp' in its explicit TP blocks to match).

    Example::

        rules = LogicalAxisRules(resolve(PRESETS['fsdp_tp'], {'tp': 8}, heads=4, kv_heads=2))
        # no ('heads', 'tp') / ('kv_heads', 'tp'): 4 and 2 heads do not split over 8 devices
    """
    counts = {"heads": heads, "kv_heads": kv_heads}
    out = []
    for name, axes in with_parallel_axes(rules, sequence_parallel):
        count = counts.get(name)
        split = math.prod(mesh_shape.get(a, 1) for a in _axes(axes))
        if count is not None and count % split:
            continue
        out.append((name, axes))
    return out
