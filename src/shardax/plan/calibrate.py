"""Fit the planner's achievable fraction of peak FLOP/s to the step times of past runs.

``shardax plan --calibrate RUN_DIR...`` reads each run directory that ``shardax train`` wrote:
``config.json`` (what ran), ``plan.json`` (what its compiled step held and moved per device)
and ``metrics.jsonl`` (measured ``step_time_s``; the median of the logged steps after the
first, which includes compilation). The estimate of a run on the target is
``compute_at_peak / fraction + comm_s - hidden``, the same roofline as
`shardax.plan.estimate` (``hidden``: the communication run under that compute); the
fraction that minimises the squared log error over the runs replaces the target's
``flops_fraction``. The runs are taken to have run on the target (the run directory does not
record the device kind): calibrate with runs of the kind you plan for.

>>> device, fits = calibrate([Path("runs/a")], device_spec("h100"))  # doctest: +SKIP
>>> print(fits[0].line())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardax import models
from shardax.devices import DeviceSpec
from shardax.errors import UsageError
from shardax.filecheck import parse_json, read_json, read_text
from shardax.plan.estimate import Compiled, comm_seconds, hidden_seconds, remat_factor, seconds
from shardax.train.config import TrainConfig
from shardax.train.configfile import from_dict
from shardax.train.resolve import layout_of
from shardax.train.run.mfu import flops_per_token

__all__ = ["RunFit", "calibrate", "read_run"]


@dataclass
class RunFit:
    """One past run: measured and estimated step time (before and after calibration)."""

    run_dir: Path
    measured_s: float
    compute_at_peak_s: float  # its compute term at 100% of peak FLOP/s
    comm_s: float
    before_s: float = 0.0
    after_s: float = 0.0
    measured_peak_bytes: float | None = None
    compiled_peak_bytes: float = 0.0
    compiled: Compiled | None = None  # for the communication hidden under compute

    def estimate_s(self, fraction: float, device: DeviceSpec) -> float:
        """The roofline step time of this run at ``fraction`` of ``device``'s peak FLOP/s."""
        compute = self.compute_at_peak_s / fraction
        hidden = hidden_seconds(self.compiled, device, compute) if self.compiled else 0.0
        return compute + self.comm_s - hidden

    def line(self) -> str:
        memory = "" if self.measured_peak_bytes is None else (
            f"; memory measured {self.measured_peak_bytes / 2**30:.2f} GiB vs compiled "
            f"{self.compiled_peak_bytes / 2**30:.2f} GiB")
        return (f"  {self.run_dir}: measured {seconds(self.measured_s)} per step, estimated "
                f"{seconds(self.before_s)} before, {seconds(self.after_s)} after{memory}")


def _work_split(mesh: dict[str, int], rules: str) -> int:
    """Devices one step's FLOPs divide over: the batch axes, 'cp', 'pp', and 'tp' unless the
    preset replicates over it (as `Resolved.work_split`, from the names alone)."""
    axes = {"dp", "fsdp", "ep", "cp", "pp"} | ({"tp"} if rules not in ("dp", "fsdp") else set())
    return math.prod(size for axis, size in mesh.items() if axis in axes)


def read_run(run_dir: Path, device: DeviceSpec) -> RunFit:
    """One run directory as a `RunFit` (estimates not yet filled in); a UsageError names a
    missing or unreadable file."""
    files = {name: run_dir / name for name in ("config.json", "plan.json", "metrics.jsonl")}
    for name, path in files.items():
        if not path.is_file():
            raise UsageError(f"--calibrate {run_dir}: no {name} (a run directory of shardax "
                             "train holds config.json, plan.json and metrics.jsonl)")
    try:
        raw = read_json(files["config.json"])
        if not isinstance(raw, dict):
            raise ValueError(f"{files['config.json']}: a JSON {type(raw).__name__}, expected "
                             "an object")
        config = from_dict(TrainConfig, {k: v for k, v in raw.items()
                                         if k in {f.name for f in dataclasses.fields(TrainConfig)}},
                           where=f"--calibrate {files['config.json']}: ")
        plan = read_json(files["plan.json"])
        metrics = read_text(files["metrics.jsonl"], 2**30)
        records = [parse_json(line, f"{files['metrics.jsonl']} line {n}")
                   for n, line in enumerate(metrics.splitlines(), 1)
                   if line.strip().startswith("{")]
    except ValueError as e:
        raise UsageError(f"--calibrate {run_dir}: cannot read it: {e}") from None
    times = [r["step_time_s"] for r in records[1:] if r.get("step_time_s")]
    if not times:
        raise UsageError(f"--calibrate {run_dir}: metrics.jsonl has no step_time_s after the "
                         "first logged step (train longer, or log more often)")
    mesh = {k: int(v) for k, v in plan["mesh"].items()}
    compiled = Compiled(plan["memory"], plan["collectives"], math.prod(mesh.values()), mesh, 0.0)
    c = models.get_config(config.model)
    tokens = config.batch_size * config.seq_len
    flops = (flops_per_token(c, config.seq_len) * tokens
             * remat_factor(c, config.seq_len, config.remat))
    flops /= _work_split(mesh, config.rules)
    pp = mesh.get("pp", 1)
    bubble = layout_of(config, mesh).bubble(pp)
    peaks = [r["memory_peak_gib"] for r in records if r.get("memory_peak_gib")]
    return RunFit(run_dir, statistics.median(times),
                  flops / device.peak_flops / (1.0 - bubble), comm_seconds(compiled, device)[0],
                  measured_peak_bytes=max(peaks) * 2**30 if peaks else None,
                  compiled_peak_bytes=compiled.peak_bytes, compiled=compiled)


def calibrate(run_dirs: list[Path], device: DeviceSpec) -> tuple[DeviceSpec, list[RunFit]]:
    """``device`` with ``flops_fraction`` fitted to the runs, and each run's fit."""
    fits = [read_run(Path(d), device) for d in run_dirs]
    grid = np.geomspace(1e-9, 1.0, 4001)  # CPU runs against a GPU's peak land far down

    def error(fraction: float) -> float:
        return sum((math.log(f.estimate_s(fraction, device)) - math.log(f.measured_s)) ** 2
                   for f in fits)

    best = float(min(grid, key=error))
    for f in fits:
        f.before_s = f.estimate_s(device.flops_fraction, device)
        f.after_s = f.estimate_s(best, device)
    return dataclasses.replace(device, flops_fraction=best), fits
