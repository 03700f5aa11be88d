"""``shardax train``: train a byte-level language model, sharded by rules, with checkpoints.

A run directory holds ``config.json``, ``metrics.jsonl`` (one JSON object per logged step),
``loss.png`` and ``checkpoints/``. Everything that decides the numbers (model, seed, data order,
optimizer state, step) is in the checkpoint, so ``--resume`` continues bit for bit, on the same
mesh or, resharded, on another one.

>>> metrics = train(TrainConfig(steps=20, out="runs/demo"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from shardax import models
from shardax.distributed import batch_part
from shardax.mesh import MeshShardingHelper
from shardax.parallel.pipeline import bubble_fraction
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train import data as data_lib
from shardax.train.checkpoint import Checkpointer, abstract_state
from shardax.train.mfu import device_spec, flops_per_token, mfu
from shardax.train.profiler import StepProfiler, parse_profile_steps
from shardax.train.step import eval_loss, init_state, make_optimizer, make_schedule, train_step
from shardax.train.trackers import MissingExtra, check_installed, make_trackers, parse_log_to
from shardax.utils import flatten_tree

__all__ = ["TrainConfig", "UsageError", "train", "generate", "resolve", "step_function"]

CHECKPOINT_DIR = "checkpoints"
PROFILE_DIR = "profile"
log = logging.getLogger("shardax.train")
# Settings a resumed run must share with the run it continues (the mesh may change).
_FIXED_ON_RESUME = ("model", "seed", "batch_size", "seq_len", "data", "optimizer", "lr",
                    "grad_accum", "precision", "scan_layers")


class UsageError(ValueError):
    """Bad input from the user: the CLI prints it as one line and exits with code 2."""


@dataclass
class TrainConfig:
    """Everything ``shardax train`` takes; field names are the CLI flags."""

    model: str = "llama-tiny"
    mesh: str = "fsdp=-1"
    rules: str = "fsdp_tp"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    precision: str = "float32"
    remat: str = "none"
    scan_layers: bool = False  # stack the layers and run them with nnx.scan (faster compiles)
    grad_accum: int = 1
    seed: int = 0
    optimizer: str = "adamw"
    tp_mode: str = "none"
    sequence_parallel: bool = False
    pp_schedule: str = "gpipe"
    microbatches: int = 0  # 0: the 'pp' size
    virtual_stages: int = 1
    out: str = "runs/train"
    ckpt_every: int = 100
    resume: bool = False
    log_every: int = 10
    eval_every: int = 100
    data: list[str] = field(default_factory=list)
    log_to: str = "jsonl"  # comma-separated: jsonl (always), tensorboard, wandb
    profile_steps: str = ""  # START:STOP, e.g. 10:13 traces steps 10, 11 and 12
    peak_tflops: float = 0.0  # peak TFLOP/s per device for MFU; 0: from the device table

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Run:
    """What ``prepare`` resolved from a config: the pieces the loop needs."""

    config: TrainConfig
    mesh: MeshShardingHelper
    rules: LogicalAxisRules
    model_config: Any
    policy: Policy
    tx: Any
    train_data: data_lib.TokenBatches | None
    val_data: list
    out: Path


def _usage(check: bool, message: str) -> None:
    if not check:
        raise UsageError(message)


def _load_tokens(config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    try:
        if config.data:
            tokens = data_lib.load_bytes(data_lib.list_text_files(config.data))
            return data_lib.split_tokens(tokens)
        return (data_lib.load_bytes(data_lib.default_corpus("train")),
                data_lib.load_bytes(data_lib.default_corpus("val")))
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--data: {e}") from None


_MESH_AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")


def _pipelined(mesh: str) -> bool:
    """Whether a ``--mesh`` string has a 'pp' axis of size > 1 (Llama layers then stacked)."""
    sizes = dict(part.strip().partition("=")[::2] for part in mesh.split(","))
    return sizes.get("pp", "1").strip() not in ("1", "")


def _parallelism(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any):
    """The model config with the parallelism flags applied, and the rules fitted to the mesh
    and model (``models.presets.resolve``); a ValueError names the flag, axis and sizes."""
    unknown = [a for a in mesh_shape if a not in _MESH_AXES]
    if unknown:
        raise ValueError(f"--mesh: unknown axes {unknown}; shardax train knows {_MESH_AXES}")
    pp = mesh_shape.get("pp", 1)
    if config.microbatches < 0 or config.virtual_stages < 1:
        raise ValueError(f"--microbatches {config.microbatches} must be >= 0 (0: the 'pp' size) "
                         f"and --virtual-stages {config.virtual_stages} >= 1")
    if pp == 1 and (config.microbatches > 1 or config.virtual_stages > 1):
        raise ValueError("--microbatches and --virtual-stages need a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape}); use --grad-accum to split the batch without one")
    if pp == 1 and config.pp_schedule != "gpipe":
        raise ValueError(f"--pp-schedule {config.pp_schedule} needs a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape})")
    asked = {"tp_mode": config.tp_mode != "none", "sequence_parallel": config.sequence_parallel}
    if not isinstance(model_config, models.LlamaConfig):
        used = [k for k, v in asked.items() if v] + [a for a in ("pp", "cp", "ep")
                                                      if mesh_shape.get(a, 1) > 1]
        if used:
            raise ValueError(f"{config.model} does not support {used}; use a llama model")
        return model_config, models.PRESETS[config.rules]
    tp_mode = config.tp_mode
    if config.sequence_parallel and tp_mode == "none":
        tp_mode = "sync"  # sequence parallelism runs through the explicit TP blocks
    model_config = dataclasses.replace(
        model_config, tp_mode=tp_mode, sequence_parallel=config.sequence_parallel,
        scan_layers=model_config.scan_layers or pp > 1, pp_schedule=config.pp_schedule,
        pp_microbatches=config.microbatches or pp, pp_virtual_stages=config.virtual_stages)
    models.check_mesh(model_config, mesh_shape, batch_size=config.batch_size,
                      seq_len=config.seq_len)
    rules = models.presets.resolve(
        models.PRESETS[config.rules], mesh_shape, heads=model_config.n_heads,
        kv_heads=model_config.n_kv_heads, sequence_parallel=model_config.sp)
    return model_config, rules


def _pipeline_summary(model_config, stages: int) -> str:
    """One line: the pipeline schedule and its bubble (the idle fraction of a step)."""
    c = model_config
    v = c.pp_virtual_stages if c.pp_schedule == "circular" else 1
    bubble = bubble_fraction(c.pp_schedule, stages, c.pp_microbatches, v)
    virtual = f", {v} virtual stages" if c.pp_schedule == "circular" else ""
    return (f"pipeline: {c.pp_schedule} over {stages} stages, {c.pp_microbatches} "
            f"microbatches{virtual}, bubble {bubble:.1%} of each step")


def resolve(config: TrainConfig) -> _Run:
    """The mesh, rules, model config, precision and optimizer a config asks for, checked
    against each other (no data, no run directory: what ``shardax plan`` needs too); bad
    input is a UsageError."""
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every",
                 "ckpt_every"):
        _usage(getattr(config, name) > 0, f"--{name.replace('_', '-')} must be positive")
    try:
        mesh = MeshShardingHelper.from_string(config.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {config.mesh!r}: {e}") from None
    _usage(config.rules in models.PRESETS,
           f"unknown --rules {config.rules!r}; known presets: {sorted(models.PRESETS)}")
    _usage(config.model in models.CONFIGS,
           f"unknown --model {config.model!r}; known models: {sorted(models.CONFIGS)}")
    try:
        policy = Policy.from_string(config.precision)
        model_config = models.get_config(
            config.model, remat=config.remat, dtype=policy.compute, param_dtype=policy.params,
            max_seq_len=max(config.seq_len, models.CONFIGS[config.model].max_seq_len),
            scan_layers=config.scan_layers or models.CONFIGS[config.model].scan_layers,
        )
        tx = make_optimizer(config.optimizer, config.lr, config.steps, warmup=config.steps // 20)
        model_config, rule_list = _parallelism(config, mesh.shape, model_config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        check_installed(parse_log_to(config.log_to))
        parse_profile_steps(config.profile_steps)
    except (ValueError, MissingExtra) as e:
        raise UsageError(str(e)) from None
    _usage(config.peak_tflops >= 0, "--peak-tflops must be >= 0 (0: from the device table)")
    rules = LogicalAxisRules(rule_list)
    batch_axes = rules.spec_for(("batch",), mesh.mesh)[0]
    batch_split = math.prod(mesh.shape[a] for a in ((batch_axes,) if isinstance(batch_axes, str)
                                                  else batch_axes or ()))
    micro = getattr(model_config, "pp_microbatches", 1) if mesh.shape.get("pp", 1) > 1 else 1
    _usage(config.batch_size % (batch_split * config.grad_accum * micro) == 0,
           f"--batch-size {config.batch_size} must be divisible by the data-parallel size "
           f"{batch_split} (mesh {mesh.shape}) times --grad-accum {config.grad_accum}"
           + (f" times --microbatches {micro}" if micro > 1 else ""))
    _usage(config.batch_size % jax.process_count() == 0,
           f"--batch-size {config.batch_size} must be divisible by the process count "
           f"{jax.process_count()}")
    return _Run(config, mesh, rules, model_config, policy, tx, None, [], Path(config.out))


def prepare(config: TrainConfig) -> _Run:
    """Checks the config against the machine and builds the run; bad input is a UsageError."""
    run = resolve(config)
    mesh, rules = run.mesh, run.rules
    out = Path(config.out)
    ckpt_dir = out / CHECKPOINT_DIR
    has_checkpoint = False
    if ckpt_dir.exists():
        with Checkpointer(ckpt_dir) as probe:
            has_checkpoint = probe.latest_step() is not None
    if config.resume:
        _usage(has_checkpoint, f"--resume: no checkpoint in {ckpt_dir}")
        _usage((out / "config.json").exists(),
               f"--resume: {out} has checkpoints but no config.json; it is not a shardax run")
        saved = json.loads((out / "config.json").read_text())
        _usage(_pipelined(saved["mesh"]) == _pipelined(config.mesh),
               f"--resume: the run was trained on mesh {saved['mesh']!r}; a run with a 'pp' "
               "axis keeps its layers stacked, so resume with a 'pp' axis exactly when it had one")
        saved = {**TrainConfig().to_json(), **saved}  # runs from before a field existed
        changed = [k for k in _FIXED_ON_RESUME if saved.get(k) != getattr(config, k)]
        _usage(not changed, "--resume: these settings differ from the run being resumed: " +
               ", ".join(f"--{k.replace('_', '-')} {getattr(config, k)!r} (was {saved.get(k)!r})"
                         for k in changed))
    else:
        _usage(not has_checkpoint,
               f"{out} already holds checkpoints of another run; pass --resume to continue it "
               f"or choose another --out")

    train_tokens, val_tokens = _load_tokens(config)
    try:
        # Each process reads only the rows its devices hold (all of them if a model axis spans
        # the processes); with one process that is the whole batch.
        part, parts = batch_part(
            jax.sharding.NamedSharding(mesh.mesh, rules.spec_for(("batch", "length"), mesh.mesh)),
            (config.batch_size, config.seq_len))
        batches = data_lib.TokenBatches(
            train_tokens, config.seq_len, config.batch_size, seed=config.seed,
            process_index=part, process_count=parts)
        val = data_lib.val_batches(
            val_tokens, config.seq_len, config.batch_size, num_batches=4,
            process_index=part, process_count=parts)
    except ValueError as e:
        raise UsageError(f"data: {e}") from None
    return dataclasses.replace(run, train_data=batches, val_data=val)


def _create(run: _Run):
    return init_state(lambda: models.create(run.model_config, nnx.Rngs(run.config.seed)), run.tx)


def _abstract(run: _Run) -> tuple[Any, Any]:
    """The model's graphdef and the train state's shapes, without computing anything."""
    graphdefs = []

    def state_only():
        graphdef, state = _create(run)
        graphdefs.append(graphdef)  # static structure, no tracers: safe to keep
        return state

    with run.mesh.get_context():
        state_shape = jax.eval_shape(state_only)
    return graphdefs[0], state_shape


def step_function(run: _Run, graphdef: Any):
    """The sharded train step of a run (``ShardedFunction``: call it, or ``.plan()`` it)."""
    rules = run.rules
    return run.mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=run.tx, policy=run.policy,
                grad_accum=run.config.grad_accum, param_rules=rules),
        in_shardings=(rules, rules.spec_for(("batch", "length"), run.mesh.mesh)),
        out_shardings=(rules, None),
        donate_argnums=0,
    )


def _flat(state: Any) -> dict[str, Any]:
    """The checkpointed form of a state: a flat ``{path: array}`` dict, independent of the
    pytree node classes (NNX, optax) that hold the arrays."""
    return flatten_tree(state, sep=".")


def _restore(ckpt: Checkpointer, state_shape: Any, shardings: Any, like: Any):
    target = abstract_state(_flat(state_shape), _flat(shardings))
    restored = ckpt.restore(target=target)
    leaves = [restored.state[k] for k in _flat(state_shape)]
    return restored.step, jax.tree_util.tree_unflatten(jax.tree.structure(like), leaves), \
        restored.extra


class _Progress:
    """A rich progress bar with loss, tokens/s and step time; plain lines when not a TTY."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.console = Console(stderr=False)
        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), console=self.console,
                            disable=not self.console.is_terminal)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def update(self, step: int, record: dict | None = None) -> None:
        """Advances the bar; a metrics record also updates its text and prints a line."""
        if not record:
            self.bar.update(self.task, completed=step)
            return
        info = " ".join(f"{k} {record[k]:.4f}" for k in ("loss", "val_loss") if k in record)
        if "tokens_per_s" in record:
            info += (f" | {record['tokens_per_s']:,.0f} tok/s"
                     f" | {record['step_time_s'] * 1000:.0f} ms/step"
                     f" | {record['tflops_per_device']:.3g} TFLOP/s/device | MFU "
                     + ("n/a" if record["mfu"] is None else f"{record['mfu']:.1%}"))
        self.bar.update(self.task, completed=step, info=info)
        self.console.print(f"step {step:5d}  {info}", highlight=False, soft_wrap=True)


class _StepClock:
    """Step time, tokens/s, TFLOP/s per device and MFU between logged steps (reading the loss
    waits for the step). ``peak_flops`` None: MFU is n/a (a CPU, or an unknown device)."""

    def __init__(self, tokens_per_step: int, start: int, flops_per_token: float,
                 peak_flops: float | None, devices: int):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token, self.peak_flops, self.devices = flops_per_token, peak_flops, devices
        self.last_time, self.last_step = time.perf_counter(), start

    def measure(self, step: int, metrics: dict) -> dict[str, float | None]:
        loss = float(metrics["loss"])
        now = time.perf_counter()
        dt = (now - self.last_time) / max(step - self.last_step, 1)
        self.last_time, self.last_step = now, step
        tokens_per_s = self.tokens_per_step / dt
        model_flops = self.flops_per_token * tokens_per_s
        return {"loss": loss, "grad_norm": float(metrics["grad_norm"]), "step_time_s": dt,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": model_flops / self.devices / 1e12,
                "mfu": mfu(model_flops, self.peak_flops, self.devices)}


def _memory_in_use() -> dict[str, float]:
    """GiB in use and its peak on the fullest local device, where the backend reports it
    (``Device.memory_stats()``; a CPU reports nothing)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    used = [s["bytes_in_use"] for s in stats if "bytes_in_use" in s]
    peak = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    out = {}
    if used:
        out["memory_gib"] = max(used) / 2**30
    if peak:
        out["memory_peak_gib"] = max(peak) / 2**30
    return out


def _peak_flops(config: TrainConfig) -> float | None:
    """Peak FLOP/s of one device: ``--peak-tflops``, else the table's entry for the device."""
    if config.peak_tflops:
        return config.peak_tflops * 1e12
    spec = device_spec(jax.devices()[0].device_kind)
    return spec.peak_flops if spec and jax.devices()[0].platform != "cpu" else None


def _plot(out: Path, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)


def _read_metrics(path: Path, up_to: int) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= up_to]


def train(config: TrainConfig, run: _Run | None = None) -> list[dict]:
    """Runs (or resumes) training; returns the metric records written to ``metrics.jsonl``."""
    run = run or prepare(config)
    mesh, rules = run.mesh, run.rules
    is_main = jax.process_index() == 0
    run.out.mkdir(parents=True, exist_ok=True)

    graphdef, state_shape = _abstract(run)
    init = mesh.sjit(lambda: _create(run)[1], out_shardings=rules)
    shardings = mesh.match_sharding_rule(rules, state_shape)
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    step_fn = step_function(run, graphdef)
    eval_fn = mesh.sjit(partial(eval_loss, graphdef=graphdef, policy=run.policy),
                        in_shardings=(rules, batch_spec))

    ckpt = Checkpointer(run.out / CHECKPOINT_DIR, max_to_keep=3)
    metrics_path = run.out / "metrics.jsonl"
    if config.resume:
        start, state, extra = _restore(ckpt, state_shape, shardings, state_shape)
        run.train_data.restore(extra["data"])
        records = _read_metrics(metrics_path, start)
    else:
        state, start, records = init(), 0, []
        if is_main:
            (run.out / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")

    def to_global(batch):
        return _global_batch(mesh, batch, batch_spec, config.batch_size)

    first = to_global(run.train_data.batch(start))
    plan = step_fn.plan(state, first)
    if is_main:  # what the compiled step holds and moves per device (`shardax plan` predicts it)
        (run.out / "plan.json").write_text(plan.to_json() + "\n")
    n_params = sum(x.size for x in jax.tree.leaves(state_shape["params"]))
    if is_main:
        print(f"shardax train: {config.model} ({n_params / 1e6:.2f}M params) on "
              f"{jax.device_count()} devices, mesh {mesh.shape}, rules {config.rules!r}, "
              f"precision {run.policy}")
        if mesh.shape.get("pp", 1) > 1:
            print(_pipeline_summary(run.model_config, mesh.shape["pp"]))
        print(plan.where(lambda row: row.kind == "input" and "/params/" in f"/{row.path}/"))

    per_token = flops_per_token(run.model_config, config.seq_len)
    peak = _peak_flops(config)
    if is_main:
        log.info("model FLOPs per token %.3g (6N + 12·L·d·T); peak %s per device: MFU %s",
                 per_token, f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown",
                 "reported" if peak else "n/a (pass --peak-tflops to report it)")
    try:
        trackers = make_trackers(config.log_to, run.out, config.to_json(), records) \
            if is_main else []
    except MissingExtra as e:
        raise UsageError(str(e)) from None
    schedule = make_schedule(config.optimizer, config.lr, config.steps,
                             warmup=config.steps // 20)
    clock = _StepClock(config.batch_size * config.seq_len, start, per_token, peak,
                       jax.device_count())
    profiler = StepProfiler(parse_profile_steps(config.profile_steps), run.out / PROFILE_DIR)
    try:
        with _Progress(config.steps, start) as progress:
            for step in range(start, config.steps):
                batch = first if step == start else to_global(run.train_data.batch(step))
                done = step + 1
                profiler.before(done)
                state, metrics = step_fn(state, batch)
                profiler.after(done, (state, metrics))
                record: dict[str, Any] = {}
                if done % config.log_every == 0 or done in (config.steps, start + 1):
                    record = {"step": done, **clock.measure(done, metrics),
                              "lr": float(schedule(step)), **_memory_in_use()}
                if done % config.eval_every == 0 or done == config.steps:
                    val = [float(eval_fn(state, to_global(b))) for b in run.val_data]
                    record = {"step": done, **record, "val_loss": float(np.mean(val))}
                if record:
                    records.append(record)
                    for tracker in trackers:
                        tracker.log(done, {k: v for k, v in record.items() if k != "step"})
                progress.update(done, record if is_main else None)
                if done % config.ckpt_every == 0 or done == config.steps:
                    position = {**run.train_data.state(), "step": done}
                    ckpt.save(done, _flat(state), extra={"data": position,
                                                         "config": config.to_json()}, force=True)
    finally:  # an interrupted run still finishes (or abandons) its in-flight save
        profiler.stop()
        ckpt.wait()
        ckpt.close()
        for tracker in trackers:
            tracker.close()
    if is_main:
        _plot(run.out, records)
        print(f"wrote {metrics_path}, {run.out / 'loss.png'} and checkpoints in "
              f"{run.out / CHECKPOINT_DIR}")
    return records


def _global_batch(mesh: MeshShardingHelper, batch: tuple, spec: Any, rows: int) -> tuple:
    """Each process's rows -> one global array of ``rows`` rows per batch field, sharded like
    ``spec``."""
    sharding = jax.sharding.NamedSharding(mesh.mesh, spec)
    return tuple(
        jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:])) for x in batch
    )


def generate(out: str, prompt: str, max_tokens: int = 200, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Samples ``max_tokens`` bytes after ``prompt`` from the latest checkpoint in ``out``."""
    out_path = Path(out)
    ckpt_dir = out_path / CHECKPOINT_DIR
    if not (out_path / "config.json").exists() or not ckpt_dir.exists():
        raise UsageError(f"{out} holds no shardax run (no config.json / checkpoints)")
    ckpt = Checkpointer(ckpt_dir)
    if ckpt.latest_step() is None:
        raise UsageError(f"no checkpoint in {ckpt_dir}")
    config = TrainConfig(**json.loads((out_path / "config.json").read_text()))
    stacked = _pipelined(config.mesh)  # a pipelined run saved its layers stacked
    config.mesh = f"dp={jax.device_count()}"  # sampling is small: replicate the model
    config.resume = True
    config.tp_mode, config.sequence_parallel, config.pp_schedule = "none", False, "gpipe"
    config.microbatches, config.virtual_stages = 0, 1
    run = prepare(config)
    if stacked:
        run.model_config = dataclasses.replace(run.model_config, scan_layers=True)
    graphdef, state_shape = _abstract(run)
    replicated = jax.tree.map(lambda _: jax.sharding.NamedSharding(run.mesh.mesh,
                                                                   jax.sharding.PartitionSpec()),
                              state_shape)
    _, state, _ = _restore(ckpt, state_shape, replicated, state_shape)
    ckpt.close()
    model = nnx.merge(graphdef, state["params"], state["rest"])
    length = run.model_config.max_seq_len

    @jax.jit
    def next_token(model, tokens, position, key):
        logits = model(tokens)[0, position].astype(np.float32)
        return jax.random.categorical(key, logits / max(temperature, 1e-4))

    data = list(prompt.encode("utf-8"))
    key = jax.random.key(seed)
    for _ in range(max_tokens):
        window = data[-length:]
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : len(window)] = window
        key, sub = jax.random.split(key)
        data.append(int(next_token(model, tokens, len(window) - 1, sub)))
    return bytes(data).decode("utf-8", errors="replace")
