"""Sharding constraints for intermediate values, written once in model code.

Both functions return their input untouched outside an ``sjit`` / ``get_context`` context, so
the same code runs on one device.

>>> h = with_sharding_annotation(h, "activations")  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardax import _compat
from shardax.mesh import current_context
from shardax.rules import match_specs_flat

__all__ = ["with_sharding_constraint", "with_sharding_annotation", "with_logical_constraint"]


def with_sharding_constraint(pytree: Any, rule_or_spec: Any, *, what: str = "constraint") -> Any:
    """Constrains ``pytree`` to the sharding a rule, a spec, or a prefix tree of them gives.

    >>> x = with_sharding_constraint(x, PartitionSpec("fsdp", None))  # doctest: +SKIP
    """
    context = current_context()
    if context is None:
        return pytree
    mesh = context.mesh_helper.mesh
    _, leaves, specs = match_specs_flat(rule_or_spec, pytree, mesh, what=what)
    constrained = [
        leaf if spec is None else jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
        for leaf, spec in zip(leaves, specs)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pytree), constrained)


def with_sharding_annotation(pytree: Any, name: str) -> Any:
    """Constrains ``pytree`` to whatever ``annotation_shardings[name]`` of the active sjit says.

    The model code names the value; the call site decides how it is sharded. A name the
    context does not know is left unconstrained, with one warning per trace.
    """
    context = current_context()
    if context is None:
        return pytree
    rule = context.annotation_shardings.get(name)
    if rule is None:
        if name not in context.warned_annotations and name not in context.annotation_shardings:
            context.warned_annotations.add(name)
            warnings.warn(
                f"sharding annotation {name!r} is not in annotation_shardings "
                f"(known: {sorted(context.annotation_shardings)}); leaving it unconstrained",
                UserWarning,
                stacklevel=2,
            )
        return pytree
    return with_sharding_constraint(pytree, rule, what=f"annotation {name!r}")


def with_logical_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains ``x`` by logical axis names, mapped by the context's ``LogicalAxisRules``.

    Model code states what each dimension *is* (``("batch", "length", "embed")``); the rules
    of the running ``sjit`` decide where it lives. Without a context or rules, ``x`` is
    returned as is. Inside ``jax.shard_map``, axes that are manual there are left out.

    >>> h = with_logical_constraint(h, ("batch", "length", "embed"))  # doctest: +SKIP
    """
    context = current_context()
    rules = None if context is None else context.logical_axis_rules
    if rules is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(
            f"with_logical_constraint: {len(names)} names {tuple(names)} for an array of "
            f"shape {tuple(x.shape)}; give one name (or None) per dimension"
        )
    mesh = context.mesh_helper.mesh
    spec = rules.spec_for(names, mesh)
    manual = set(getattr(_compat.abstract_mesh(), "manual_axes", ()) or ())
    if manual:
        spec = PartitionSpec(*(_without(entry, manual) for entry in spec))
        return jax.lax.with_sharding_constraint(x, spec)
    return with_sharding_constraint(x, spec, what=f"logical constraint {tuple(names)}")


def _without(entry: Any, axes: set[str]) -> Any:
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
