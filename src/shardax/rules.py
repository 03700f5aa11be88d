"""Sharding rules: turn any pytree into a tree of ``PartitionSpec``s.

A rule looks only at the tree (paths, shapes, framework metadata) and at the active mesh, so the
same rule serves parameters, optimizer states and activations alike.

>>> import jax.numpy as jnp
>>> FSDPShardingRule(fsdp_axis_size=8, min_fsdp_size=0).apply({"w": jnp.zeros((16, 4))})
{'w': P('fsdp', None)}
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardax import _context, frameworks
from shardax.utils import leaf_shape, tree_path_to_string

__all__ = [
    "ShardingRule",
    "FSDPShardingRule",
    "TreePathShardingRule",
    "PolicyShardingRule",
    "HostOffloadRule",
    "LogicalAxisRules",
    "mappings_as_rules",
    "match_specs",
    "match_shardings",
    "match_shardings_flat",
    "specs_to_shardings",
    "check_spec",
]

MeshAxes = str | tuple[str, ...] | None


class ShardingRule(abc.ABC):
    """A rule maps a pytree to a tree of ``PartitionSpec`` with the same structure.

    Framework parameter boxes (NNX ``Variable``s, linen ``Partitioned``) count as single leaves,
    so their specs sit where the box sits.
    """

    @abc.abstractmethod
    def apply(self, pytree: Any) -> Any:
        """Returns the ``PartitionSpec`` tree for ``pytree``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _is_rule_leaf(x: Any) -> bool:
    return frameworks.is_box(x)


def _map_leaves(f: Callable[[str, Any], Any], pytree: Any) -> Any:
    """Maps ``f(path, leaf)`` over leaves, treating framework boxes as leaves."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: f(tree_path_to_string(path, sep="/"), x), pytree, is_leaf=_is_rule_leaf
    )


def _shape(leaf: Any) -> tuple[int, ...]:
    return leaf_shape(frameworks.unbox(leaf))


def _axis_size(axes: MeshAxes, mesh: Any) -> int | None:
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if mesh is not None else {}
    if not names or any(n not in sizes for n in names):
        return None
    return math.prod(sizes[n] for n in names)


# ----------------------------------------------------------------------------- the rules


class FSDPShardingRule(ShardingRule):
    """Fully sharded data parallelism: shard each large leaf along one dimension.

    Leaves with fewer than ``min_fsdp_size`` elements are replicated. Otherwise the largest
    dimension divisible by the FSDP axis size is sharded (first one on ties); if none divides,
    the leaf is replicated. The axis size is ``fsdp_axis_size`` if given, else read from the
    active mesh (``fsdp_axis_name`` may be a tuple of mesh axes), else the largest power of two
    dividing some dimension (scalax's guess).

    >>> import jax.numpy as jnp
    >>> FSDPShardingRule(fsdp_axis_size=4, min_fsdp_size=0).apply(jnp.zeros((3, 8)))
    P(None, 'fsdp')
    """

    def __init__(
        self,
        fsdp_axis_name: MeshAxes = "fsdp",
        fsdp_axis_size: int | None = None,
        min_fsdp_size: int = 1048576,
    ):
        self.fsdp_axis_name = fsdp_axis_name
        self.fsdp_axis_size = fsdp_axis_size
        self.min_fsdp_size = min_fsdp_size

    @staticmethod
    def largest_power_of_two_divisor(n: int) -> int:
        """The largest power of two dividing ``n`` (scalax's guess of an axis size).

        >>> FSDPShardingRule.largest_power_of_two_divisor(24)
        8
        """
        return n & -n if n else 1

    def _spec(self, shape: tuple[int, ...], size: int | None) -> PartitionSpec:
        if not shape or math.prod(shape) < self.min_fsdp_size:
            return PartitionSpec()
        if size is None:  # no mesh to ask: shard the dim with the largest power-of-two factor
            twos = [-self.largest_power_of_two_divisor(n) if n > 1 else 0 for n in shape]
            order = np.argsort(twos, kind="stable")
            candidates = [i for i in order if shape[i] > 1]
        else:
            order = np.argsort([-n for n in shape], kind="stable")
            candidates = [i for i in order if shape[i] % size == 0 and shape[i] >= size]
        if not candidates:
            return PartitionSpec()
        entries: list[MeshAxes] = [None] * len(shape)
        entries[int(candidates[0])] = self.fsdp_axis_name
        return PartitionSpec(*entries)

    def apply(self, pytree: Any) -> Any:
        size = self.fsdp_axis_size
        if size is None:
            size = _axis_size(self.fsdp_axis_name, _context.active().mesh)
        return _map_leaves(lambda _, leaf: self._spec(_shape(leaf), size), pytree)


class TreePathShardingRule(ShardingRule):
    """Regular expressions on leaf paths (keys joined by ``/``); the first match wins.

    A value is a ``PartitionSpec`` or another ``ShardingRule`` applied to that leaf, so rules
    compose. Scalars and size-1 leaves are always replicated. With ``strict`` an unmatched
    path is an error; otherwise it is replicated.

    >>> rule = TreePathShardingRule(("norm", PartitionSpec()), (".*", FSDPShardingRule()))
    """

    def __init__(self, *rules: tuple[str, PartitionSpec | ShardingRule], strict: bool = True):
        for rule in rules:
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
                raise ValueError(f"each rule must be a (regex, spec_or_rule) pair, got {rule!r}")
            pattern, value = rule
            if not isinstance(value, (PartitionSpec, ShardingRule)):
                raise ValueError(
                    f"rule {pattern!r} maps to {value!r}; expected a PartitionSpec or ShardingRule"
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"rule pattern {pattern!r} is not a valid regex: {e}") from None
        self.rules = tuple((p, v) for p, v in rules)
        self.strict = strict

    def _spec(self, path: str, leaf: Any) -> PartitionSpec:
        shape = _shape(leaf)
        if not shape or math.prod(shape) == 1:
            return PartitionSpec()
        for pattern, value in self.rules:
            if re.search(pattern, path) is None:
                continue
            spec = value.apply(leaf) if isinstance(value, ShardingRule) else value
            if len(spec) > len(shape):
                raise ValueError(
                    f"rule {pattern!r} gives spec {spec} with {len(spec)} entries to leaf "
                    f"{path!r} of shape {shape} (rank {len(shape)})"
                )
            return spec
        if self.strict:
            raise ValueError(
                f"no sharding rule matches leaf {path!r} (shape {shape}); rules are "
                f"{[p for p, _ in self.rules]}. Add a pattern for it (e.g. ('.*', PartitionSpec()) "
                f"last) or pass strict=False to replicate unmatched leaves"
            )
        return PartitionSpec()

    def apply(self, pytree: Any) -> Any:
        return _map_leaves(self._spec, pytree)


class PolicyShardingRule(ShardingRule):
    """A rule from a callable ``policy(path, leaf) -> PartitionSpec``.

    >>> policy = lambda path, x: PartitionSpec("tp") if "w" in path else PartitionSpec()
    >>> PolicyShardingRule(policy).apply({"w": np.zeros(8), "b": np.zeros(8)})
    {'b': P(), 'w': P('tp',)}
    """

    def __init__(self, policy: Callable[[str, Any], PartitionSpec]):
        self.policy = policy

    def apply(self, pytree: Any) -> Any:
        return _map_leaves(self.policy, pytree)


class HostOffloadRule(ShardingRule):
    """``rule``'s specs, with the leaves kept in another memory of each device: by default
    ``'pinned_host'`` (host RAM the accelerator reads directly), e.g. optimizer state that
    only the update touches. A step that computes on such leaves moves them to the device
    first (``jax.device_put(x, jax.memory.Space.Device)``); its ``out_shardings`` put the
    results back.

    >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> [s.memory_kind for s in match_shardings_flat(
    ...     HostOffloadRule(PartitionSpec("fsdp")), [np.zeros(8)], mesh)]
    ['pinned_host']
    """

    def __init__(self, rule: ShardingRule | PartitionSpec, memory_kind: str = "pinned_host"):
        self.rule = rule
        self.memory_kind = memory_kind

    def apply(self, pytree: Any) -> Any:
        if isinstance(self.rule, PartitionSpec):
            return _map_leaves(lambda _, __: self.rule, pytree)
        return self.rule.apply(pytree)


class LogicalAxisRules(ShardingRule):
    """Maps logical axis names (``"embed"``, ``"mlp"``...) to mesh axes, in priority order.

    Rules are tried in order (earlier rules have priority) and a rule only applies if its mesh
    axes are all unused in this spec, so a name may appear several times as fallbacks. A name no
    rule mentions that is an axis of the active mesh maps to that axis (after the rules, if no
    other dim took it): ``(None, 'model')`` means what it means to Flax. Other unknown names,
    and names whose mesh axes are all absent from the active mesh, map to None; axes that the
    active mesh lacks are dropped, so one preset serves meshes with and without ``dp``.
    ``apply`` reads names from framework metadata (NNX ``out_sharding``, linen ``Partitioned``);
    leaves without names are replicated.

    >>> rules = LogicalAxisRules([("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("mlp", "tp")])
    >>> rules.spec_for(("embed", "mlp"))
    P('fsdp', 'tp')
    """

    def __init__(self, rules: Sequence[tuple[str, MeshAxes]] | Mapping[str, MeshAxes]):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        for item in items:
            ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
            if not ok:
                raise ValueError(f"each logical rule is a (name, mesh_axes) pair, got {item!r}")
        self.rules: tuple[tuple[str, MeshAxes], ...] = tuple(
            (name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in items
        )

    def __iter__(self) -> Iterator[tuple[str, MeshAxes]]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def spec_for(self, names: Sequence[str | None], mesh: Any | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` for one array whose dimensions have logical ``names``.

        Rules are read in order (as Flax's ``logical_to_mesh_axes`` does): a rule assigns its
        mesh axes to every still-unassigned dimension of that name if none of those axes is
        taken yet; ``(name, None)`` assigns "replicated". Then a name that no rule mentions
        and that is a free axis of the mesh takes that axis. What stays unassigned is
        replicated.

        >>> mesh = jax.make_mesh((2, 4), ("data", "model"),
        ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
        >>> LogicalAxisRules([("embed", "fsdp")]).spec_for((None, "model"), mesh)
        P(None, 'model')
        """
        mesh = mesh if mesh is not None else _context.active().mesh
        present = set(mesh.axis_names) if mesh is not None else None
        unassigned = object()
        result: list[Any] = [unassigned] * len(names)
        used: set[str] = set()
        for rule_name, axes in self.rules:
            dims = [i for i, n in enumerate(names) if n == rule_name and result[i] is unassigned]
            for dim in dims:
                if axes is None:
                    result[dim] = None
                    continue
                candidate = (axes,) if isinstance(axes, str) else tuple(axes)
                if present is not None:
                    candidate = tuple(a for a in candidate if a in present)
                if not candidate or used.intersection(candidate):
                    continue
                used.update(candidate)
                result[dim] = candidate[0] if len(candidate) == 1 else candidate
        # A name no rule mentions that is an axis of the mesh stands for that axis, as in
        # Flax's guides (``nnx.with_partitioning(init, (None, 'model'))``).
        ruled = {rule_name for rule_name, _ in self.rules}
        for dim, name in enumerate(names):
            if (result[dim] is unassigned and present is not None and name in present
                    and name not in ruled and name not in used):
                used.add(name)
                result[dim] = name
        return PartitionSpec(*(None if r is unassigned else r for r in result))

    def _spec(self, path: str, leaf: Any) -> PartitionSpec:
        names = frameworks.logical_names(leaf)
        if names is None:
            return PartitionSpec()
        shape = _shape(leaf)
        if len(names) != len(shape):
            raise ValueError(
                f"leaf {path!r} of shape {shape} has {len(names)} logical names {names}; "
                f"give one name (or None) per dimension"
            )
        return self.spec_for(names)

    def apply(self, pytree: Any) -> Any:
        return _map_leaves(self._spec, pytree)


# ----------------------------------------------------------------------------- matching


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, ShardingRule))


def check_spec(
    path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Any, what: str = "sharding"
) -> None:
    """Raises ``ValueError`` naming path, shape, spec and mesh if ``spec`` cannot shard it."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    where = f"{what}: leaf {path!r} of shape {tuple(shape)} with spec {spec} on mesh {sizes}"
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"{where}: expected a PartitionSpec, got {type(spec).__name__}")
    if len(spec) > len(shape):
        raise ValueError(f"{where}: the spec has {len(spec)} entries but the leaf rank is "
                         f"{len(shape)}")
    used: set[str] = set()
    for dim, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        for axis in axes:
            if axis not in sizes:
                raise ValueError(
                    f"{where}: unknown mesh axis {axis!r}; the mesh axes are {tuple(sizes)}"
                )
            if axis in used:
                raise ValueError(f"{where}: mesh axis {axis!r} is used for more than one dim")
            used.add(axis)
        split = math.prod(sizes[a] for a in axes)
        if shape[dim] % split:
            raise ValueError(
                f"{where}: dim {dim} of size {shape[dim]} is not divisible by mesh axes "
                f"{axes} of total size {split}"
            )


def _is_resource_mapping(x: Any) -> bool:
    """A dict from logical names to mesh axes (Haliax's ``ResourceMapping``), which a rule tree
    could not be otherwise: its values are neither rules, specs nor None."""

    def mesh_axes(v: Any) -> bool:
        return isinstance(v, str) or (
            isinstance(v, (tuple, list)) and not isinstance(v, PartitionSpec) and bool(v)
            and all(isinstance(a, str) for a in v))

    return isinstance(x, Mapping) and bool(x) and all(
        isinstance(k, str) and mesh_axes(v) for k, v in x.items())


def mappings_as_rules(rules: Any) -> Any:
    """``rules`` with each Haliax ``ResourceMapping`` in it (``{"embed": "data", "mlp":
    "model"}``) made the ``LogicalAxisRules`` it means.

    >>> mappings_as_rules(({"mlp": "tp"}, PartitionSpec("dp")))
    (LogicalAxisRules(rules=(('mlp', 'tp'),)), P('dp',))
    """
    return jax.tree_util.tree_map(
        lambda x: LogicalAxisRules(x) if _is_resource_mapping(x) else x, rules,
        is_leaf=lambda x: _is_resource_mapping(x) or _is_spec_leaf(x))


def match_specs_flat(
    rules: Any,
    pytree: Any,
    mesh: Any,
    *,
    what: str = "sharding",
    paths: list[str] | None = None,
    memory_kinds: list[str | None] | None = None,
) -> tuple[list[str], list[Any], list[PartitionSpec | None]]:
    """Paths, leaves and checked specs (None = unspecified) for every leaf of ``pytree``.

    ``rules`` is a tree prefix of ``pytree`` whose leaves are rules, specs or None. Error
    messages say ``what`` was being matched and name leaves by ``paths`` (default: tree paths).
    ``memory_kinds``, when given, is extended with each leaf's memory kind (a
    :class:`HostOffloadRule`'s, else None: the default memory).
    """
    rules = mappings_as_rules(rules)
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(pytree)
    if paths is None:
        paths = [tree_path_to_string(p, sep="/") for p, _ in path_leaves]
    leaves = [leaf for _, leaf in path_leaves]
    rule_leaves, rule_def = jax.tree_util.tree_flatten(rules, is_leaf=_is_spec_leaf)
    try:
        subtrees = rule_def.flatten_up_to(pytree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what}: the rules {rules!r} do not match the structure of the tree they are "
            f"applied to (rules must be a tree prefix of it): {e}"
        ) from None
    specs: list[PartitionSpec | None] = []
    with _context.resolving_on(mesh):
        for rule, subtree in zip(rule_leaves, subtrees):
            count = len(jax.tree_util.tree_leaves(subtree))
            if memory_kinds is not None:
                memory_kinds.extend([getattr(rule, "memory_kind", None)] * count)
            if rule is None or isinstance(rule, PartitionSpec):
                specs.extend([rule] * count)
                continue
            applied = rule.apply(subtree)
            applied_leaves, applied_def = jax.tree_util.tree_flatten(applied, is_leaf=_is_spec_leaf)
            for spec, part in zip(applied_leaves, applied_def.flatten_up_to(subtree)):
                specs.extend([spec] * len(jax.tree_util.tree_leaves(part)))
    for path, leaf, spec in zip(paths, leaves, specs):
        if spec is not None:
            check_spec(path, leaf_shape(leaf), spec, mesh, what)
    return paths, leaves, specs


def match_specs(rules: Any, pytree: Any, mesh: Any = None) -> Any:
    """The checked ``PartitionSpec`` tree (None where unspecified) for ``pytree``.

    >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> params, batch = {"w": np.zeros((16, 4))}, np.zeros((8, 2))
    >>> match_specs((FSDPShardingRule(min_fsdp_size=0), None), (params, batch), mesh)
    ({'w': P('fsdp', None)}, None)
    """
    mesh = mesh if mesh is not None else _context.active().mesh
    if mesh is None:
        raise ValueError("match_specs needs a mesh: pass one or call it inside a mesh context")
    _, _, specs = match_specs_flat(rules, pytree, mesh)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pytree), specs)


def match_shardings_flat(rules: Any, pytree: Any, mesh: Any, **kwargs: Any
                         ) -> list[NamedSharding | None]:
    """:func:`match_specs_flat`'s specs as ``NamedSharding``s (None stays None), each in the
    memory kind its rule asks for."""
    kinds: list[str | None] = []
    _, _, specs = match_specs_flat(rules, pytree, mesh, memory_kinds=kinds, **kwargs)
    return [None if s is None else NamedSharding(mesh, s, memory_kind=k)
            for s, k in zip(specs, kinds)]


def match_shardings(rules: Any, pytree: Any, mesh: Any) -> Any:
    """The ``NamedSharding`` tree (None where unspecified) for ``pytree``, memory kinds
    included.

    >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> match_shardings({"w": PartitionSpec("fsdp")}, {"w": np.zeros(8)}, mesh)["w"].spec
    P('fsdp',)
    """
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pytree),
                                        match_shardings_flat(rules, pytree, mesh))


def specs_to_shardings(spec_tree: Any, mesh: Any) -> Any:
    """Turns a spec tree into ``NamedSharding``s; None stays None (unspecified)."""
    return jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s),
        spec_tree,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
    )
