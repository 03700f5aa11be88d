"""Resolves a checked `TrainConfig` into the run it describes on this machine, once.

`resolve` computes, in one place and in one pass, everything the commands derive from a
config: the mesh, the precision policy, the model config (the architecture, with precision and
remat), the `Layout` (how the model runs: tensor, sequence and pipeline parallelism, FSDP
mode), the rule list fitted to the mesh, the optimizer and its learning-rate schedule, and the
batch split and pipeline bubble. ``shardax train``, ``shardax plan`` and
``shardax generate``/``export`` take the `Resolved` run it returns and never re-read the
config's strings. The config must already have passed `shardax.train.config.check` (the CLI
checks it before JAX starts); what only the devices can tell (mesh sizes, divisibility) is a
`UsageError` here.

>>> from shardax.train.config import check
>>> run = resolve(check(TrainConfig(mesh="fsdp=4,tp=2", batch_size=8)))
>>> run.mesh.shape, run.batch_split, run.fsdp_mode
({'fsdp': 4, 'tp': 2}, 4, 'xla')
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx

from shardax import hf, layout, models
from shardax.errors import UsageError
from shardax.layout import Layout
from shardax.mesh import MeshShardingHelper, parse_mesh_string
from shardax.models.attention import resolve_implementation
from shardax.models.lora import LoRA, LoRAError
from shardax.precision import Policy
from shardax.rules import HostOffloadRule, LogicalAxisRules
from shardax.train.config import LAYOUT_FLAGS, TrainConfig, flag, hf_dir, with_defaults
from shardax.train.optimizers import make_optimizer, make_schedule
from shardax.train.step import TrainState, init_state

__all__ = ["SCHEDULE_FIELDS", "Resolved", "fsdp_mode", "layout_of", "make_mesh", "model_config",
           "optimizer", "resolve", "scans_layers", "schedule_change", "state_shape"]


def make_mesh(spec: str, flag_name: str = "--mesh") -> MeshShardingHelper:
    """The mesh of a mesh string over this machine's devices (UsageError if the sizes do not
    fit them)."""
    try:
        return MeshShardingHelper.from_string(spec)
    except ValueError as e:
        raise UsageError(f"{flag_name} {spec!r}: {e}") from None


def optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax optimizer of a checked config's ``--optimizer``, ``--lr``, ``--steps``,
    ``--warmup-steps``, ``--min-lr-ratio``, ``--weight-decay`` and ``--clip-grad-norm``, and
    the learning rate it applies at each step."""
    c = config
    return (make_optimizer(c.optimizer, c.lr, c.steps, warmup=c.warmup_steps,
                           min_lr_ratio=c.min_lr_ratio, weight_decay=c.weight_decay,
                           clip_grad_norm=c.clip_grad_norm),
            make_schedule(c.optimizer, c.lr, c.steps, warmup=c.warmup_steps,
                          min_lr_ratio=c.min_lr_ratio))


SCHEDULE_FIELDS = ("lr", "steps", "warmup_steps", "min_lr_ratio")


def schedule_change(saved: TrainConfig, config: TrainConfig, step: int) -> str | None:
    """What a resumed run's new schedule flags (`SCHEDULE_FIELDS`) do to its learning rate at
    ``step``, for the resume message (None: the lr there is unchanged).

    >>> from shardax.train.config import check
    >>> print(schedule_change(check(TrainConfig(steps=100, lr=1e-3)),
    ...                       check(TrainConfig(steps=200, lr=1e-3)),
    ...                       100))  # doctest: +NORMALIZE_WHITESPACE
    --steps 200 (was 100), --warmup-steps 10 (was 5) changes the learning-rate schedule: the lr
    at step 100 is 0.000587 (was 0.0001)
    """
    changed = [k for k in SCHEDULE_FIELDS if getattr(saved, k) != getattr(config, k)]
    if not changed:
        return None
    old, new = (float(optimizer(c)[1](step)) for c in (saved, config))
    if old == new:
        return None
    flags = ", ".join(f"{flag(k)} {getattr(config, k)} (was {getattr(saved, k)})"
                      for k in changed)
    return (f"{flags} changes the learning-rate schedule: the lr at step {step} is {new:.3g} "
            f"(was {old:.3g})")


def model_config(config: TrainConfig, policy: Policy, init_dir: Path | None = None,
                 weights: bool = True) -> Any:
    """The model config of ``--model`` (or of the ``--init-from`` model in ``init_dir``) with
    the precision ``policy`` and ``--seq-len`` applied (no parallelism, ``--remat``,
    ``--attention`` or ``--scan-layers``: those are the `Layout`'s). ``weights=False``: the
    ``--init-from`` model from its ``config.json`` alone (planning)."""
    if init_dir is not None:
        try:
            c = hf.load_config(init_dir, weights=weights, dtype=policy.compute,
                               param_dtype=policy.params)
        except ValueError as e:
            raise UsageError(f"--init-from {config.init_from}: {e}") from None
        if config.seq_len > c.max_seq_len:
            raise UsageError(f"--seq-len {config.seq_len} exceeds the model's "
                             f"max_position_embeddings {c.max_seq_len} ({config.init_from})")
        return _with_lora(c, config)
    preset = models.CONFIGS[config.model]
    return _with_lora(models.get_config(
        config.model, dtype=policy.compute, param_dtype=policy.params,
        max_seq_len=max(config.seq_len, preset.max_seq_len)), config)


def _with_lora(model_config: Any, config: TrainConfig) -> Any:
    """The model config with ``--lora-rank/--lora-alpha/--lora-targets`` (none at rank 0)."""
    if not config.lora_rank:
        return model_config
    return dataclasses.replace(model_config, lora=LoRA(config.lora_rank, config.lora_alpha,
                                                       config.lora_targets))


def scans_layers(config: TrainConfig, model_config: Any = None) -> bool:
    """Whether a run scans its stacked layers (else it loops over them): with
    ``--scan-layers`` (the default) where ``model_config``'s layers are identical (a model
    whose layers differ keeps them in a list). How a checkpoint stores them does not depend
    on it (`shardax.models.create`), and a 'pp' pipeline runs the stack its own way.

    >>> from shardax.models import get_config
    >>> scans_layers(TrainConfig()), scans_layers(TrainConfig(scan_layers=False))
    (True, False)
    >>> scans_layers(TrainConfig(), get_config("deepseek-v3"))  # dense, then MoE
    False
    """
    return config.scan_layers and not getattr(model_config, "mixed_layers", False)


def layout_of(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any = None
              ) -> Layout:
    """The `Layout` of ``config``'s flags (`LAYOUT_FLAGS`) on a mesh of ``mesh_shape``, with what
    the flags leave open decided: ``--microbatches 0`` is the 'pp' size, ``--sequence-parallel``
    alone runs sync TP, the layers are scanned as `scans_layers` says (of ``model_config``, when
    given); the FSDP mode stays 'xla' (`fsdp_mode` decides it). ValueError where a pipeline flag
    needs a 'pp' axis the mesh lacks.

    >>> lay = layout_of(TrainConfig(sequence_parallel=True, mesh="pp=2,tp=4"), {"pp": 2, "tp": 4})
    >>> lay.tp_mode, lay.pp_microbatches
    ('sync', 2)
    """
    pp = mesh_shape.get("pp", 1)
    if pp == 1 and (config.microbatches > 1 or config.virtual_stages > 1):
        raise ValueError("--microbatches and --virtual-stages need a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape}); use --grad-accum to split the batch without one")
    if pp == 1 and config.pp_schedule != "gpipe":
        raise ValueError(f"--pp-schedule {config.pp_schedule} needs a 'pp' mesh axis of size > 1 "
                         f"(mesh {mesh_shape})")
    values = {field: getattr(config, flag) for flag, field in LAYOUT_FLAGS.items()}
    if config.sequence_parallel and config.tp_mode == "none":
        values["tp_mode"] = "sync"  # sequence parallelism runs through the explicit TP blocks
    values["scan_layers"] = scans_layers(config, model_config)
    return Layout(**{**values, "pp_microbatches": config.microbatches or pp})


def _layout(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any):
    """``(layout, rules)``: the `Layout` of the flags (`layout_of`) and the rule list fitted
    to the mesh and model (``layout.presets.resolve``); ValueError on a mismatch."""
    lay = layout_of(config, mesh_shape, model_config)
    layout.check_mesh(model_config, lay, mesh_shape, batch_size=config.batch_size,
                      seq_len=config.seq_len)
    rules = layout.presets.resolve(
        layout.PRESETS[config.rules], mesh_shape, heads=model_config.n_heads,
        kv_heads=getattr(model_config, "n_kv_heads", model_config.n_heads),
        sequence_parallel=lay.sp)
    return lay, rules


def fsdp_mode(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any,
              policy: Policy, memory_bytes: int | None, lay: Layout | None = None
              ) -> tuple[str, bool, str]:
    """``(mode, recompute, why)``: the FSDP mode a run uses (``'explicit'`` or ``'xla'``),
    whether explicit FSDP re-gathers each layer and recomputes its forward in the backward pass
    (`fsdp_recompute`), and why, for the banner. UsageError (one line naming the combination)
    when explicit is asked for where it cannot run.

    ``--fsdp-mode auto`` takes the faster mode at the memory that fits: where explicit would keep
    its gathered layers from forward to backward (no ``--remat``, they fit, no ``--grad-accum``) it
    holds what the partitioner's FSDP holds (llama-small on fsdp=8: 243.9 MiB of temporaries each),
    and the partitioner's step was faster (explicit / xla about 1.06 on 8 CPU devices, measured
    while explicit moved each parameter in its own collectives): xla. Where explicit re-gathers
    (``--remat``, or the gathered layers would not fit) or reduce-scatters microbatch gradients into
    a sharded accumulator: explicit. Over a loop of layers it holds less there (113.9 against 203.0
    MiB with ``--remat full``; 242.4 against 302.2 with ``--grad-accum 2``). Over scanned layers
    (the default) the partitioner gathers one layer at a time too (156.4 MiB each with ``--remat
    full``) and both run at the same speed at llama-small on CPU (explicit / xla tokens/s 0.99,
    ``benchmarks/cli_step.py``), but at scale explicit holds and moves less: its program
    reduce-scatters each layer's gradient where the partitioner's all-reduces it (llama-8b, fsdp=8,
    sequence 8192: 87.0 against 88.6 GiB, a step planned at 2.61 against 2.80 s on H100). On a 'pp'
    axis explicit gathers each stage's layers once per step and keeps them through the pipeline: it
    holds less than the partitioner's FSDP there (llama-small, fsdp=4,pp=2: 262.2 against 306.3 MiB,
    with or without ``--remat``) and moves a third of its bytes (its step took 1.3x the
    partitioner's on 8 emulated CPU devices, whose permute rings are slow), so auto picks it where
    the stage fits, except with ``--grad-accum`` (explicit gathers per microbatch: 261.3 against
    220.8 MiB).

    >>> fsdp_mode(TrainConfig(mesh="fsdp=8", remat="full"), {"fsdp": 8},
    ...           models.CONFIGS["llama-tiny"], Policy(), None)[:2]
    ('explicit', True)
    """
    lay = lay or Layout()
    blockers = _explicit_blockers(config, mesh_shape, model_config, lay)
    if config.fsdp_mode == "explicit" and blockers:
        raise UsageError(f"--fsdp-mode explicit does not run with {blockers[0]}; "
                         "use --fsdp-mode xla")
    if config.fsdp_mode == "xla":
        return "xla", True, "--fsdp-mode xla"
    if config.fsdp_mode == "auto" and blockers:
        return "xla", True, f"auto: explicit does not run with {blockers[0]}"
    prefers_xla = _auto_prefers_xla(mesh_shape)
    if config.fsdp_mode == "auto" and prefers_xla:
        return "xla", True, f"auto: xla is faster with {prefers_xla}"
    recompute, keep_why = fsdp_recompute(config, mesh_shape, model_config, policy, memory_bytes)
    if config.fsdp_mode == "explicit":
        return "explicit", recompute, f"--fsdp-mode explicit; {keep_why}"
    if mesh_shape.get("pp", 1) > 1:
        if config.grad_accum > 1:
            return "xla", True, ("auto: with --grad-accum on a 'pp' axis explicit gathers each "
                                 "stage's layers per microbatch and holds more than the "
                                 "partitioner's FSDP")
        if recompute:  # the stage's layers would not fit
            return "xla", True, f"auto: {keep_why}"
        return "explicit", False, ("auto: explicit holds less than the partitioner's FSDP on a "
                                   f"'pp' axis and moves a third of its bytes; {keep_why}")
    if not recompute and config.grad_accum == 1:
        return "xla", True, (f"auto: xla holds what explicit would here ({keep_why}; the "
                             "partitioner keeps them too) and its step is faster")
    if lay.scan_layers:
        return "explicit", recompute, (
            "auto: over scanned layers both modes gather one layer at a time; at scale "
            "explicit holds and moves less (it reduce-scatters each layer's gradient where "
            "the partitioner's program all-reduces it; llama-8b on fsdp=8 at sequence 8192: "
            f"87.0 against 88.6 GiB, 2.61 against 2.80 s a step planned on H100); {keep_why}")
    saves = ("re-gathers each layer" if recompute else
             "reduce-scatters each microbatch's gradient into a sharded accumulator")
    return "explicit", recompute, (f"auto: explicit {saves}, less memory than the "
                                   f"partitioner's FSDP; {keep_why}")


def _auto_prefers_xla(mesh_shape: dict[str, int]) -> str | None:
    """Why ``--fsdp-mode auto`` picks xla on this mesh whatever the memory (None: the memory
    decides, `fsdp_mode`).
    With a 'tp' axis explicit FSDP moves the TP-split parameters over 'fsdp' in rings of
    collective-permutes (XLA would gather them over 'tp' too); measured on 8 emulated CPU
    devices at fsdp=4,tp=2 at 0.48-0.58x the tokens/s of the partitioner's FSDP."""
    if mesh_shape.get("tp", 1) > 1:
        return ("a 'tp' axis (explicit FSDP moves TP-split parameters in permute rings, "
                "slower than the partitioner's FSDP; --fsdp-mode explicit forces it)")
    return None


def _explicit_blockers(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any,
                       lay: Layout) -> list[str]:
    """Why explicit FSDP cannot run here, one phrase each (none: it can)."""
    blockers = []
    model = f"--init-from {config.init_from}" if config.init_from else f"--model {config.model}"
    if config.objective != "sft":
        blockers.append(f"--objective {config.objective} (explicit FSDP computes the "
                        "cross-entropy only)")
    if mesh_shape.get("fsdp", 1) == 1:
        blockers.append(f"a mesh without an 'fsdp' axis of size > 1 ({config.mesh})")
    if getattr(model_config, "n_experts", 0) and model_config.moe_impl == "dropless":
        blockers.append(f"{model} (dropless experts run their own shard_map; "
                        "the capacity MoE runs inside explicit FSDP)")
    elif getattr(model_config, "mixed_layers", False):
        blockers.append(f"{model} (its sliding-window and global layers differ; "
                        "explicit FSDP runs one layer body)")
    else:
        if lay.tp_mode != "none":
            blockers.append(f"--tp-mode {lay.tp_mode}"
                            + (" / --sequence-parallel" if lay.sp else "")
                            + " (explicit TP blocks cannot nest in the FSDP shard_map under "
                            "differentiation in JAX 0.10: https://github.com/jax-ml/jax/pull/26588;"
                            " --tp-mode none shards 'tp' by --rules)")
        if model_config.lora is not None:
            blockers.append("--lora-rank (the frozen base weights stay sharded by the "
                            "partitioner)")
        if mesh_shape.get("pp", 1) > 1 and lay.pp_schedule == "1f1b":
            blockers.append("--pp-schedule 1f1b (it differentiates inside its own shard_map "
                            "over 'pp', which cannot nest in the FSDP region under "
                            "differentiation in JAX 0.10: https://github.com/jax-ml/jax/pull/26588;"
                            " gpipe and circular run)")
        if mesh_shape.get("cp", 1) > 1 and mesh_shape.get("ep", 1) > 1:
            blockers.append("'cp' and 'ep' axes together (the experts' routing statistics "
                            "are summed over the token axes, not 'cp')")
    return blockers


# Explicit FSDP keeps the gathered layers from forward to backward (no recompute) when no remat
# is asked for and they take at most this share of a device's memory.
KEEP_GATHERED_SHARE = 0.25


def fsdp_recompute(config: TrainConfig, mesh_shape: dict[str, int], model_config: Any,
                   policy: Policy, memory_bytes: int | None) -> tuple[bool, str]:
    """``(recompute, why)``: whether explicit FSDP re-gathers each layer and recomputes its
    forward in the backward pass (FSDP2's ``reshard_after_forward``), and why. Without
    ``--remat`` it keeps the gathered layers when they fit in `KEEP_GATHERED_SHARE` of
    ``memory_bytes`` (None: unbounded, e.g. CPU).

    >>> fsdp_recompute(TrainConfig(remat="full"), {}, None, Policy(), None)
    (True, '--remat full')
    """
    pp = mesh_shape.get("pp", 1)
    if config.remat != "none" and pp == 1:
        return True, f"{flag('remat')} {config.remat}"
    tp = mesh_shape.get("tp", 1)  # tensor-parallel shards stay shards once gathered
    gathered = models.param_count(model_config) * policy.compute.itemsize / (tp * pp)
    size = (f"the stage's gathered layers ({gathered / 2**30:.2f} GiB per device; the pipeline "
            "recomputes each layer from its input)" if pp > 1 else
            f"the gathered layers ({gathered / 2**30:.2f} GiB per device)")
    if pp > 1:  # the stage's layers are gathered once per step, whatever --remat says
        if memory_bytes is None or gathered <= KEEP_GATHERED_SHARE * memory_bytes:
            return False, f"{size} kept for the step"
        return True, (f"{size} exceed {KEEP_GATHERED_SHARE:.0%} of device memory "
                      f"({memory_bytes / 2**30:.1f} GiB)")
    if memory_bytes is None:
        return False, f"no --remat; {size} kept: device memory has no stated limit"
    budget = KEEP_GATHERED_SHARE * memory_bytes
    if gathered <= budget:
        return False, (f"no --remat; {size} fit in {KEEP_GATHERED_SHARE:.0%} of device "
                       f"memory ({memory_bytes / 2**30:.1f} GiB)")
    return True, (f"{size} exceed {KEEP_GATHERED_SHARE:.0%} of device memory "
                  f"({memory_bytes / 2**30:.1f} GiB)")


def _device_memory() -> int | None:
    """Bytes one local device may allocate (None where the backend does not say: CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def state_shape(model_config: Any, tx: optax.GradientTransformation, seed: int,
                mesh: MeshShardingHelper) -> tuple[Any, TrainState]:
    """``(graphdef, train-state shapes)`` of a fresh model and optimizer, computed abstractly
    (nothing allocated); LoRA settings that do not fit the model are a UsageError.

    Example::

        graphdef, shapes = state_shape(run.model_config, run.tx, 0, run.mesh)
    """
    graphdefs = []

    def state_only():
        graphdef, state = init_state(lambda: models.create(model_config, nnx.Rngs(seed)), tx)
        graphdefs.append(graphdef)  # static structure, no tracers: safe to keep
        return state

    try:
        with mesh.get_context():
            shapes = jax.eval_shape(state_only)
    except LoRAError as e:
        raise UsageError(f"--lora-{e.setting} {getattr(model_config.lora, e.setting)}: {e}") \
            from None
    return graphdefs[0], shapes


def _fit_fsdp(config: TrainConfig, mesh: MeshShardingHelper, base: Any, tx: Any
              ) -> tuple[MeshShardingHelper, str]:
    """``--mesh`` with ``fsdp=-1``: the mesh whose 'fsdp' size is the largest of those (the
    divisors of the devices it was given) that divide every dim it shards, the rest of those
    devices on 'dp' (6 devices and a 64-wide model: fsdp=2, dp=3), and why, for the banner
    ("" when the inferred size fits)."""
    asked = parse_mesh_string(config.mesh)
    n = mesh.shape.get("fsdp", 1)
    if asked.get("fsdp") != -1 or n == 1:
        return mesh, ""
    shapes = None
    first = ""
    for f in [d for d in range(n, 0, -1) if n % d == 0]:
        sizes = {"dp": 1, **asked, "fsdp": f}  # 'dp' first unless placed
        sizes["dp"] = asked.get("dp", 1) * (n // f)
        spec = ",".join(f"{k}={v}" for k, v in sizes.items() if v != 1 or k == "fsdp")
        candidate = make_mesh(spec)
        try:
            lay, rule_list = _layout(config, candidate.shape, base)
        except ValueError:
            continue
        if shapes is None:
            shapes = state_shape(_one_of_each_layer(base), tx, config.seed, candidate)[1]
        rules = LogicalAxisRules(rule_list)
        try:
            candidate.match_sharding_rule(TrainState(rules, rules, rules, rules), shapes)
        except ValueError as e:
            leaf = re.search(r"leaf '([^']*)' of shape (\([^)]*\))", str(e))
            first = first or (f"leaf {leaf.group(1)} {leaf.group(2)}" if leaf else str(e))
            continue
        if f == n:
            return mesh, ""
        return candidate, (f"--mesh {config.mesh}: fsdp={n} cannot split {first}; fsdp={f} is "
                           f"the largest size that divides every dim it shards, dp={sizes['dp']} "
                           "takes the rest")
    return mesh, ""  # nothing fits: the sharding check says why, naming the leaf


def _one_of_each_layer(c: Any) -> Any:
    """``c`` with one layer of each kind its listed layers have (DeepSeek-V3: 4 of 61): the
    same leaf shapes to check, without tracing every layer."""
    if not getattr(c, "mixed_layers", False):
        return c
    return dataclasses.replace(c, n_layers=min(c.n_layers,
                                               c.first_k_dense + max(c.global_every, 1)))


@dataclass(frozen=True)
class Resolved:
    """A config resolved on this machine: what the commands build, plan and train from."""

    config: TrainConfig
    mesh: MeshShardingHelper
    rules: LogicalAxisRules
    #: the architecture (with precision and remat)
    model_config: Any
    #: how the model runs on the mesh (the FSDP mode and recompute included)
    layout: Layout
    policy: Policy
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    #: the mesh axes the 'batch' rule splits the rows over, and over how many devices
    batch_axes: tuple[str, ...]
    batch_split: int
    #: the Hugging Face model directory of ``--init-from hf:DIR`` (None without it)
    init_dir: Path | None = None
    #: why the FSDP mode and the recompute were chosen (one phrase each, for the banner)
    fsdp_why: str = ""
    #: how ``--mesh ...fsdp=-1`` was fitted to the model, for the banner ("": as inferred)
    mesh_why: str = ""
    #: how ``--per-device-batch-size`` gave the global batch, for the banner ("": not used)
    batch_why: str = ""

    @property
    def fsdp_mode(self) -> str:
        """'explicit' or 'xla' (``layout.fsdp_mode``)."""
        return self.layout.fsdp_mode

    @property
    def fsdp_recompute(self) -> bool:
        """Explicit FSDP: each layer re-gathered and its forward recomputed in the backward
        pass (``layout.fsdp_recompute``)."""
        return self.layout.fsdp_recompute

    @property
    def state_rules(self) -> TrainState:
        """The train state's rules: ``rules`` everywhere, the optimizer state in pinned host
        memory under ``--offload-optimizer``."""
        opt = HostOffloadRule(self.rules) if self.config.offload_optimizer else self.rules
        return TrainState(self.rules, self.rules, opt, self.rules)

    def fsdp_summary(self) -> str:
        """One line for the train plan: which FSDP mode is active."""
        if self.fsdp_mode == "explicit" and self.mesh.shape.get("pp", 1) > 1:
            return ("fsdp: explicit (each stage's layers gathered once per step in the compute "
                    "dtype and kept through the pipeline, their gradients reduce-scattered in "
                    f"float32); why: {self.fsdp_why}")
        if self.fsdp_mode == "explicit":
            kept = ("forward recomputed in the backward pass (each layer re-gathered)"
                    if self.fsdp_recompute else
                    "gathered layers kept from forward to backward, no recomputed forward")
            return ("fsdp: explicit (ZeRO-3: each layer gathered in the compute dtype right "
                    "before use, its gradient reduce-scattered in float32"
                    + (", per microbatch into a sharded float32 accumulator"
                       if self.config.grad_accum > 1 else "")
                    + f"); {kept}; why: {self.fsdp_why}")
        return (f"fsdp: xla (the partitioner, from the shardings); why: {self.fsdp_why}")

    def shardings(self, shapes: TrainState) -> TrainState:
        """The train state's shardings on the mesh; a UsageError naming the leaf, its shape
        and the axis sizes where the mesh cannot shard it."""
        try:
            return self.mesh.match_sharding_rule(self.state_rules, shapes)
        except ValueError as e:  # it names the leaf, its shape, the spec and the axis sizes
            raise UsageError(f"--mesh {self.config.mesh!r} cannot shard the train state: "
                             f"{str(e).removeprefix('sharding: ')}") from None

    def attention_summary(self, chat: bool = False) -> str:
        """One line for the train banner: the attention implementation that runs (``auto``
        resolved for this backend, dtype and sequence length) and how documents are packed
        (``chat``: conversations packed whole, whatever ``--pack`` says)."""
        c, config, asked = self.model_config, self.config, self.layout.attention
        q = jax.ShapeDtypeStruct((1, config.seq_len, c.n_heads, c.dim // c.n_heads), c.dtype)
        pairs = config.objective != "sft"  # a preference row holds one sequence, unpacked
        packed = not pairs and (chat or config.pack == "documents")
        impl = resolve_implementation(asked, q, q, custom_mask=packed)
        if self.mesh.shape.get("cp", 1) > 1:
            impl = f"ring attention over 'cp' (blockwise steps; --attention {asked})"
        elif impl != asked:
            impl += f" (--attention {asked})"
        pack = ("one sequence per row (prompt + chosen or rejected; the objective on the "
                "completion's tokens)" if pairs else
                f"conversations (whole, into rows; attention and RoPE positions restart at "
                f"each one; loss on the {config.loss_on} tokens)" if chat else
                "documents (attention and RoPE positions restart at each end-of-text, no loss "
                "across it)" if packed else "concat (one stream)")
        return f"attention: {impl}; pack: {pack}"

    def optimizer_summary(self) -> str:
        """One line for the train banner: the optimizer, its learning-rate schedule, weight
        decay and clipping, with the defaults resolved."""
        c = self.config
        if c.optimizer == "sgd":
            return (f"optimizer: sgd, constant lr {c.lr:g}, weight decay {c.weight_decay:g}, "
                    f"clip grad norm {c.clip_grad_norm or 'off'}")
        return (f"optimizer: {c.optimizer}, lr {c.lr:g} (warm-up {max(c.warmup_steps, 1)} steps "
                f"from {float(self.schedule(0)):.3g}, cosine to {c.lr * c.min_lr_ratio:.3g} at "
                f"step {c.steps}), weight decay {c.weight_decay:g}, clip grad norm "
                f"{c.clip_grad_norm or 'off'}")

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per step (1 without a 'pp' axis)."""
        return self.layout.microbatches(self.mesh.shape.get("pp", 1))

    @property
    def bubble(self) -> float:
        """The idle fraction of a step under the pipeline schedule (0 without a 'pp' axis)."""
        return self.layout.bubble(self.mesh.shape.get("pp", 1))

    def work_axes(self) -> set[str]:
        """The mesh axes that divide one step's FLOPs: those that split the batch, 'cp' (the
        sequence), 'pp' (the layers) and 'tp' where the rules split the MLP over it. Axes that
        split none of these (e.g. 'tp' under the 'fsdp' preset) replicate compute."""
        axes = set(self.batch_axes) | ({"cp", "pp"} & set(self.mesh.shape))
        mlp = self.rules.spec_for(("mlp",), self.mesh.mesh)[0]
        if mlp == "tp" or (isinstance(mlp, tuple) and "tp" in mlp):
            axes.add("tp")
        return axes

    def work_split(self) -> int:
        """Over how many devices one step's FLOPs are divided (the sizes of `work_axes`)."""
        return math.prod(self.mesh.shape[a] for a in self.work_axes())

    def idle_axes(self) -> list[str]:
        """One line per mesh axis of size > 1 that divides no work (`work_axes`): its devices
        repeat the same compute.

        >>> resolve(TrainConfig(mesh="fsdp=4,tp=2", rules="fsdp")).idle_axes()[0][:29]
        "mesh axis 'tp' (size 2) split"
        """
        used = self.work_axes()
        return [f"mesh axis {axis!r} (size {size}) splits neither the batch, the sequence, "
                f"the layers nor the MLP under --rules {self.config.rules!r}: its devices "
                "repeat the same compute" for axis, size in self.mesh.shape.items()
                if size > 1 and axis not in used]

    def pipeline_summary(self) -> str:
        """One line: the pipeline schedule and its bubble (the idle fraction of a step)."""
        c = self.layout
        virtual = (f", {c.pp_virtual_stages} virtual stages" if c.pp_schedule == "circular"
                   else "")
        return (f"pipeline: {c.pp_schedule} over {self.mesh.shape['pp']} stages, "
                f"{c.pp_microbatches} microbatches{virtual}, bubble {self.bubble:.1%} of each "
                "step")


def _batch_axes(rules: LogicalAxisRules, mesh: MeshShardingHelper) -> tuple[str, ...]:
    """The mesh axes the 'batch' rule splits the rows over."""
    spec = rules.spec_for(("batch",), mesh.mesh)[0]
    return (spec,) if isinstance(spec, str) else tuple(spec or ())


def global_batch(config: TrainConfig, mesh: MeshShardingHelper, model_config: Any
                 ) -> tuple[TrainConfig, str]:
    """``config`` with ``--per-device-batch-size N`` turned into the global ``--batch-size``:
    N times the data-parallel size, the product of the mesh axes the 'batch' rule splits the
    rows over (MaxText's ``per_device_batch_size``); and that sum in words, for the banner.
    The config keeps the global batch only, so a resume on another mesh keeps the data.

    >>> from shardax.train.config import check
    >>> config = check(TrainConfig(per_device_batch_size=2, mesh="dp=2,fsdp=2,tp=2"))
    >>> global_batch(config, make_mesh(config.mesh), models.get_config("llama-tiny"))[1]
    '--per-device-batch-size 2 x data-parallel 4 (dp=2 x fsdp=2) = global batch 8'
    """
    n = config.per_device_batch_size
    # The batch rule does not depend on the batch size: any size the mesh divides finds it.
    probe = dataclasses.replace(config, batch_size=n * math.prod(mesh.shape.values())
                                * config.grad_accum * max(config.microbatches, 1))
    try:
        _, rule_list = _layout(probe, mesh.shape, model_config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    axes = _batch_axes(LogicalAxisRules(rule_list), mesh)
    split = math.prod(mesh.shape[a] for a in axes)
    parts = " x ".join(f"{a}={mesh.shape[a]}" for a in axes) or "no batch axis"
    why = (f"--per-device-batch-size {n} x data-parallel {split} ({parts}) = global batch "
           f"{n * split}")
    return dataclasses.replace(config, batch_size=n * split, per_device_batch_size=None), why


def resolve(config: TrainConfig, device_memory: float | None = None, *,
            weights: bool = True) -> Resolved:
    """The run a checked config asks for on this machine's devices: mesh, rules, model config,
    precision, optimizer and schedule, FSDP mode, batch split and bubble, checked against each
    other (no data, no run directory: what ``shardax train`` and ``shardax plan`` share); what
    does not fit the devices is a UsageError. ``device_memory``: the bytes a device may hold,
    which `fsdp_mode` weighs (``shardax plan`` passes its target's); default: what this
    machine's devices say (nothing on CPU). ``weights=False`` (planning): an ``--init-from``
    model needs only its ``config.json``."""
    config = with_defaults(config)  # a no-op for a checked config; a library caller's too
    mesh = make_mesh(config.mesh)
    policy = Policy.from_string(config.precision)
    init_dir = None if config.init_from is None else hf_dir(config.init_from, "--init-from")
    base = model_config(config, policy, init_dir, weights=weights)
    tx, schedule = optimizer(config)
    mesh, mesh_why = _fit_fsdp(config, mesh, base, tx)
    batch_why = ""
    if config.per_device_batch_size is not None:
        config, batch_why = global_batch(config, mesh, base)
    try:
        lay, rule_list = _layout(config, mesh.shape, base)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if getattr(base, "router_bias_update", 0) and mesh.shape.get("pp", 1) > 1:
        raise UsageError(f"--model {config.model} moves its router bias by each step's expert "
                         "load, which a 'pp' pipeline does not return; use a mesh without 'pp'")
    memory = _device_memory() if device_memory is None else int(device_memory)
    mode, recompute, why = fsdp_mode(config, mesh.shape, base, policy, memory,
                                     lay)  # UsageError if it cannot run
    lay = dataclasses.replace(lay, fsdp_mode=mode, fsdp_recompute=recompute)
    rules = LogicalAxisRules(rule_list)
    batch_axes = _batch_axes(rules, mesh)
    batch_split = math.prod(mesh.shape[a] for a in batch_axes)
    micro = lay.microbatches(mesh.shape.get("pp", 1))
    if config.batch_size % (batch_split * config.grad_accum * micro):
        raise UsageError(
            f"--batch-size {config.batch_size} must be divisible by the data-parallel size "
            f"{batch_split} (mesh {mesh.shape}) times --grad-accum {config.grad_accum}"
            + (f" times --microbatches {micro}" if micro > 1 else ""))
    if config.batch_size % jax.process_count():
        raise UsageError(f"--batch-size {config.batch_size} must be divisible by the process "
                         f"count {jax.process_count()}")
    return Resolved(
        config=config, mesh=mesh, rules=rules, model_config=base, layout=lay, policy=policy,
        tx=tx, schedule=schedule, batch_axes=batch_axes, batch_split=batch_split,
        init_dir=init_dir, fsdp_why=why, mesh_why=mesh_why, batch_why=batch_why)
