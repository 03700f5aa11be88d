"""The flags ``shardax plan`` takes besides those of ``shardax train``, and their checks.

`PlanConfig` describes the target hardware and the layout search; `check_plan` validates it
before JAX starts (``--hbm`` and ``--target`` are checked by
`shardax.plan.command.check_device_flags`, which knows the device table).

>>> check_plan(PlanConfig(top=0))
Traceback (most recent call last):
shardax.errors.UsageError: --top 0: must be >= 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardax.errors import require
from shardax.train.config import coerce_fields, flag

__all__ = ["PlanConfig", "check_plan"]


@dataclass(frozen=True)
class PlanConfig:
    """The flags ``shardax plan`` takes besides those of ``shardax train``."""

    target: str | None = None
    """device whose peak FLOP/s, memory and link bandwidth the estimate uses, e.g. h100, h200,
    a100, b200, 'tpu v5p' (default: this machine's accelerator, else h100)"""
    hbm: str | None = None
    """memory per device, e.g. 80GiB or 94GB (default: the target's)"""
    link_gbps: float = 0.0
    """one-way link bandwidth per device within a host (NVLink, ICI) in GB/s (0: the
    target's)"""
    host_link_gbps: float = 0.0
    """one-way bandwidth per device across hosts (its NIC; DCN for TPUs) in GB/s (0: the
    target's)"""
    devices_per_host: int = 0
    """devices one host (NVLink domain, TPU slice) holds (0: the target's)"""
    flops_fraction: float = 0.0
    """fraction of peak FLOP/s a step achieves (0: the target's, or --calibrate's fit)"""
    link_fraction: float = 0.0
    """fraction of link bandwidth a collective achieves (0: the target's)"""
    collective_latency_us: float = 0.0
    """fixed cost of one collective in microseconds, whatever its size (0: the target's)"""
    comm_overlap: float = -1.0
    """fraction of the all-gathers' and reduce-scatters' time (FSDP's) hidden under compute;
    0: none (-1: the target's)"""
    search: bool = False
    """search meshes, remat, scan and microbatching for the fastest layout that fits (model,
    batch, sequence, precision and optimizer stay)"""
    top: int = 5
    """layouts to print with --search"""
    max_compiles: int = 16
    """layouts compiled with --search, analytically best first"""
    time_budget: float = 540.0
    """seconds --search may spend compiling"""
    jobs: int = 1
    """worker processes compiling in parallel with --search"""
    cache: str | None = None
    """directory of compiled-layout results (default ~/.cache/shardax/plan; 'none' disables
    it)"""
    json: str | None = None
    """also write the result here as JSON"""
    pipeline: bool = False
    """--search pipeline layouts within a host too (by default only where each stage is whole
    hosts, or when nothing else fits)"""
    topology: str | None = None
    """compile for this TPU slice of a TPU --target, chips per dimension (e.g. 2x2x1 for v5p,
    2x2 for v5e): memory and collectives from libtpu's compiler, no TPU needed (pip install
    libtpu); it sets --devices (default: compile for emulated CPU devices)"""
    calibrate: list[str] = field(default_factory=list)
    """run directories of past shardax train runs on the target: their measured step times
    fit the achievable fraction of peak FLOP/s (an explicit --flops-fraction wins)"""


def check_plan(config: PlanConfig) -> PlanConfig:
    """`check` for `PlanConfig` (the ``--hbm`` size and ``--target`` name are checked by
    `shardax.plan.command.run_plan`, which knows the device table)."""
    config = coerce_fields(config)
    for name in ("top", "max_compiles", "jobs"):
        require(getattr(config, name) >= 1, f"{flag(name)} {getattr(config, name)}: must be >= 1")
    for name in ("link_gbps", "host_link_gbps"):
        value = getattr(config, name)
        require(math.isfinite(value) and value >= 0,
               f"{flag(name)} {value}: must be a finite number >= 0")
    for name in ("flops_fraction", "link_fraction"):
        value = getattr(config, name)
        require(math.isfinite(value) and 0 <= value <= 1,
               f"{flag(name)} {value}: must be a fraction in (0, 1] (0: the target's)")
    require(math.isfinite(config.collective_latency_us) and config.collective_latency_us >= 0,
           f"--collective-latency-us {config.collective_latency_us}: must be a finite number "
           ">= 0 (0: the target's)")
    require(config.comm_overlap == -1 or 0 <= config.comm_overlap <= 1,
           f"--comm-overlap {config.comm_overlap}: must be a fraction in [0, 1] (-1: the "
           "target's)")
    require(config.devices_per_host >= 0,
           f"--devices-per-host {config.devices_per_host}: must be >= 1 (0: the target's)")
    require(math.isfinite(config.time_budget) and config.time_budget > 0,
           f"--time-budget {config.time_budget}: must be a finite number > 0")
    return config
