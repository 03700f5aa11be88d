"""Fits a train config to the devices left after an elastic restart, by one fixed rule.

``shardax launch --elastic`` restarts a failed job on the processes left; each ``shardax
train`` process then calls `refit` with the device count of the first attempt and its own:

- the model axes (``tp``, ``pp``, ``cp``, ``ep``) keep their sizes: the parameters' layout
  within a model replica, the layer stacking of a pipeline and the attention split stay;
- the data axes (``dp``, ``fsdp``) take the devices left: ``fsdp`` becomes the largest
  divisor of its old size that divides them (so every parameter dim it split still splits
  evenly) and ``dp`` the rest (8 devices ``fsdp=8`` -> 6 devices ``dp=3,fsdp=2``);
- ``--grad-accum`` grows to the smallest count, at least ``old * old data size / new data
  size``, that splits ``--batch-size`` evenly: a device never holds more rows of a
  microbatch than before, and the global batch (so the batch of every step, a function of the
  seed and the step only) stays the same. The mean gradient is the same sum in another order.

A config that cannot be fitted (the devices left do not hold the model axes, or no count of
microbatches splits the batch) is a `UsageError` naming both layouts.

>>> config = TrainConfig(mesh="fsdp=-1", batch_size=24, grad_accum=1)
>>> new, why = refit(config, devices_before=8, devices_now=6)
>>> new.mesh, new.grad_accum
('dp=3,fsdp=2', 2)
"""

from __future__ import annotations

import dataclasses
import math

from shardax.errors import UsageError
from shardax.layout.axes import BATCH_AXES
from shardax.train.config import TrainConfig, parse_mesh
from shardax.train.resolve import layout_of

__all__ = ["refit", "resolve_sizes"]


def resolve_sizes(sizes: dict[str, int], devices: int, mesh: str) -> dict[str, int]:
    """The mesh sizes with the one ``-1`` resolved against ``devices``.

    >>> resolve_sizes({"tp": 2, "fsdp": -1}, 8, "tp=2,fsdp=-1")
    {'tp': 2, 'fsdp': 4}
    """
    known = math.prod(s for s in sizes.values() if s != -1)
    if devices % known or (-1 not in sizes.values() and known != devices):
        raise UsageError(f"--mesh {mesh!r} does not fit {devices} devices")
    return {a: devices // known if s == -1 else s for a, s in sizes.items()}


def _mesh_string(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def refit(config: TrainConfig, devices_before: int, devices_now: int
          ) -> tuple[TrainConfig, str]:
    """``(config fitted to devices_now, one line saying what changed)``; the config itself
    when nothing changes. ``config`` is what the job was started with on ``devices_before``."""
    before = resolve_sizes(parse_mesh(config.mesh), devices_before, config.mesh)
    if devices_now == devices_before:
        return config, f"{devices_now} devices, mesh {_mesh_string(before)} as before"
    model = {a: s for a, s in before.items() if a not in BATCH_AXES}
    model_size = math.prod(model.values())
    data_before = math.prod(before.get(a, 1) for a in BATCH_AXES)
    old = f"mesh {_mesh_string(before)} on {devices_before} devices"
    if devices_now % model_size:
        raise UsageError(f"elastic restart: the model axes {model} of {old} do not fit the "
                         f"{devices_now} devices left")
    data_now = devices_now // model_size
    # Every parameter dim the old 'fsdp' size divided, a divisor of it divides too.
    fsdp = math.gcd(before.get("fsdp", 1), data_now)
    data = {"dp": data_now // fsdp, "fsdp": fsdp}
    sizes = {a: data.get(a, s) for a, s in before.items()}  # the user's axis order
    for axis in reversed(BATCH_AXES):  # a new data axis goes first ('dp' major)
        if axis not in sizes and data[axis] > 1:
            sizes = {axis: data[axis], **sizes}
    pp = before.get("pp", 1)
    micro = layout_of(config, before).microbatches(pp)
    least = math.ceil(config.grad_accum * data_before / data_now)
    fits = [g for g in range(least, config.batch_size + 1)
            if config.batch_size % (data_now * g * micro) == 0]
    if not fits:
        raise UsageError(f"elastic restart: --batch-size {config.batch_size} cannot be split "
                         f"over the {data_now} data-parallel devices left in microbatches of at "
                         f"most {config.batch_size // (data_before * config.grad_accum)} rows "
                         f"per device ({old}); use a batch size divisible by more device counts")
    new = dataclasses.replace(config, mesh=_mesh_string(sizes), grad_accum=fits[0])
    return new, (f"{old} -> mesh {new.mesh} on {devices_now} devices; --grad-accum "
                 f"{config.grad_accum} -> {new.grad_accum} (global batch {config.batch_size} and "
                 "data order kept)")
