"""What sharding rules silently leave undone on a mesh: axes dropped, names unknown, conflicts.

`match_specs` raises on what cannot work (an unknown axis in a ``PartitionSpec``, a dim the
mesh does not divide); a rule can still quietly not do what it says:

- **dropped**: an ``FSDPShardingRule`` finds no dim of a large enough leaf that its axis
  divides (the leaf stays replicated over it); a ``LogicalAxisRules`` name maps only to mesh
  axes the mesh lacks (a typo, or 'model' where the mesh says 'tp');
- **unknown**: a logical name that no rule mentions and that is not an axis of the mesh
  (replicated);
- **conflict**: two ``TreePathShardingRule`` patterns match one leaf with different specs (the
  first wins; a last pattern matching every leaf is the default, not a conflict); two logical names
  of one leaf map to the same mesh axis (one dim loses it).

Rules shardax cannot look into (``PolicyShardingRule``, your own classes) are taken as they
are. ``shardax verify`` reports every finding; ``sjit`` warns once (`ReplicationWarning`) about
large leaves these findings leave replicated on every device.

>>> import numpy as np
>>> mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
>>> [f.message for f in rule_findings(FSDPShardingRule(min_fsdp_size=0),
...                                   {"w": np.zeros((6, 3))}, mesh)]
["FSDPShardingRule: no dim of shape (6, 3) divides by 'fsdp' (size 4): replicated over it"]
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
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
from shardax.utils import array_nbytes, leaf_shape, tree_path_to_string
from shardax.utils import human_bytes as _human

__all__ = ["Finding", "ReplicationWarning", "rule_findings", "replicated_silently",
           "warn_replicated"]


@dataclass(frozen=True)
class Finding:
    """One leaf the rules do not shard as they say: ``kind`` is 'dropped', 'unknown' or
    'conflict'; ``leaf`` is the leaf's index among the tree's array leaves (tree order);
    ``absent_axes``: the rule names only mesh axes this mesh lacks (a preset written for
    every mesh, or a typo)."""

    kind: str
    leaf: int
    message: str
    absent_axes: bool = False


class ReplicationWarning(UserWarning):
    """Large leaves that ``sjit``'s rules leave replicated on every device without being asked
    to (a logical name no rule knows, an axis that divides no dimension).

    Silence it with ``sjit(..., warn_replicated_bytes=None)`` or
    ``warnings.filterwarnings("ignore", category=shardax.ReplicationWarning)``.
    """


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
    ruled = {n for n, _ in rule.rules}
    unknown = [f"{name!r} (dim {dim})" for dim, name in enumerate(names)
               if name is not None and name not in ruled and name not in sizes]
    if unknown:
        known = ", ".join(dict.fromkeys(repr(n) for n, _ in rule.rules)) or "none"
        one = len(unknown) == 1
        yield "unknown", (f"logical name{'' if one else 's'} {' and '.join(unknown)} of "
                          f"{names} {'is' if one else 'are'} in no rule (the rules name "
                          f"{known}) and {'is not a mesh axis' if one else 'are not mesh axes'} "
                          f"{tuple(sizes)}: replicated")
    for dim, name in enumerate(names):
        wanted = [axes for n, axes in rule.rules if n == name]
        if name is not None and not wanted and name not in sizes:
            continue  # unknown: said above
        if not wanted and name in sizes:
            wanted = [name]  # a mesh axis's own name stands for it (LogicalAxisRules.spec_for)
        if name is None or spec[dim] is not None or not wanted or wanted[0] is None:
            continue
        asked = sorted({a for axes in wanted for a in _axes(axes)})
        present = [a for a in asked if a in sizes]
        if not present:
            yield "absent", (f"logical name {name!r} of dim {dim} maps to {asked}, not mesh "
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
                    findings.append(Finding("dropped" if kind == "absent" else kind, index,
                                            message, absent_axes=kind == "absent"))
                index += len(jax.tree.leaves(leaf))
    return findings


def _nbytes(leaf: Any) -> int:
    dtype = getattr(leaf, "dtype", None)
    return 0 if dtype is None else array_nbytes(leaf_shape(leaf), dtype)


def replicated_silently(rules: Any, tree: Any, mesh: Any, specs: Sequence[Any],
                        paths: Sequence[str], min_bytes: float) -> list[str]:
    """One line per leaf of ``tree`` of at least ``min_bytes`` left fully replicated by
    ``specs`` (one ``PartitionSpec`` or ``NamedSharding`` per leaf, None: unspecified, as
    ``match_specs_flat`` gives them) because ``rules`` could not shard it: a logical name that
    no rule knows, an axis that divides no dimension. Names a rule sends to axes this mesh lacks
    are not counted: presets name the axes of every mesh (``shardax verify`` reports those)."""
    leaves = jax.tree_util.tree_leaves(tree)
    big = {i for i, (leaf, spec) in enumerate(zip(leaves, specs))
           if spec is not None and not any(getattr(spec, "spec", spec))
           and _nbytes(leaf) >= min_bytes}
    if not big:
        return []
    why: dict[int, list[str]] = {}
    for finding in rule_findings(rules, tree, mesh):
        if (finding.leaf in big and finding.kind in ("unknown", "dropped")
                and not finding.absent_axes):
            why.setdefault(finding.leaf, []).append(finding.message)
    return [f"{paths[i]} ({'x'.join(map(str, leaf_shape(leaves[i])))} {leaves[i].dtype}, "
            f"{_human(_nbytes(leaves[i]))}): " + "; ".join(messages)
            for i, messages in sorted(why.items())]


_SHOWN = 10  # leaves a warning lists by name
_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, jax.__file__))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside shardax and JAX (the user's call)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        level, frame = level + 1, frame.f_back
    return level


def warn_replicated(name: str, mesh: Any, min_bytes: float,
                    parts: Sequence[tuple[Any, Any, Sequence[Any], Sequence[str]]]) -> bool:
    """Warns (`ReplicationWarning`) about the first of ``parts`` — ``(rules, tree, specs,
    paths)``, e.g. an sjit function's inputs, then its outputs — with leaves
    `replicated_silently` on ``mesh``; True if it warned.

    >>> import numpy as np
    >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {"w": jax.ShapeDtypeStruct((1027, 1023), np.float32)}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_replicated("step", mesh, 2**20, [(FSDPShardingRule(), tree,
    ...                                            [PartitionSpec()], ["params/w"])])
    True
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    sjit 'step': 1 leaf of at least 1.00 MiB is replicated on all 8 devices...
      params/w (1027x1023 float32, 4.01 MiB): FSDPShardingRule: no dim of shape (1027, 1023)...
    """
    if mesh.size <= 1:
        return False
    lines: list[str] = []
    for rules, tree, specs, paths in parts:
        lines = replicated_silently(rules, tree, mesh, specs, paths, min_bytes)
        if lines:
            break
    if not lines:
        return False
    more = len(lines) - _SHOWN
    shown = lines[:_SHOWN] + ([f"... and {more} more"] if more > 0 else [])
    leaf = "leaf" if len(lines) == 1 else "leaves"
    warnings.warn(
        f"sjit {name!r}: {len(lines)} {leaf} of at least {_human(min_bytes)} "
        f"{'is' if len(lines) == 1 else 'are'} replicated on all {mesh.size} devices: no rule "
        "shards them\n  " + "\n  ".join(shown) + "\n(add rules for them, or silence this "
        "with sjit(..., warn_replicated_bytes=None) or warnings.filterwarnings('ignore', "
        "category=shardax.ReplicationWarning))",
        ReplicationWarning, stacklevel=_user_stacklevel())
    return True
