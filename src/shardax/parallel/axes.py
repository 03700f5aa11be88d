"""Mesh axis sizes, from an explicit mesh or the ``jax.set_mesh`` context: one lookup for all.

>>> axis_size("tp")  # no mesh set
1
"""

from __future__ import annotations

import jax

from shardax import _compat

__all__ = ["mesh_or_context", "axis_size", "manual_axes"]

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def mesh_or_context(mesh: Mesh | None = None) -> Mesh | None:
    """``mesh`` if given, else the context mesh (``jax.set_mesh``, ``shard_map``); None if
    there is none.

    >>> mesh_or_context() is None  # no mesh set
    True
    """
    m = mesh if mesh is not None else _compat.abstract_mesh()
    return None if m is None or m.empty else m


def axis_size(name: str, mesh: Mesh | None = None) -> int:
    """Size of mesh axis ``name`` in ``mesh`` (default: the context mesh); 1 if it is absent.

    >>> axis_size("pp")
    1
    """
    m = mesh_or_context(mesh)
    if m is None or name not in m.axis_names:
        return 1
    return int(m.shape[name])


def manual_axes(mesh: Mesh | None = None) -> frozenset[str]:
    """Axes of ``mesh`` (default: the context mesh) that an enclosing ``shard_map`` made manual.

    >>> manual_axes()
    frozenset()
    """
    m = mesh_or_context(mesh)
    return frozenset(getattr(m, "manual_axes", ())) if m is not None else frozenset()
