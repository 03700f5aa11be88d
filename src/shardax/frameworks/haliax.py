"""Haliax: a ``NamedArray`` is a box whose logical names are its axis names; Haliax's axis
mapping follows the rules of the running ``sjit``.

Rules need nothing else for parameters: ``LogicalAxisRules`` keyed by a model's axis names
(``{"embed": "data", "mlp": "model"}``, Haliax's own ``ResourceMapping`` works as the rule list)
shards every ``NamedArray`` of a model, and of the optax state built from it, as
``haliax.partitioning.infer_resource_partitions`` does with that mapping. Activations are
Haliax's: ``hax.shard`` / ``hax.auto_sharded`` in a model read Haliax's thread-local
``axis_mapping``; every shardax context with ``LogicalAxisRules`` sets it from those rules
(``shardax.context``), so under ``sjit`` they constrain as under ``hax.named_jit``. Haliax is
never imported here (see ``shardax.frameworks``).

Example::

    step = mesh.sjit(train_step, in_shardings=(param_rules, param_rules, batch_spec),
                     out_shardings=(None, param_rules, param_rules),
                     logical_axis_rules=compute_rules)   # hax.axis_mapping inside the step
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from shardax.frameworks.linen import axis_rules

__all__ = ["named_array_type", "resource_mapping", "axis_mapping"]


def named_array_type() -> type | None:
    """``haliax.NamedArray`` when Haliax is loaded, else None."""
    core = sys.modules.get("haliax.core")
    return None if core is None else core.NamedArray


def resource_mapping(rules: Iterable[tuple[str, Any]], mesh: Any | None = None
                     ) -> dict[str, str | tuple[str, ...]]:
    """``rules`` as a Haliax ``ResourceMapping``: each name to its first rule's mesh axes
    that ``mesh`` has (Haliax maps a name to one set of axes, with no fallbacks); names whose
    first such rule is ``None`` (replicated) are left out, and each mesh axis no rule names
    maps to itself, as in ``LogicalAxisRules``.

    >>> from shardax import LogicalAxisRules, MeshShardingHelper
    >>> mesh = MeshShardingHelper([-1, 2], ["data", "model"]).mesh
    >>> resource_mapping(LogicalAxisRules([("batch", ("replica", "data")), ("mlp", "model"),
    ...                                    ("mlp", "data"), ("embed", None)]), mesh)
    {'batch': 'data', 'mlp': 'model', 'data': 'data', 'model': 'model'}
    """
    first: dict[str, Any] = {}
    for name, axes in axis_rules(rules, mesh):
        first.setdefault(name, axes)
    return {name: axes for name, axes in first.items() if axes is not None}


def axis_mapping(rules: Iterable[tuple[str, Any]], mesh: Any | None = None) -> Any:
    """Haliax's ``axis_mapping`` context set from ``rules``, or None without Haliax loaded."""
    partitioning = sys.modules.get("haliax.partitioning")
    if partitioning is None:
        return None
    return partitioning.axis_mapping(resource_mapping(rules, mesh))
