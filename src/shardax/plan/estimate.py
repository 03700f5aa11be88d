"""Compile a ``shardax train`` configuration from abstract shapes and estimate its cost.

Nothing is allocated and nothing runs: the train state's shapes come from ``jax.eval_shape``,
the step is lowered and compiled for ``jax.device_count()`` (emulated CPU) devices, and the
estimate reads the compiled program:

- memory per device: ``compiled.memory_analysis()`` (arguments, outputs, temporaries; peak =
  arguments + outputs - aliased (donated) + temporaries);
- collectives per step: the optimized HLO (``shardax.hlo.hlo_collectives``), loop trip
  counts included;
- step time, a roofline on the target's hardware model (`shardax.devices.DeviceSpec`):
  ``compute_s + comm_s`` with ``compute_s = model FLOPs per device x remat factor /
  (peak FLOP/s x achievable fraction) / (1 - pipeline bubble)`` and ``comm_s`` = the bytes of
  each collective (x 2 for all-reduce) over the achievable bandwidth of its tier: within a host,
  or across hosts where one of its device groups spans hosts, plus a fixed latency per
  collective executed; less the part of the all-gathers' and reduce-scatters' time (FSDP's
  traffic) that the device model takes as hidden under compute (``comm_overlap``, at most the
  compute time).

>>> est = plan_config(TrainConfig(model="llama-small"), device_spec("h100"))  # doctest: +SKIP
>>> print(est.summary())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from shardax.devices import DeviceSpec
from shardax.hlo import peak_bytes
from shardax.plan import depth
from shardax.plan.topology import memory_source, on_target
from shardax.train.build import abstract, step_function
from shardax.train.config import STEP_FIELDS, TrainConfig
from shardax.train.resolve import Resolved, resolve
from shardax.train.run.mfu import flops_per_token
from shardax.utils import human_bytes as _human

__all__ = ["Compiled", "Estimate", "across_bytes", "assumptions", "comm_seconds",
           "compile_config", "estimate", "hidden_seconds", "plan_config", "remat_factor",
           "seconds", "train_command", "usable_bytes"]

# Forward recomputed in the backward pass: (2 + 2 + 4) / (2 + 4) of the layers' FLOPs. A
# 'names:'/'offload:' policy recomputes the matmuls whose outputs it does not save
# (`_names_factor`).
_REMAT_FACTOR = {"none": 1.0, "dots": 1.0, "save_dots": 1.0, "offload": 1.0, "full": 8 / 6}
# Collectives a framework can run under compute: FSDP's parameter gathers (prefetched) and
# gradient reduce-scatters (issued as the backward produces each layer's gradients).
OVERLAPPED = ("all-gather", "reduce-scatter")


@dataclass
class Compiled:
    """What the compiled step says, independent of the target device (cached on disk)."""

    memory: dict[str, int]
    collectives: dict[str, dict[str, int]]  # kind -> {"count", "bytes"} per device per step
    devices: int
    mesh: dict[str, int]
    compile_s: float
    # str(devices per host) -> collective bytes (x 2 for all-reduce) whose device groups span
    # hosts of that size; a host size not listed: none cross (one host) or all do.
    across: dict[str, int] = field(default_factory=dict)
    # the depths compiled when the model's listed layers were extended from two shallow
    # copies of it (`shardax.plan.depth`); empty: the whole model was compiled
    depths: list[int] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return peak_bytes(self.memory)


@dataclass
class Estimate:
    """One configuration on one device type: memory, collectives, bubble and step time."""

    config: dict[str, Any]
    compiled: Compiled
    device: DeviceSpec
    hbm_bytes: float
    bubble: float
    flops_per_device: float
    compute_s: float
    comm_s: float
    notes: list[str] = field(default_factory=list)

    across_s: float = 0.0  # the part of comm_s spent on links across hosts
    hidden_s: float = 0.0  # the part of comm_s run under compute

    @property
    def fits(self) -> bool:
        return self.compiled.peak_bytes + self.device.reserved_bytes <= self.hbm_bytes

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s - self.hidden_s

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "command": train_command(self.config),
                "devices": self.compiled.devices, "mesh": self.compiled.mesh,
                "memory": self.compiled.memory, "peak_bytes": self.compiled.peak_bytes,
                "hbm_bytes": self.hbm_bytes, "fits": self.fits,
                "collectives": self.compiled.collectives, "bubble": self.bubble,
                "flops_per_device": self.flops_per_device, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "across_hosts_s": self.across_s,
                "hidden_s": self.hidden_s,
                "step_s": self.step_s, "device": self.device.name,
                "hardware": dataclasses.asdict(self.device),
                "compile_s": self.compiled.compile_s}

    def summary(self) -> str:
        m, c = self.compiled.memory, self.compiled
        used = {k: v for k, v in c.collectives.items() if v["count"]}
        lines = [
            f"plan: {self.config.get('init_from') or self.config['model']} on {c.devices} "
            "devices, mesh "
            + ", ".join(f"{k}={v}" for k, v in c.mesh.items())
            + f", rules {self.config['rules']!r}, remat {self.config['remat']}, "
            f"grad accum {self.config['grad_accum']}",
            f"memory per device: arguments {_human(m['argument_size_in_bytes'])}, outputs "
            f"{_human(m['output_size_in_bytes'])} ({_human(m['alias_size_in_bytes'])} aliased), "
            f"temporaries {_human(m['temp_size_in_bytes'])}; peak {_human(c.peak_bytes)} + "
            f"{_human(self.device.reserved_bytes)} reserved of {_human(self.hbm_bytes)}: "
            + ("fits" if self.fits else "DOES NOT FIT"),
            *([f"in host memory per device: {_human(m['host_argument_size_in_bytes'])} "
               "(--offload-optimizer: the optimizer state, moved to the device and back each "
               "step; not in the peak)"] if m.get("host_argument_size_in_bytes") else []),
            "collectives per step: " + (", ".join(
                f"{k} x{v['count']} ({_human(v['bytes'])})" for k, v in used.items()) or "none"),
            f"pipeline bubble: {self.bubble:.1%}",
            f"estimated step time on {self.device.name}: {seconds(self.step_s)} = compute "
            f"{seconds(self.compute_s)} ({self.flops_per_device:.3g} FLOPs per device) + "
            f"communication {seconds(self.comm_s)} ({seconds(self.across_s)} of it across "
            f"hosts) - {seconds(self.hidden_s)} of it hidden under compute",
            f"train it: {train_command(self.config)}",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def assumptions(device: DeviceSpec, hbm_bytes: float) -> str:
    """The hardware model an estimate rests on, as printed by ``shardax plan``."""
    d = device
    return (f"assumptions: {d.name}, {d.peak_flops / 1e12:.0f} TFLOP/s peak bf16 x "
            f"{d.flops_fraction:.2f} achievable; {_human(hbm_bytes)} per device, "
            f"{_human(d.reserved_bytes)} of it reserved outside the program; "
            f"{d.devices_per_host} devices per host; links {d.link_bytes_per_s / 1e9:.0f} GB/s "
            f"within a host and {d.host_link_bytes_per_s / 1e9:.1f} GB/s across hosts per "
            f"device, x {d.link_fraction:.2f} achievable, + {d.collective_latency_s * 1e6:.0f} µs "
            f"per collective; {d.comm_overlap:.0%} of the all-gathers' and reduce-scatters' "
            f"time hidden under compute (at most the compute time), no other overlap; "
            f"{memory_source()}")


def across_bytes(ops: list[Any], devices: int) -> dict[str, int]:
    """For each host size that divides ``devices`` (below it): the collective bytes (x 2 for
    all-reduce) whose device groups span hosts; ``ops``: `shardax.hlo.CollectiveOp`."""
    out = {}
    for per_host in (d for d in range(1, devices) if devices % d == 0):
        total = 0
        for op in ops:
            groups = op.groups if op.groups is not None else (tuple(range(devices)),)
            if any(len({i // per_host for i in g}) > 1 for g in groups):
                total += op.bytes * (2 if op.kind == "all-reduce" else 1)
        out[str(per_host)] = total
    return out


def comm_seconds(compiled: Compiled, device: DeviceSpec) -> tuple[float, float]:
    """``(total, across hosts)`` seconds of a compiled step's collectives on ``device``: their
    bytes over the bandwidth of their tier, plus ``device.collective_latency_s`` for each
    collective executed (a pipeline's per-iteration send and TP's per-layer all-reduces are
    many small ones)."""
    latency = sum(v["count"] for v in compiled.collectives.values()) * device.collective_latency_s
    moved = sum(v["bytes"] * (2 if k == "all-reduce" else 1)
                for k, v in compiled.collectives.items())
    per_host = device.devices_per_host
    if compiled.devices <= per_host:
        across = 0
    else:
        across = compiled.across.get(str(per_host), moved)
    across_s = across / (device.host_link_bytes_per_s * device.link_fraction)
    within_s = (moved - across) / (device.link_bytes_per_s * device.link_fraction)
    return within_s + across_s + latency, across_s


def hidden_seconds(compiled: Compiled, device: DeviceSpec, compute_s: float) -> float:
    """Seconds of a compiled step's communication run under its ``compute_s``: the
    ``device.comm_overlap`` fraction of the all-gathers' and reduce-scatters' share of the
    bandwidth time, at most ``compute_s``."""
    moved = sum(v["bytes"] * (2 if k == "all-reduce" else 1)
                for k, v in compiled.collectives.items())
    if not moved:
        return 0.0
    latency = sum(v["count"] for v in compiled.collectives.values()) * device.collective_latency_s
    share = sum(compiled.collectives.get(k, {"bytes": 0})["bytes"] for k in OVERLAPPED) / moved
    return min(compute_s, device.comm_overlap * share * (comm_seconds(compiled, device)[0]
                                                          - latency))


def seconds(s: float) -> str:
    """``0.0123`` -> ``'12.3 ms'``."""
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def train_command(config: dict[str, Any]) -> str:
    """The ``shardax train`` command line of a configuration (flags that differ from the
    defaults)."""
    defaults = TrainConfig().to_json()
    parts = ["shardax train"]
    for key in STEP_FIELDS:
        value = config.get(key, defaults[key])
        if value == defaults[key] and key not in ("model", "mesh", "rules"):
            continue
        if key == "model" and config.get("init_from"):  # --init-from replaces --model
            continue
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # tyro's pair: --scan-layers / --no-scan-layers
            parts.append(flag if value else f"--no-{flag[2:]}")
        else:
            text = str(value)
            parts += [flag, f"'{text}'" if any(ch in text for ch in " ;=,") and
                      key == "precision" else text]
    return " ".join(parts)


def remat_factor(model_config: Any, seq_len: int, policy: str) -> float:
    """Executed FLOPs / model FLOPs under the remat ``policy`` (``Layout.remat``; layers
    only: the output head is not rematerialised)."""
    factor = _REMAT_FACTOR.get(policy) or (
        _names_factor(model_config, policy, seq_len) if policy.startswith(("names:", "offload:"))
        else _REMAT_FACTOR["full"])
    total = flops_per_token(model_config, seq_len)
    head = 6.0 * model_config.vocab_size * model_config.dim
    return (head + (total - head) * factor) / total


def _names_factor(c: Any, policy: str, seq_len: int) -> float:
    """Executed / model FLOPs of a layer under a policy that saves some named activations:
    the forward work whose outputs are not saved runs again (``mlp_out``, the layer's output,
    is never needed by the backward pass)."""
    saved = set(policy.split(":", 1)[1].split(","))
    d, m, heads = c.dim, getattr(c, "mlp_dim", 4 * c.dim), c.n_heads * c.head_dim
    kv = getattr(c, "n_kv_heads", c.n_heads) * c.head_dim
    forward = {"q": 2 * d * heads, "k": 2 * d * kv, "v": 2 * d * kv,
               "attn_out": 4 * heads * seq_len, "attn_proj": 2 * heads * d,
               "mlp_gate": 2 * d * m, "mlp_up": 2 * d * m, "mlp_hidden": 0, "mlp_out": 0}
    total = sum(forward.values()) + 2 * d * m  # + the down projection (mlp_out)
    redone = sum(v for k, v in forward.items() if k not in saved)
    return 1.0 + redone / total / 3.0  # forward is a third of forward + backward


def compile_config(run: Resolved) -> Compiled:
    """Compiles the train step of a resolved config from abstract shapes on
    ``jax.device_count()`` devices (of the TPU slice of ``shardax plan --topology``, if any:
    `shardax.plan.topology`). A deep model of listed layers is compiled cut to one and two
    repeats of its layers and extended to its depth (`shardax.plan.depth`)."""
    cut = depth.repeats(run.model_config)
    if cut is None:
        return _compile(run)
    one, two = (_compile(dataclasses.replace(
        run, model_config=depth.shallow(run.model_config, cut, k))) for k in (1, 2))
    return depth.extend(one, two, cut)


def _compile(run: Resolved) -> Compiled:
    start = time.perf_counter()
    run = on_target(run)
    config = run.config
    graphdef, state_shape = abstract(run.model_config, run.tx, config.seed, run.mesh)
    shardings = run.shardings(state_shape)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state_shape, shardings)
    batch = (jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32),) * 2
    plan = step_function(run, graphdef, end_id=0).plan(state, batch)  # any id: same program
    collectives = {k: {"count": v.count, "bytes": v.bytes} for k, v in plan.collectives.items()}
    return Compiled(plan.memory, collectives, jax.device_count(), dict(run.mesh.shape),
                    time.perf_counter() - start,
                    across_bytes(plan.collective_ops, jax.device_count()))


def estimate(run: Resolved, compiled: Compiled, device: DeviceSpec,
             hbm_bytes: float | None = None) -> Estimate:
    """The roofline estimate of a compiled configuration on ``device``."""
    config = run.config
    tokens = config.batch_size * config.seq_len
    flops = flops_per_token(run.model_config, config.seq_len) * tokens
    flops *= remat_factor(run.model_config, config.seq_len, run.layout.remat) / run.work_split()
    bubble = run.bubble
    compute_s = flops / (device.peak_flops * device.flops_fraction) / (1.0 - bubble)
    comm_s, across_s = comm_seconds(compiled, device)
    notes = []
    if compiled.depths:
        notes.append(f"{run.model_config.n_layers} listed layers: compiled at "
                     f"{' and '.join(map(str, compiled.depths))} layers and extended "
                     f"linearly to {run.model_config.n_layers} (shardax.plan.depth)")
    return Estimate(
        config={k: getattr(config, k) for k in STEP_FIELDS}, compiled=compiled, device=device,
        hbm_bytes=hbm_bytes if hbm_bytes is not None else device.hbm_bytes, bubble=bubble,
        flops_per_device=flops, compute_s=compute_s, comm_s=comm_s,
        across_s=across_s, hidden_s=hidden_seconds(compiled, device, compute_s), notes=notes)


def usable_bytes(device: DeviceSpec, hbm_bytes: float | None = None) -> float:
    """What one device of the target may allocate: ``hbm_bytes`` (default: the device's
    memory) less what its runtime reserves. `resolve` weighs the FSDP mode against it, as
    ``shardax train`` does against the device's own limit."""
    return (device.hbm_bytes if hbm_bytes is None else hbm_bytes) - device.reserved_bytes


def plan_config(config: TrainConfig, device: DeviceSpec,
                hbm_bytes: float | None = None) -> Estimate:
    """Compile a checked ``config`` abstractly and estimate it on ``device`` (``hbm_bytes``
    defaults to the device's memory); a ``UsageError`` for a configuration the devices cannot
    run."""
    run = resolve(config, usable_bytes(device, hbm_bytes), weights=False)
    return estimate(run, compile_config(run), device, hbm_bytes)


def config_from_dict(fields: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from the step fields of an ``Estimate.config`` (the rest defaults)."""
    return dataclasses.replace(TrainConfig(), **fields)
