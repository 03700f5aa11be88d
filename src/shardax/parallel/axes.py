"""Mesh axis sizes, from an explicit mesh or the ``jax.set_mesh`` context: one lookup for all.

>>> axis_size("tp")  # no mesh set
1
"""

from __future__ import annotations

import jax

__all__ = ["axis_size", "manual_axes"]

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _mesh(mesh: Mesh | None) -> Mesh | None:
    m = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    return None if m is None or m.empty else m


def axis_size(name: str, mesh: Mesh | None = None) -> int:
    """Size of mesh axis ``name`` in ``mesh`` (default: the context mesh); 1 if it is absent.

    >>> axis_size("pp")
    1
    """
    m = _mesh(mesh)
    if m is None or name not in m.axis_names:
        return 1
    return int(m.shape[name])


def manual_axes(mesh: Mesh | None = None) -> frozenset[str]:
    """Axes of ``mesh`` (default: the context mesh) that an enclosing ``shard_map`` made manual.

    >>> manual_axes()
    frozenset()
    """
    m = _mesh(mesh)
    return frozenset(getattr(m, "manual_axes", ())) if m is not None else frozenset()
