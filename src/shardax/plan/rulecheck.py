"""Find what sharding rules silently fail to do on a mesh: mesh axes dropped, rules in conflict.

`match_specs` raises on what cannot work (an unknown axis in a ``PartitionSpec``, a dim the
mesh does not divide); a rule can still quietly not do what it says:

- **dropped**: an ``FSDPShardingRule`` finds no dim of a large enough leaf that its axis
  divides (the leaf stays replicated over it); a ``LogicalAxisRules`` name maps only to mesh
  axes the mesh lacks (a typo, or 'model' where the mesh says 'tp');
- **conflict**: two ``TreePathShardingRule`` patterns match one leaf with different specs (the
  first wins; a last pattern matching every leaf is the default, not a conflict); two logical names
  of one leaf map to the same mesh axis (one dim loses it).

Rules shardax cannot look into (``PolicyShardingRule``, your own classes) are taken as they
are.

>>> import numpy as np
>>> mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
>>> [f.message for f in rule_findings(FSDPShardingRule(min_fsdp_size=0),
...                                   {"w": np.zeros((6, 3))}, mesh)]
["FSDPShardingRule: no dim of shape (6, 3) divides by 'fsdp' (size 4): replicated over it"]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from shardax import _context, frameworks
from shardax.rules import (
    FSDPShardingRule,
    HostOffloadRule,
    LogicalAxisRules,
    ShardingRule,
    TreePathShardingRule,
)
from shardax.utils import leaf_shape, tree_path_to_string

__all__ = ["Finding", "rule_findings"]


@dataclass(frozen=True)
class Finding:
    """One leaf the rules do not shard as they say: ``kind`` is 'dropped' or 'conflict';
    ``leaf`` is the leaf's index among the tree's array leaves (tree order)."""

    kind: str
    leaf: int
    message: str


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _padded(spec: PartitionSpec, rank: int) -> list[Any]:
    return list(spec) + [None] * (rank - len(spec))


def _fsdp(rule: FSDPShardingRule, leaf: Any, sizes: dict[str, int]) -> Iterator[tuple[str, str]]:
    shape = leaf_shape(frameworks.unbox(leaf))
    axes = _axes(rule.fsdp_axis_name)
    size = rule.fsdp_axis_size or (math.prod(sizes[a] for a in axes)
                                   if all(a in sizes for a in axes) else 1)
    if (shape and math.prod(shape) >= rule.min_fsdp_size and size > 1
            and not any(_padded(_spec(rule, leaf), len(shape)))):
        name = axes[0] if len(axes) == 1 else axes
        yield "dropped", (f"FSDPShardingRule: no dim of shape {shape} divides by {name!r} "
                          f"(size {size}): replicated over it")


def _tree_path(rule: TreePathShardingRule, path: str, leaf: Any, sizes: dict[str, int],
               everywhere: set[str]) -> Iterator[tuple[str, str]]:
    shape = leaf_shape(frameworks.unbox(leaf))
    if not shape or math.prod(shape) == 1:
        return
    matches = [(p, v) for p, v in rule.rules if re.search(p, path) is not None]
    if not matches:
        return
    (first, value), later = matches[0], matches[1:]
    spec = _spec(value, leaf)
    yield from _examine(value, path, leaf, sizes, everywhere)
    for pattern, other in later:
        try:
            other_spec = _spec(other, leaf)
        except ValueError:  # a rule that cannot shard this leaf at all never applied to it
            continue
        if pattern not in everywhere and _padded(other_spec, len(shape)) != _padded(
                spec, len(shape)):
            yield "conflict", (f"rules {first!r} ({spec}) and {pattern!r} ({other_spec}) both "
                               "match: the first wins")


def _logical(rule: LogicalAxisRules, leaf: Any, sizes: dict[str, int]
             ) -> Iterator[tuple[str, str]]:
    names = frameworks.logical_names(leaf)
    if names is None:
        return
    spec = _padded(rule.spec_for(names), len(names))
    for dim, name in enumerate(names):
        wanted = [axes for n, axes in rule.rules if n == name]
        if name is None or spec[dim] is not None or not wanted or wanted[0] is None:
            continue
        asked = sorted({a for axes in wanted for a in _axes(axes)})
        present = [a for a in asked if a in sizes]
        if not present:
            yield "dropped", (f"logical name {name!r} of dim {dim} maps to {asked}, not mesh "
                              f"axes {tuple(sizes)}: replicated over them")
            continue
        holders = [f"dim {d} ({names[d]!r})" for d, entry in enumerate(spec)
                   if set(_axes(entry)) & set(present)]
        yield "conflict", (f"logical names {names}: mesh axis {present[0]!r} is wanted by "
                           f"{' and '.join(holders)} and dim {dim} ({name!r}); dim {dim} is "
                           "left unsharded")


def _spec(value: Any, leaf: Any) -> PartitionSpec:
    if isinstance(value, ShardingRule):
        return value.apply(leaf)
    return value if value is not None else PartitionSpec()


def _examine(rule: Any, path: str, leaf: Any, sizes: dict[str, int], everywhere: set[str]
             ) -> Iterator[tuple[str, str]]:
    if isinstance(rule, HostOffloadRule):
        yield from _examine(rule.rule, path, leaf, sizes, everywhere)
    elif isinstance(rule, FSDPShardingRule):
        yield from _fsdp(rule, leaf, sizes)
    elif isinstance(rule, TreePathShardingRule):
        yield from _tree_path(rule, path, leaf, sizes, everywhere)
    elif isinstance(rule, LogicalAxisRules):
        yield from _logical(rule, leaf, sizes)


def _is_rule(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, ShardingRule))


def rule_findings(rules: Any, tree: Any, mesh: Any) -> list[Finding]:
    """What ``rules`` (a tree prefix of ``tree``, as `match_specs` takes) silently drop or
    disagree on when sharding ``tree`` over ``mesh``; one `Finding` per leaf and issue."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rule_leaves, rule_def = jax.tree_util.tree_flatten(rules, is_leaf=_is_rule)
    findings: list[Finding] = []
    index = 0
    with _context.resolving_on(mesh):
        for rule, subtree in zip(rule_leaves, rule_def.flatten_up_to(tree)):
            found = jax.tree_util.tree_flatten_with_path(subtree, is_leaf=frameworks.is_box)[0]
            paths = [tree_path_to_string(p, sep="/") for p, _ in found]
            everywhere = set()  # the last pattern, when it matches every leaf: the default
            if isinstance(rule, TreePathShardingRule) and rule.rules:
                last = rule.rules[-1][0]
                everywhere = {last} if all(re.search(last, path) for path in paths) else set()
            for path, (_, leaf) in zip(paths, found):
                for kind, message in _examine(rule, path, leaf, sizes, everywhere):
                    findings.append(Finding(kind, index, message))
                index += len(jax.tree.leaves(leaf))
    return findings
