"""``shardax plan --search``: enumerate parallel layouts, compile the promising ones, rank them.

1. Enumerate: every mesh over the device count with axes dp, fsdp, tp, pp, cp, ep whose sizes
   the model and batch allow ('tp' divides the KV heads and the MLP width and is at most 8;
   'pp' divides the layers; 'cp' divides the sequence into 2·cp chunks; 'ep' divides the
   experts; the batch axes divide the batch per microbatch), each with the rule preset that
   uses its axes, remat none / save_dots / full, scanned or unrolled layers (scanned only above
   12 layers; listed only, and no 'pp', where the layers differ), gradient accumulation
   1 / 2 / 4, and for 'pp' the gpipe and 1f1b schedules with P or 2P microbatches.
2. Prune analytically, before compiling: drop candidates whose parameters, gradients and
   optimizer state alone exceed the memory per device, and order the rest by an analytic step
   time (the roofline's compute term plus textbook collective bytes).
3. Compile up to ``max_compiles`` of them in that order abstractly
   (``estimate.compile_config``), in ``jobs`` worker processes, until ``budget_s`` runs out;
   each compiled peak recalibrates the formula (layouts it now puts over the limit are
   skipped); results are cached on disk by configuration, device count and JAX version.
4. Drop what does not fit; rank the rest by the estimated step time.

>>> result = search(TrainConfig(model="llama-small"), device_spec("h100"))  # doctest: +SKIP
>>> result.ranked[0].summary()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from shardax import layout, models
from shardax.devices import DeviceSpec
from shardax.errors import UsageError
from shardax.models.attention import BLOCKWISE_MIN_LEN
from shardax.plan import topology
from shardax.plan.estimate import (
    Compiled,
    Estimate,
    estimate,
    remat_factor,
    usable_bytes,
)
from shardax.train.config import STEP_FIELDS, TrainConfig, with_layout
from shardax.train.resolve import Resolved, layout_of, resolve
from shardax.train.run.mfu import flops_per_token
from shardax.utils import human_bytes as _human

__all__ = ["SearchResult", "analytic", "candidates", "layout_text", "search"]

log = logging.getLogger("shardax.plan")
AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
# 'names:' saves the attention's projections and output and recomputes the MLP (selective
# activation checkpointing, as torchtitan and MaxText's presets do).
REMAT = ("none", "save_dots", "names:q,k,v,attn_out", "full")
MESH_ORDER = ("pp", "dp", "fsdp", "cp", "ep", "tp")  # outermost (across hosts) first
GRAD_ACCUM = (1, 2, 4)
MAX_TP = 8  # one node's fast links
PRUNE_MARGIN = 1.2  # the analytic memory is rough: prune only what it puts clearly over
# The compile server's command line (`shardax.plan.worker`); tests replace it.
COMPILE_SERVER = [sys.executable, "-m", "shardax.plan.worker"]
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardax" / "plan"


@dataclass
class SearchResult:
    """``ranked``: fitting configurations, fastest first; the counts say what was cut where."""

    ranked: list[Estimate]
    enumerated: int
    pruned_memory: int
    compiled: int
    cached: int
    over_hbm: int
    failed: list[str] = field(default_factory=list)
    skipped_budget: int = 0
    #: the part of ``pruned_memory`` found only once compiled peaks corrected the formula
    pruned_calibrated: int = 0
    seconds: float = 0.0
    closest_over: list[Estimate] = field(default_factory=list)  # smallest peaks over the limit
    #: per entry of ``ranked``: the slower variants of its layout (`VARIANT_FIELDS` differ)
    variants: list[list[Estimate]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ranked": [e.to_dict() for e in self.ranked], "enumerated": self.enumerated,
                "pruned_memory": self.pruned_memory, "compiled": self.compiled,
                "cached": self.cached, "over_hbm": self.over_hbm, "failed": self.failed,
                "skipped_budget": self.skipped_budget, "seconds": self.seconds,
                "pruned_calibrated": self.pruned_calibrated,
                "closest_over": [e.to_dict() for e in self.closest_over],
                "variants": [[e.to_dict() for e in v] for v in self.variants]}


# How one layout runs rather than what it is: candidates that differ only in these are
# variants of one layout, listed folded into its best one.
VARIANT_FIELDS = ("attention", "scan_layers")


def layout_text(config: TrainConfig | dict[str, Any]) -> str:
    """One candidate in a line: mesh, rules, remat, accumulation, schedule and the variant
    fields.

    >>> layout_text(TrainConfig(mesh="fsdp=8", rules="fsdp", remat="full"))
    'fsdp=8 --rules fsdp --remat full --grad-accum 1 --attention auto --scan-layers True'
    """
    c = config if isinstance(config, dict) else dataclasses.asdict(config)
    text = (f"{c['mesh']} --rules {c['rules']} --remat {c['remat']} --grad-accum "
            f"{c['grad_accum']}")
    if "pp=" in c["mesh"]:
        text += f" --pp-schedule {c['pp_schedule']} --microbatches {c['microbatches']}"
    return text + "".join(f" --{k.replace('_', '-')} {c[k]}" for k in VARIANT_FIELDS)


def _fold(ranked: list[Estimate]) -> tuple[list[Estimate], list[list[Estimate]]]:
    """``ranked`` with the variants of one layout folded into its first (fastest) entry."""
    firsts: dict[tuple, int] = {}
    out: list[Estimate] = []
    variants: list[list[Estimate]] = []
    for est in ranked:
        key = tuple(sorted((k, str(v)) for k, v in est.config.items()
                           if k not in VARIANT_FIELDS))
        if key in firsts:
            variants[firsts[key]].append(est)
        else:
            firsts[key] = len(out)
            out.append(est)
            variants.append([])
    return out, variants


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in _factorizations(n // d, k - 1)]


def _preset(sizes: dict[str, int]) -> str:
    fsdp, tp = sizes.get("fsdp", 1) > 1, sizes.get("tp", 1) > 1
    return ("fsdp_tp" if tp else "fsdp") if fsdp else ("tp" if tp else "dp")


def _mesh_text(sizes: dict[str, int]) -> str:
    """Axes outermost first: 'tp' innermost, within a host; 'pp' outermost, across hosts."""
    kept = {a: sizes[a] for a in MESH_ORDER if sizes.get(a, 1) > 1} or {"dp": 1}
    return ",".join(f"{a}={s}" for a, s in kept.items())


def candidates(base: TrainConfig, devices: int, *, devices_per_host: int = 8,
               pipeline: bool = False) -> list[TrainConfig]:
    """Every layout of ``base``'s model and batch over ``devices`` that the model allows.
    Pipeline layouts only where each stage is whole hosts, unless ``pipeline``."""
    c = models.get_config(base.model)
    llama = isinstance(c, models.LlamaConfig)
    mixed = getattr(c, "mixed_layers", False)  # its layers cannot be stacked
    attentions = ("auto", "xla") if llama and base.seq_len >= BLOCKWISE_MIN_LEN else ("auto",)
    out = []
    for sizes_t in _factorizations(devices, len(AXES)):
        sizes = dict(zip(AXES, sizes_t))
        dp, fsdp, tp, pp, cp, ep = sizes_t
        if tp > MAX_TP or (tp > 1 and (c.mlp_dim % tp or
                                       getattr(c, "n_kv_heads", c.n_heads) % tp)):
            continue
        if not llama and (pp > 1 or cp > 1 or ep > 1):
            continue
        if pp > 1 and (c.n_layers % pp or not pipeline and (devices // pp) % devices_per_host):
            continue
        if cp > 1 and base.seq_len % (2 * cp):
            continue
        if ep > 1 and (not getattr(c, "n_experts", 0) or c.n_experts % ep):
            continue
        batch_split = dp * fsdp * ep
        if mixed and pp > 1:  # a pipeline needs stacked layers
            continue
        scans = (False,) if mixed else (True,) if pp > 1 or c.n_layers > 12 else (False, True)
        # Rule-based layouts only (no explicit TP): a pipeline's schedules, else none.
        pipelines = layout.pipeline_layouts(pp) or [None]
        accums = GRAD_ACCUM if pp == 1 else (1,)
        for remat, scan, attention, accum, lay in itertools.product(
                REMAT, scans, attentions, accums, pipelines):
            rows = accum * (lay.microbatches(pp) if lay else 1)
            if base.batch_size % rows or (base.batch_size // rows) % batch_split:
                continue
            config = with_layout(dataclasses.replace(
                base, mesh=_mesh_text(sizes), rules=_preset(sizes), grad_accum=accum), lay)
            out.append(dataclasses.replace(config, remat=remat, attention=attention,
                                           scan_layers=scan))
    return out


def axes_across_hosts(mesh: str, devices_per_host: int) -> set[str]:
    """The axes of a mesh string whose device groups span hosts (the last axis varies
    fastest over the devices, which are numbered host by host).

    >>> sorted(axes_across_hosts("pp=2,fsdp=8", 8))
    ['pp']
    """
    sizes = [(a, int(v)) for a, v in (p.split("=") for p in mesh.split(","))]
    out, stride = set(), 1
    for axis, size in reversed(sizes):
        if size > 1 and stride * size > devices_per_host:
            out.add(axis)
        stride *= size
    return out


def analytic(config: TrainConfig, devices: int, device: DeviceSpec) -> tuple[float, float]:
    """``(memory bytes per device, step seconds)`` from formulas alone, for pruning and
    ordering: parameters + gradients + optimizer moments divided over the axes that shard
    them, plus the activations kept for the backward pass; and the
    roofline with textbook collective bytes (gradient all-reduce / reduce-scatter, FSDP
    all-gathers per microbatch, Megatron TP's 4 activations all-reduces per layer)."""
    c = models.get_config(config.model)
    sizes = {a: 1 for a in AXES}
    sizes.update({k: int(v) for k, v in (p.split("=") for p in config.mesh.split(","))})
    n = models.param_count(c)
    param_bytes = 4 if "params=bfloat16" not in config.precision and config.precision not in (
        "bfloat16", "bf16") else 2
    moments = 8 if config.optimizer == "adamw" else 0
    model_split = sizes["fsdp"] * sizes["tp"] * sizes["pp"] * (
        sizes["ep"] if getattr(c, "n_experts", 0) else 1)
    state = n * (2 * param_bytes + moments) / model_split
    batch_split = sizes["dp"] * sizes["fsdp"] * sizes["ep"]
    state += _activation_bytes(config, c, sizes, batch_split)
    work = batch_split * sizes["cp"] * sizes["pp"] * sizes["tp"]
    flops = flops_per_token(c, config.seq_len) * config.batch_size * config.seq_len
    flops *= remat_factor(c, config.seq_len, config.remat) / work
    bubble = layout_of(config, sizes).bubble(sizes["pp"])
    shard_bytes = n * param_bytes / (sizes["tp"] * sizes["pp"])
    comm: dict[str, float] = dict.fromkeys(AXES, 0.0)  # bytes moved over each axis
    if batch_split > 1:  # gradient all-reduce (or reduce-scatter + all-gather)
        comm["fsdp" if sizes["fsdp"] > 1 else "dp"] += 2 * shard_bytes
    if sizes["fsdp"] > 1:
        comm["fsdp"] += shard_bytes * config.grad_accum * (2 if config.remat == "full" else 1)
    rows = config.batch_size // batch_split
    act = 2 if "bfloat16" in config.precision.split("output")[0] else 4
    layers = c.n_layers / sizes["pp"]
    if sizes["tp"] > 1:  # 2 all-reduces forward, 2 backward, of the [rows, seq, dim] stream
        comm["tp"] += 2 * 4 * layers * rows * config.seq_len * c.dim * act
    if sizes["cp"] > 1:  # ring attention: K and V go round the ring, forward and backward
        kv = getattr(c, "n_kv_heads", c.n_heads) * c.head_dim
        comm["cp"] += 3 * layers * (sizes["cp"] - 1) * 2 * rows * config.seq_len \
            / sizes["cp"] * kv * act
    if sizes["pp"] > 1:  # each microbatch's activations cross each stage boundary twice
        comm["pp"] += 2 * rows * config.seq_len / sizes["cp"] * c.dim * act
    spans = axes_across_hosts(config.mesh, device.devices_per_host)
    axis_s = {a: b / ((device.host_link_bytes_per_s if a in spans else device.link_bytes_per_s)
                      * device.link_fraction) for a, b in comm.items()}
    compute_s = flops / (device.peak_flops * device.flops_fraction) / (1 - bubble)
    # FSDP's gathers and gradient reduce-scatters run under compute (`estimate.hidden_seconds`).
    hidden = min(compute_s, device.comm_overlap * axis_s["fsdp"])
    return state, compute_s + sum(axis_s.values()) - hidden


def _activation_bytes(config: TrainConfig, c: Any, sizes: dict[str, int],
                      batch_split: int) -> float:
    """Activations saved for the backward pass per device (Korthikanti et al. 2022, without
    dropout: ~30·s·b·h + 5·a·s²·b bytes per layer in 16 bits with no remat; the inputs of the
    matmuls under save_dots; the named activations and the layer input under 'names:'; the
    layer input only under full remat), plus the logits. The s² scores term only where the
    attention materialises them ('xla', or 'auto' below the blockwise length)."""
    pp, cp, tp = sizes["pp"], sizes["cp"], sizes["tp"]
    lay = layout_of(config, sizes)
    in_flight = lay.in_flight(pp)
    rows = config.batch_size / (batch_split * config.grad_accum * lay.microbatches(pp))
    tokens = rows * config.seq_len / cp
    act = 2 if "bfloat16" in config.precision.split("output")[0] else 4
    h = c.dim
    scores = config.attention == "xla" or (config.attention == "auto"
                                           and config.seq_len < BLOCKWISE_MIN_LEN)
    heads, kv = c.n_heads * c.head_dim, getattr(c, "n_kv_heads", c.n_heads) * c.head_dim
    named = {"q": heads, "k": kv, "v": kv, "attn_out": heads, "attn_proj": h,
             "mlp_gate": c.mlp_dim, "mlp_up": c.mlp_dim, "mlp_hidden": c.mlp_dim, "mlp_out": h}
    if config.remat.startswith(("names:", "offload:")):
        kept = h + sum(named.get(n, 0) for n in config.remat.split(":", 1)[1].split(","))
        if config.remat.startswith("offload:"):
            kept = h
        per_layer = tokens * kept * act / tp
    else:
        per_layer = {
            "none": tokens * (30 * h + 5 * c.n_heads * config.seq_len / cp * scores)
            * act / 2 / tp,
            "save_dots": tokens * (4 * h + 3 * c.mlp_dim) * act / tp,
        }.get("save_dots" if config.remat == "dots" else config.remat, tokens * h * act)
    logits = 2 * tokens * c.vocab_size * 4 / tp
    return per_layer * c.n_layers / pp * in_flight + logits


def _key(config: TrainConfig, devices: int, run: Resolved) -> str:
    """The cache entry of a compiled layout: its step fields and the `Layout` resolved for
    its target (the FSDP mode and recompute its memory chose)."""
    text = json.dumps({"config": {k: getattr(config, k) for k in STEP_FIELDS},
                       "layout": dataclasses.asdict(run.layout),
                       "devices": devices, "jax": jax.__version__, "format": 4,
                       "backend": os.environ.get(topology.ENV) or jax.default_backend()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _load(cache: Path | None, key: str) -> Compiled | None:
    if cache is None or not (cache / f"{key}.json").exists():
        return None
    try:
        return Compiled(**json.loads((cache / f"{key}.json").read_text()))
    except (ValueError, TypeError):
        return None  # an unreadable entry is compiled again


def _store(cache: Path | None, key: str, compiled: Compiled) -> None:
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"{key}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(dataclasses.asdict(compiled)))
        tmp.replace(cache / f"{key}.json")


def _why(returncode: int, stderr: str) -> str:
    """The first informative line of a failed worker: its own message, XLA's CHECK line
    (glog ``F...``/``E...``), else the signal or exit code."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith("shardax plan worker:")), None)
    if line is not None:
        return line.removeprefix("shardax plan worker:").strip()[:200]
    line = next((ln for ln in lines if ln[:1] in "FE" and ln[1:5].isdigit()), None)
    if line is None and returncode < 0:
        try:
            line = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            line = f"killed by signal {-returncode}"
    return (line or f"exit code {returncode}")[:200]


class _Workers:
    """Compiles in up to ``jobs`` processes at a time, each forked from one compile server
    (`COMPILE_SERVER`, `shardax.plan.worker`; started at the first compile, ended by `stop`), so a
    layout that crashes the compiler (an XLA CHECK aborts its process) costs only its own
    process, also with ``jobs=1``, and no compile pays for an interpreter start and imports.
    The server inherits XLA_FLAGS (the device count) and JAX_PLATFORMS; the compiles' files go
    to a temporary directory, removed by `stop`."""

    def __init__(self, jobs: int):
        self.jobs, self.n = jobs, 0
        self.tmp = Path(tempfile.mkdtemp(prefix="shardax-plan-"))
        self.running: dict[int, tuple[TrainConfig, Path, Path]] = {}  # request id -> files
        self.server: subprocess.Popen | None = None
        self.pending = b""
        self.lost = ""  # why the server is gone, once it is (each compile then fails so)

    def free(self) -> bool:
        return len(self.running) < self.jobs

    def _start(self) -> subprocess.Popen | None:
        with open(self.tmp / "server.err", "w") as log_file:
            server = subprocess.Popen(COMPILE_SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log_file)
        if server.stdout.readline() == b"ready\n":
            return server
        self.lost = self._server_error(server)
        return None

    def _server_error(self, server: subprocess.Popen) -> str:
        why = _why(server.wait(), (self.tmp / "server.err").read_text(errors="replace"))
        return f"could not compile: the compile server ended ({why})"

    def submit(self, config: TrainConfig, memory: float) -> None:
        if self.server is None and not self.lost:
            self.server = self._start()
        self.n += 1
        out, err = self.tmp / f"{self.n}.json", self.tmp / f"{self.n}.err"
        self.running[self.n] = (config, out, err)
        if self.lost:
            return  # answered by `finished`
        request = {"id": self.n, "fields": {k: getattr(config, k) for k in STEP_FIELDS},
                   "out": str(out), "err": str(err), "memory": memory}
        try:
            self.server.stdin.write(json.dumps(request).encode() + b"\n")
            self.server.stdin.flush()
        except BrokenPipeError:
            self.lost = self._server_error(self.server)

    def finished(self) -> list[tuple[TrainConfig, dict | None, str]]:
        """The compiles that ended since the last call: ``(config, result fields, "")`` or
        ``(config, None, "could not compile: WHY")``."""
        done = []
        while self.running and not self.lost and select.select([self.server.stdout], [], [],
                                                              0)[0]:
            chunk = os.read(self.server.stdout.fileno(), 1 << 16)
            if not chunk:  # the server itself died: nothing running will answer
                self.lost = self._server_error(self.server)
                break
            self.pending += chunk
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                answer = json.loads(line)
                config, out, err = self.running.pop(answer["id"])
                if answer["code"] == 0 and out.exists():
                    done.append((config, json.loads(out.read_text()), ""))
                else:
                    why = _why(answer["code"], err.read_text(errors="replace")
                               if err.exists() else "")
                    done.append((config, None, f"could not compile: {why}"))
        if self.lost:
            done += [(config, None, self.lost) for config, _, _ in self.running.values()]
            self.running.clear()
        return done

    def stop(self) -> int:
        """Ends the server, which kills the compiles still running, and removes the compiles'
        files; returns the number of compiles killed."""
        n, self.running = len(self.running), {}
        if self.server is not None:
            with contextlib.suppress(BrokenPipeError):
                self.server.stdin.close()
            self.server.wait()
            self.server.stdout.close()
            self.server = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        return n


def search(base: TrainConfig, device: DeviceSpec, hbm_bytes: float | None = None, *,
           max_compiles: int = 16, budget_s: float = 600.0, jobs: int = 1,
           cache: Path | None = DEFAULT_CACHE, top: int | None = None,
           pipeline: bool = False) -> SearchResult:
    """Searches layouts of ``base`` (its model, batch, sequence, precision and optimizer) over
    ``jax.device_count()`` devices; returns the fitting ones ranked by estimated step time
    (near-ties, within 2%, by fewer mesh axes).

    Plain FSDP over all devices with full remat is always compiled first (the layout an
    engineer tries first). Pipeline layouts are searched only where each stage is whole hosts,
    unless ``pipeline``, or when nothing else fits (the search then runs again with them).
    The analytic memory is calibrated as results come in: once a compiled layout shows the
    formula underestimated its peak by a factor r, layouts whose formula memory x r is over
    the limit are no longer compiled."""
    start = time.perf_counter()
    hbm = hbm_bytes if hbm_bytes is not None else device.hbm_bytes
    usable = usable_bytes(device, hbm)
    devices = jax.device_count()
    every = candidates(base, devices, devices_per_host=device.devices_per_host,
                       pipeline=pipeline)
    scored = []
    pruned = 0
    baseline = _baseline(every, devices)
    for config in every:
        memory, step = analytic(config, devices, device)
        if memory > usable * PRUNE_MARGIN and config is not baseline:
            pruned += 1
            continue
        scored.append((step, memory, config))
    scored.sort(key=lambda x: x[0])
    # Plain FSDP first; then the analytically best layout of each mesh, then the runners-up:
    # the compile budget goes to different meshes before variants of one (remat,
    # accumulation) that rank together.
    seen: set[str] = set()
    firsts = [i for i, (_, _, c) in enumerate(scored) if not (c.mesh in seen or seen.add(c.mesh))]
    order = [scored[i] for i in firsts + sorted(set(range(len(scored))) - set(firsts))]
    order.sort(key=lambda item: item[2] is not baseline)  # stable: the rest keep their order
    log.info("search: %d layouts, %d over %.1f GiB by formula; compiling up to %d, "
             "analytically fastest first", len(every), pruned, hbm / 2**30, max_compiles)
    results: list[tuple[TrainConfig, Compiled]] = []
    failed: list[str] = []
    cached = calibrated = 0
    scale = 1.0 / PRUNE_MARGIN  # compiled peak / formula memory, the largest seen so far
    analytic_memory: dict[int, float] = {}
    resolved: dict[int, Resolved] = {}

    def take(config: TrainConfig, compiled: Compiled, how: str = "compiled") -> None:
        nonlocal scale
        results.append((config, compiled))
        log.info("  %s %d/%d: %s: peak %s per device (%s in %.1f s)", how, len(results),
                 max_compiles, layout_text(config), _human(compiled.peak_bytes),
                 "from the cache" if how == "cached" else "compiled", compiled.compile_s)
        scale = max(scale, compiled.peak_bytes / analytic_memory[id(config)])

    pending = iter(order)
    launched = 0
    skipped = 0
    workers = _Workers(jobs)
    try:
        while True:
            over_time = time.perf_counter() - start > budget_s
            # Launch (or compile inline) the next candidates that still look like they fit.
            while launched < max_compiles and not over_time and workers.free():
                item = next(pending, None)
                if item is None:
                    break
                _, memory, config = item
                if memory * scale > usable and config is not baseline:
                    calibrated += 1
                    continue
                try:
                    # what `shardax train` checks and runs on the target
                    resolved[id(config)] = resolve(config, usable, weights=False)
                except UsageError:
                    continue
                analytic_memory[id(config)] = memory
                launched += 1
                hit = _load(cache, _key(config, devices, resolved[id(config)]))
                if hit is not None:
                    cached += 1
                    take(config, hit, "cached")
                else:
                    workers.submit(config, usable)
            if not workers.running:
                break
            for config, fields, error in workers.finished():
                _collect(config, fields, error, take, failed, cache,
                         _key(config, devices, resolved[id(config)]))
            if time.perf_counter() - start > budget_s:
                skipped = workers.stop()
                break
            time.sleep(0.2)
    finally:
        workers.stop()
    estimates = [estimate(resolved[id(config)], compiled, device, hbm)
                 for config, compiled in results]
    fitting = sorted((e for e in estimates if e.fits), key=_rank)
    over = sorted((e for e in estimates if not e.fits), key=lambda e: e.compiled.peak_bytes)
    if not fitting and not pipeline and budget_s > time.perf_counter() - start:
        log.info("search: nothing fits without pipeline parallelism; searching pipelines too")
        again = search(base, device, hbm_bytes, max_compiles=max_compiles, jobs=jobs,
                       budget_s=budget_s - (time.perf_counter() - start), cache=cache, top=top,
                       pipeline=True)
        again.failed[:0] = failed
        again.seconds = time.perf_counter() - start
        return again
    ranked, variants = _fold(fitting)
    return SearchResult(
        ranked=ranked[:top] if top else ranked, enumerated=len(every),
        pruned_memory=pruned + calibrated, compiled=len(results) - cached, cached=cached,
        over_hbm=len(over), failed=failed, skipped_budget=skipped,
        seconds=time.perf_counter() - start, closest_over=over[:3],
        variants=variants[:top] if top else variants, pruned_calibrated=calibrated)


def _baseline(configs: list[TrainConfig], devices: int) -> TrainConfig | None:
    """Plain FSDP over all devices, full remat, no accumulation, default attention."""
    return next((c for c in configs if c.mesh == f"fsdp={devices}" and c.remat == "full"
                 and c.grad_accum == 1 and c.attention == "auto"), None)


def _rank(est: Estimate) -> tuple[float, int, float]:
    """Estimated step time; within 2% of each other, fewer mesh axes first."""
    return (round(math.log(est.step_s) / math.log(1.02)) if est.step_s > 0 else -math.inf,
            sum(v > 1 for v in est.compiled.mesh.values()), est.step_s)


def _collect(config: TrainConfig, fields: dict | None, error: str, take: Any,
             failed: list, cache: Path | None, key: str) -> None:
    if fields is None:
        log.info("  could not compile %s: %s", layout_text(config), error)
        failed.append(f"{config.mesh} remat={config.remat} grad_accum={config.grad_accum}: "
                      f"{error}")
        return
    compiled = Compiled(**fields)
    _store(cache, key, compiled)
    take(config, compiled)
