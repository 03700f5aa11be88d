"""The one place that knows which JAX version is installed.

JAX moves fast (0.10 here, 0.11-0.12 elsewhere): every version-dependent call goes through this
module so the rest of shardax reads as plain, current JAX.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax._src import distributed as _distributed  # private: no public preemption-service query
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

__all__ = ["AUTO", "make_mesh", "set_mesh", "mesh_context", "abstract_mesh", "is_tracer",
           "varying_axes", "uses_mesh", "preemption_service_running", "sync_processes"]

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


def mesh_context(mesh: Mesh) -> Any:
    """Makes ``mesh`` the ambient mesh, also while a JAX transformation is tracing.

    ``jax.set_mesh`` refuses to run under a trace (it raises ``ValueError`` before changing
    anything); there the abstract mesh is what tracing reads, so that is set instead, unless the
    trace already has this mesh's axes (e.g. inside ``jax.shard_map``, whose manual axes must
    stay as they are).
    """
    try:
        return jax.set_mesh(mesh)
    except ValueError:
        pass
    ambient = abstract_mesh()
    if ambient is not None and ambient.shape == mesh.abstract_mesh.shape:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def is_tracer(x: Any) -> bool:
    """True for a value being traced by a JAX transformation (jit, grad, vmap, eval_shape...)."""
    return isinstance(x, jax.core.Tracer)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` varies inside ``shard_map`` (empty outside).
    JAX 0.10 keeps them on the type's ``manual_axis_type``; other versions as ``vma``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def shape_varying_axes(s: Any) -> frozenset:
    """`varying_axes` of a ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape`` returns inside
    ``shard_map``)."""
    mat = getattr(s, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(s, "vma", ()) or ())


def abstract_mesh() -> Any | None:
    """The ambient abstract mesh set by ``jax.set_mesh``, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def uses_mesh(jaxpr: Any) -> bool:
    """True when a traced program names a mesh anywhere (a sharding constraint, a
    ``shard_map``...), in its own equations or in those of the programs it calls.

    Such a program needs the mesh's devices; one that names none runs where ``jax.jit`` puts
    it (the inputs' devices).
    """
    def names_mesh(value: Any) -> bool:
        if isinstance(value, (Mesh, AbstractMesh, NamedSharding)):
            return True
        return isinstance(value, (tuple, list)) and any(names_mesh(v) for v in value)

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in inner.eqns:
        if any(names_mesh(v) for v in eqn.params.values()):
            return True
        if any(uses_mesh(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
            return True
    return False


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync service runs (a multi-process job that enabled it)."""
    state = getattr(_distributed, "global_state", None)
    return getattr(state, "preemption_sync_manager", None) is not None


def sync_processes(name: str) -> None:
    """Waits until every process of a multi-process job reaches this point (no-op alone)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
