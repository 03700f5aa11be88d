"""``shardax plan``: from the parsed settings to the printed plan (or search ranking).

    shardax plan --model llama-small --mesh fsdp=4,tp=2 --devices 8 --target h100
    shardax plan --model llama-8b --batch-size 256 --seq-len 4096 --devices 256 --hbm 80GiB \\
        --precision params=float32,compute=bfloat16 --search
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax

from shardax.devices import DeviceSpec, device_spec
from shardax.errors import UsageError
from shardax.plan.calibrate import calibrate
from shardax.plan.config import PlanConfig
from shardax.plan.estimate import (
    assumptions,
    plan_config,
    seconds,
    train_command,
    usable_bytes,
)
from shardax.plan.search import DEFAULT_CACHE, layout_text, search
from shardax.train.config import TrainConfig
from shardax.train.resolve import resolve

__all__ = ["check_device_flags", "parse_bytes", "target_device", "run_plan"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``'80GiB'`` -> 85899345920.0; ``'94GB'`` -> 94e9; a ValueError names the flag.

    >>> parse_bytes('80GiB') == 80 * 2**30
    True
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--hbm {text!r}: expected a size such as 80GiB, 94GB or 8e10")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def target_device(name: str | None, peak_tflops: float = 0.0, link_gbps: float = 0.0,
                  **overrides: float) -> DeviceSpec:
    """The device the estimate is for: ``name`` from the table (default: the local
    accelerator if the table knows it, else H100), with the overrides applied (``overrides``:
    `DeviceSpec` fields; zeros keep the table's value).

    >>> target_device("h100", devices_per_host=4).devices_per_host
    4
    """
    if name:
        spec = device_spec(name)
        if spec is None:
            raise ValueError(f"--target {name!r} is not in the device table; pass "
                             "--peak-tflops, --hbm and --link-gbps with a known --target")
    else:
        spec = device_spec(jax.devices()[0].device_kind) or device_spec("h100")
    if peak_tflops:
        spec = dataclasses.replace(spec, peak_flops=peak_tflops * 1e12)
    if link_gbps:
        spec = dataclasses.replace(spec, link_bytes_per_s=link_gbps * 1e9)
    return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v})


def _hardware(config: TrainConfig, args: PlanConfig) -> DeviceSpec:
    """The target with every ``shardax plan`` override applied."""
    device = target_device(args.target, config.peak_tflops, args.link_gbps,
                           host_link_bytes_per_s=args.host_link_gbps * 1e9,
                           devices_per_host=args.devices_per_host,
                           flops_fraction=args.flops_fraction,
                           link_fraction=args.link_fraction,
                           collective_latency_s=args.collective_latency_us * 1e-6)
    if args.comm_overlap >= 0:  # 0 is a setting here (no overlap), not "the target's"
        device = dataclasses.replace(device, comm_overlap=args.comm_overlap)
    return device


def check_device_flags(args: PlanConfig) -> None:
    """``--hbm`` and ``--target`` checked without touching a device (UsageError naming the
    flag), so that ``shardax plan`` reports them before a backend starts."""
    try:
        if args.hbm:
            parse_bytes(args.hbm)
        if args.target:
            target_device(args.target)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_plan(config: TrainConfig, args: PlanConfig) -> int:
    """Runs ``shardax plan`` for checked settings (``config``: what ``shardax train`` would
    run; ``args``: the plan-only flags); bad input is a UsageError. Call it with
    ``jax.device_count()`` devices already set up (``shardax.cli`` emulates ``--devices``)."""
    try:
        device = _hardware(config, args)
        hbm = parse_bytes(args.hbm) if args.hbm else device.hbm_bytes
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.calibrate:
        fitted, fits = calibrate([Path(d) for d in args.calibrate], device)
        print(f"calibration from {len(fits)} run(s): achievable fraction of peak FLOP/s "
              f"{fitted.flops_fraction:.3g} (the table's: {device.flops_fraction:.2f})"
              + ("; --flops-fraction given, so not used" if args.flops_fraction else ""))
        for fit in fits:
            print(fit.line())
        if not args.flops_fraction:
            device = fitted
    print(assumptions(device, hbm))
    if args.search:
        cache = None if args.cache == "none" else Path(args.cache or DEFAULT_CACHE)
        result = search(config, device, hbm, max_compiles=args.max_compiles,
                        budget_s=args.time_budget, jobs=args.jobs, cache=cache, top=args.top,
                        pipeline=args.pipeline)
        print(f"searched {result.enumerated} layouts on {jax.device_count()} devices in "
              f"{result.seconds:.0f} s: {result.pruned_memory} over {hbm / 2**30:.1f} GiB "
              f"by formula ({result.pruned_memory - result.pruned_calibrated} before "
              f"compiling, {result.pruned_calibrated} once compiled peaks corrected it), "
              f"{result.compiled} compiled ({result.cached} from the cache), "
              f"{result.over_hbm} over by compiled memory, {len(result.failed)} refused, "
              f"{result.skipped_budget} left out of the time budget")
        for reason in result.failed:
            print(f"refused: {reason}")
        if not result.ranked:
            print("no layout fits: try a smaller --batch-size or --seq-len, bf16 parameters, "
                  "more --devices or a larger --max-compiles / --time-budget")
            for est in result.closest_over:
                print(f"  closest: {est.compiled.peak_bytes / 2**30:.1f} GiB peak: "
                      f"{train_command(est.config)}")
        for rank, (est, variants) in enumerate(zip(result.ranked, result.variants), 1):
            print(f"\n#{rank}  estimated {seconds(est.step_s)} per step, peak "
                  f"{est.compiled.peak_bytes / 2**30:.2f} GiB per device\n{est.summary()}")
            for other in variants:  # the same layout run another way: folded into it
                print(f"  variant: {layout_text(other.config)}: {seconds(other.step_s)} per "
                      f"step, peak {other.compiled.peak_bytes / 2**30:.2f} GiB")
        payload = result.to_dict()
    else:
        est = plan_config(config, device, hbm)
        print(est.summary())
        run = resolve(config, usable_bytes(device, hbm), weights=False)
        if run.mesh_why:
            print(f"mesh: {run.mesh_why}")
        if run.mesh.shape.get("fsdp", 1) > 1:  # the FSDP mode, its recompute, and why
            print(run.fsdp_summary())
        payload = est.to_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0
