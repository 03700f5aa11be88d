"""Logical axis names for activations: names -> ``with_sharding_constraint`` when rules are active.

Model code calls ``with_logical_constraint(x, ('batch', 'length', 'embed'))``. The rules come
from ``use_logical_rules(...)`` or from the running ``sjit`` (its ``LogicalAxisRules``). Without
rules, or without a mesh set by ``jax.set_mesh``, it returns ``x`` unchanged, so the same model
runs on one device. The rules object is duck-typed: anything with a
``spec_for(names) -> PartitionSpec`` method (``shardax.rules.LogicalAxisRules`` is one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import AxisType, PartitionSpec

from shardax import _context


class SpecFor(Protocol):
    def spec_for(self, names: Sequence[str | None]) -> PartitionSpec: ...


@contextlib.contextmanager
def use_logical_rules(rules: SpecFor) -> Iterator[SpecFor]:
    """Make ``rules`` the logical-axis rules that ``with_logical_constraint`` uses in this thread.

    Example::

        with jax.set_mesh(mesh), use_logical_rules(rules):
            logits = jax.jit(lambda m, t: m(t))(model, tokens)
    """
    if not callable(getattr(rules, "spec_for", None)):
        raise ValueError(
            f"use_logical_rules needs an object with a spec_for(names) method, got {rules!r}"
        )
    with _context.pushed_logical_rules(rules):
        yield rules


def current_logical_rules() -> SpecFor | None:
    """The innermost rules of this thread: pushed by ``use_logical_rules``, else those of the
    active ``sjit`` / ``get_context`` (its ``logical_axis_rules``), else ``None``."""
    return _context.active().logical_rules


def auto_mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the logical axis ``name`` maps to under the current rules and mesh where
    the partitioner places it: less the axes manual in an enclosing ``jax.shard_map``; ``()``
    without rules or a mesh, or where one of them has an explicit axis type.

    >>> auto_mesh_axes("batch")  # no rules active
    ()
    """
    rules, mesh = current_logical_rules(), _context.active().abstract_mesh
    if rules is None or mesh is None:
        return ()
    spec = rules.spec_for((name,))
    axes = tuple(a for a in _entry_axes(spec[0] if len(spec) else None)
                 if a not in set(mesh.manual_axes))
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return () if any(types.get(a) != AxisType.Auto for a in axes) else axes


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _fit_to_mesh(spec: PartitionSpec, names: Sequence[str | None], shape, mesh) -> PartitionSpec:
    """Drop manual (shard_map) axes and check the rest exist in the mesh."""
    manual = set(mesh.manual_axes)
    entries = []
    for dim, entry in enumerate(spec):
        axes = tuple(a for a in _entry_axes(entry) if a not in manual)
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"with_logical_constraint: logical axis {names[dim]!r} (dim {dim} of shape "
                f"{tuple(shape)}) maps to mesh axes {unknown} that are not in the mesh "
                f"{dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}"
            )
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def with_logical_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain activation ``x`` to the sharding its logical ``names`` map to; else a no-op.

    Mesh axes that are manual in the current ``jax.shard_map`` are left out of the spec. The
    rules are read at trace time and ``jax.jit`` caches traces per mesh, not per rules: under one
    mesh, wrap a fresh ``jax.jit`` when switching rules.

    Example::

        h = with_logical_constraint(h, ('batch', 'length', 'mlp'))
    """
    names = tuple(names)
    if len(names) != x.ndim:
        raise ValueError(
            f"with_logical_constraint: {len(names)} logical names {names} for an array of rank "
            f"{x.ndim} (shape {tuple(x.shape)})"
        )
    rules = current_logical_rules()
    if rules is None:
        return x
    mesh = _context.active().abstract_mesh
    if mesh is None:
        return x
    spec = _fit_to_mesh(rules.spec_for(names), names, x.shape, mesh)
    if len(spec) > x.ndim:
        raise ValueError(
            f"with_logical_constraint: rules gave spec {spec} with {len(spec)} entries for names "
            f"{names} of an array of shape {tuple(x.shape)}"
        )
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] == AxisType.Explicit for entry in spec for a in _entry_axes(entry)):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)
