"""Sharding constraints for intermediate values, written once in model code.

Both functions return their input untouched outside an ``sjit`` / ``get_context`` context, so
the same code runs on one device.

>>> import jax.numpy as jnp
>>> h = jnp.ones((8, 4))
>>> with_sharding_annotation(h, "activations") is h   # outside sjit: h itself
True
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardax import _context
from shardax.rules import match_specs_flat

__all__ = ["with_sharding_constraint", "with_sharding_annotation"]


def with_sharding_constraint(pytree: Any, sharding_rule: Any, *, what: str = "constraint") -> Any:
    """Constrains ``pytree`` to the sharding a rule, a spec, or a prefix tree of them gives.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec
    >>> from shardax import MeshShardingHelper
    >>> mesh = MeshShardingHelper([-1], ["fsdp"])
    >>> f = mesh.sjit(lambda x: with_sharding_constraint(x * 2, PartitionSpec("fsdp")))
    >>> f(jnp.ones((8, 4))).sharding.spec
    P('fsdp',)
    """
    context = _context.active().frame
    if context is None:
        return pytree
    mesh = context.mesh_helper.mesh
    _, leaves, specs = match_specs_flat(sharding_rule, pytree, mesh, what=what)
    constrained = [
        leaf if spec is None else jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
        for leaf, spec in zip(leaves, specs)
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pytree), constrained)


def with_sharding_annotation(pytree: Any, sharding_name: str) -> Any:
    """Constrains ``pytree`` to whatever ``annotation_shardings[name]`` of the active sjit says.

    The model code names the value; the call site decides how it is sharded. A name the
    context does not know is left unconstrained, with one warning per trace.
    """
    context = _context.active().frame
    if context is None:
        return pytree
    known = context.annotation_shardings or {}
    rule = known.get(sharding_name)
    if rule is None:
        if sharding_name not in context.warned_annotations and sharding_name not in known:
            context.warned_annotations.add(sharding_name)
            warnings.warn(
                f"sharding annotation {sharding_name!r} is not in annotation_shardings "
                f"(known: {sorted(known)}); leaving it unconstrained",
                UserWarning,
                stacklevel=2,
            )
        return pytree
    return with_sharding_constraint(pytree, rule, what=f"annotation {sharding_name!r}")

