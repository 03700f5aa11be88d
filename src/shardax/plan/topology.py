"""Compile planned steps for a TPU slice without a TPU: libtpu's compiler on a described topology.

``shardax plan --target v5p --topology 2x2x1`` asks ``jax.experimental.topologies`` for the
devices of that slice (``libtpu`` must be importable: ``pip install libtpu``, no TPU needed);
every compile of the plan (``estimate.compile_config``, in the search's worker processes too)
then lowers the step onto a mesh of those devices, so the memory and the collectives are the
TPU compiler's, not the CPU's. The slice travels to the workers in the ``SHARDAX_TOPOLOGY``
environment variable, as the device count travels in ``XLA_FLAGS``. Without ``--topology``
nothing changes: the compile is for emulated CPU devices.

>>> topology_name("v5p", "2x2x1")
'v5p:2x2x1'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from typing import Any

from jax.experimental import topologies

from shardax.devices import device_spec
from shardax.errors import UsageError
from shardax.mesh import MeshShardingHelper

__all__ = ["ENV", "memory_source", "on_target", "select", "topology_name"]

ENV = "SHARDAX_TOPOLOGY"
# the device table's TPU names -> libtpu's topology prefixes
_PREFIX = {"TPU v4": "v4", "TPU v5e": "v5e", "TPU v5p": "v5p", "TPU v6e": "v6e"}


def topology_name(target: str | None, shape: str) -> str:
    """libtpu's name of a slice of ``target`` (a TPU of the device table) with ``shape``
    (chips per dimension, ``'2x2x1'``); a UsageError names the flag at fault."""
    spec = device_spec(target) if target else None
    prefix = _PREFIX.get(spec.name) if spec is not None else None
    if prefix is None:
        raise UsageError(f"--topology {shape}: needs a TPU --target ({', '.join(_PREFIX.values())}"
                         f"), got {target or 'none'}")
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}", shape):
        raise UsageError(f"--topology {shape!r}: expected chips per dimension, e.g. 2x2x1 or 4x4")
    return f"{prefix}:{shape}"


@functools.cache
def _devices(name: str) -> list[Any]:
    if importlib.util.find_spec("libtpu") is None:
        raise UsageError(f"--topology {name}: libtpu is not installed (pip install libtpu; no "
                         "TPU needed); without --topology the plan compiles for CPU")
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except Exception as e:  # libtpu's own message says what it cannot lay out
        raise UsageError(f"--topology {name}: {str(e).splitlines()[0]}") from None


def select(target: str | None, shape: str) -> int:
    """Makes every later compile of this process and its workers target the slice; returns
    its device count (what ``--devices`` must be)."""
    name = topology_name(target, shape)
    # this process and each worker load libtpu only to compile: libtpu's one-process-per-host
    # lock (for running on TPUs) would refuse the workers
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # one host, this one: without it libtpu logs an INVALID_ARGUMENT error (harmless) at load
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    count = len(_devices(name))
    os.environ[ENV] = name
    return count


def on_target(run: Any) -> Any:
    """``run`` (a `shardax.train.resolve.Resolved`) with its mesh over the selected slice's
    devices, or ``run`` itself when no slice is selected."""
    name = os.environ.get(ENV)
    if not name:
        return run
    mesh = MeshShardingHelper(run.mesh.axis_dims, run.mesh.axis_names, devices=_devices(name))
    return dataclasses.replace(run, mesh=mesh)


def memory_source() -> str:
    """Where the plan's memory comes from, for its printed assumptions."""
    name = os.environ.get(ENV)
    if name:
        return (f"memory and collectives from libtpu's compile for the TPU slice {name} (the "
                "TPU compiler's own buffers and fusions)")
    return ("memory from a CPU compile of the same program (GPU/TPU temporaries differ: keep a "
            "few GiB spare; --topology compiles for a TPU slice)")
