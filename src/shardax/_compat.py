"""The one place that knows which JAX version is installed.

JAX moves fast (0.10 here, 0.11-0.12 elsewhere): every version-dependent call goes through this
module so the rest of shardax reads as plain, current JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["AUTO", "make_mesh", "set_mesh", "abstract_mesh"]

AUTO = AxisType.Auto


def make_mesh(devices: np.ndarray, axis_names: Sequence[str]) -> Mesh:
    """A ``Mesh`` whose axes are all ``Auto`` (XLA propagates shardings), as scalax assumed.

    ``jax.make_mesh`` defaults to Explicit axes since 0.7, so the axis types are always spelled
    out here.
    """
    return Mesh(devices, tuple(axis_names), axis_types=(AUTO,) * len(axis_names))


def set_mesh(mesh: Mesh) -> Any:
    """Context manager that makes ``mesh`` the ambient mesh (``jax.set_mesh``)."""
    return jax.set_mesh(mesh)


def abstract_mesh() -> Any | None:
    """The ambient abstract mesh set by ``jax.set_mesh``, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh
