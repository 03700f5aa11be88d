"""`Layout`: how a model runs on a mesh (tensor, sequence and pipeline parallelism, FSDP mode,
remat, attention implementation, scanned layers), apart from what the model is (its
architecture config).

A `Layout` is frozen and resolved once (``shardax.train.resolve``); `shardax.layout.forward`
reads it to run any model family on any mesh. The same parameters serve every layout, so
checkpoints move freely between them.

>>> Layout(tp_mode="async").sp
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardax.models.attention import IMPLEMENTATIONS
from shardax.models.remat import check_remat
from shardax.parallel.pipeline import bubble_fraction

__all__ = ["FSDP_MODES", "PP_SCHEDULES", "TP_MODES", "Layout", "check_mesh", "pipeline_layouts"]

TP_MODES = ("none", "sync", "async", "async_bidi")
PP_SCHEDULES = ("gpipe", "circular", "1f1b")
# 'xla': FSDP from the parameter shardings, left to the partitioner; 'explicit': ZeRO-3 written
# out (shardax.parallel.fsdp): per-layer gathers and reduce-scatters under a shard_map.
FSDP_MODES = ("xla", "explicit")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model runs: the parallel settings (no effect without the matching mesh axis),
    remat and the attention implementation.

    ``tp_mode`` 'none' leaves tensor parallelism to XLA and the rules; 'sync'/'async'/
    'async_bidi' run attention and the MLP as ``shardax.parallel``'s column/row-parallel
    blocks over 'tp'; ``sequence_parallel`` needs one of those (the async modes imply it).
    ``pp_*``: pipeline schedule, microbatches and virtual stages over 'pp' (needs stacked
    layers). ``fsdp_mode`` 'explicit' runs ZeRO-3 written out (`shardax.parallel.fsdp`);
    ``fsdp_recompute`` there re-gathers each layer and recomputes it in the backward pass.
    ``remat``: each layer's ``jax.checkpoint`` policy ('none', 'full', 'dots', 'save_dots',
    'offload', 'names:q,k,v', 'offload:q,k'; ``shardax.models.remat``). ``attention``: the
    attention implementation ('auto', 'cudnn', 'xla', 'blockwise', 'einsum';
    ``shardax.models.attention``). Both apply on one device too (``Layout(remat='full')``).
    ``scan_layers``: run a model's stacked layers as a ``jax.lax.scan`` (the default: compile time
    flat in depth, as the plain ``model(tokens)``), else in a loop over the stack's slices
    (more memory: docs/models.md); a model whose layers differ keeps them in a list, which
    always loops. How the layers are stored does not depend on it (`shardax.models.create`).

    Example::

        Layout(tp_mode="sync", pp_schedule="circular", pp_microbatches=4, pp_virtual_stages=2)
    """

    tp_mode: str = "none"
    sequence_parallel: bool = False
    pp_schedule: str = "gpipe"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 1
    fsdp_mode: str = "xla"
    fsdp_recompute: bool = True
    remat: str = "none"
    attention: str = "auto"
    scan_layers: bool = True

    def __post_init__(self):
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        if self.sequence_parallel and self.tp_mode == "none":
            raise ValueError("sequence_parallel needs explicit tensor parallelism: "
                             "tp_mode 'sync', 'async' or 'async_bidi'")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {PP_SCHEDULES}, got "
                             f"{self.pp_schedule!r}")
        if self.pp_microbatches < 1 or self.pp_virtual_stages < 1:
            raise ValueError(f"pp_microbatches={self.pp_microbatches} and pp_virtual_stages="
                             f"{self.pp_virtual_stages} must be >= 1")
        if self.pp_schedule != "circular" and self.pp_virtual_stages != 1:
            raise ValueError(f"pp_virtual_stages={self.pp_virtual_stages} needs "
                             f"pp_schedule='circular' ({self.pp_schedule} has one stage per "
                             "device)")
        if self.fsdp_mode not in FSDP_MODES:
            raise ValueError(f"fsdp_mode must be one of {FSDP_MODES}, got {self.fsdp_mode!r}")
        check_remat(self.remat)
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got "
                             f"{self.attention!r}")

    @property
    def sp(self) -> bool:
        """Sequence-parallel activations: asked for, or implied by an async TP mode."""
        return self.sequence_parallel or self.tp_mode.startswith("async")

    @property
    def virtual_stages(self) -> int:
        """Virtual stages per device the schedule runs (1 unless circular)."""
        return self.pp_virtual_stages if self.pp_schedule == "circular" else 1

    def microbatches(self, pp: int) -> int:
        """Pipeline microbatches per step on a 'pp' axis of size ``pp`` (1 without one).

        >>> Layout(pp_microbatches=4).microbatches(2), Layout(pp_microbatches=4).microbatches(1)
        (4, 1)
        """
        return self.pp_microbatches if pp > 1 else 1

    def bubble(self, pp: int) -> float:
        """The fraction of a step each of ``pp`` stages sits idle under the schedule (0 without
        a pipeline; `shardax.parallel.pipeline.bubble_fraction`).

        >>> round(Layout(pp_microbatches=4).bubble(4), 3)   # (P-1)/(M+P-1)
        0.429
        """
        if pp == 1:
            return 0.0
        return bubble_fraction(self.pp_schedule, pp, self.pp_microbatches, self.virtual_stages)

    def in_flight(self, pp: int) -> int:
        """Microbatches whose saved activations a stage holds at once: every one under gpipe
        (all forwards before the backwards), at most ``pp`` under 1f1b and circular.

        >>> Layout(pp_microbatches=8).in_flight(2), Layout("none", False, "1f1b", 8).in_flight(2)
        (8, 2)
        """
        m = self.microbatches(pp)
        return m if self.pp_schedule == "gpipe" else min(m, pp)


def pipeline_layouts(pp: int) -> list[Layout]:
    """The pipeline layouts worth trying on a 'pp' axis of size ``pp`` (the planner's search):
    gpipe and 1f1b with P or 2P microbatches; none without a pipeline (``pp == 1``).

    >>> [(x.pp_schedule, x.pp_microbatches) for x in pipeline_layouts(2)]
    [('gpipe', 2), ('gpipe', 4), ('1f1b', 2), ('1f1b', 4)]
    """
    if pp == 1:
        return []
    return [Layout(pp_schedule=s, pp_microbatches=m) for s in ("gpipe", "1f1b")
            for m in (pp, 2 * pp)]


def check_mesh(config: Any, layout: Layout, mesh_shape: Mapping[str, int], *,
               batch_size: int, seq_len: int) -> None:
    """Raises ``ValueError`` (naming the axis and sizes) if a model of architecture ``config``
    cannot run with ``layout`` on a mesh of ``mesh_shape`` with ``[batch_size, seq_len]``
    batches; a shape check, nothing is built.

    Example::

        check_mesh(CONFIGS['llama-tiny'], Layout(tp_mode='async'), {'fsdp': 8},
                   batch_size=16, seq_len=128)   # ValueError: tp_mode='async' needs a 'tp' ...
    """
    c, lay, mesh = config, layout, dict(mesh_shape)
    tp, pp, cp, ep = (mesh.get(a, 1) for a in ("tp", "pp", "cp", "ep"))

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{message} (mesh {mesh})")

    if lay.tp_mode != "none":
        need(tp > 1, f"tp_mode={lay.tp_mode!r} needs a 'tp' mesh axis of size > 1")
        need(not getattr(c, "mla", False), f"tp_mode={lay.tp_mode!r} does not run multi-head "
             "latent attention (kv_lora_rank > 0): use tp_mode='none', the rules split it")
        need(not getattr(c, "attn_sinks", False), f"tp_mode={lay.tp_mode!r} does not run "
             "gpt-oss attention (sinks, o_proj bias): use tp_mode='none', the rules split it")
        kv = getattr(c, "n_kv_heads", c.n_heads)
        for what, n in (("n_heads", c.n_heads), ("n_kv_heads", kv)):
            need(n % tp == 0 or tp % n == 0,
                 f"{what}={n} and 'tp' size {tp}: one must divide the other (whole heads per "
                 "device, or each head replicated on tp/heads devices)")
        need(c.mlp_dim % tp == 0, f"mlp_dim={c.mlp_dim} is not divisible by 'tp' size {tp}")
        if lay.sp:
            need(seq_len % tp == 0, f"sequence parallelism splits --seq-len {seq_len} over "
                 f"'tp' size {tp}, which does not divide it")
            need(cp == 1, "sequence parallelism together with a 'cp' axis is not supported; "
                 "use one of them")
    mixed = getattr(c, "mixed_layers", False) and (
        f"first_k_dense={c.first_k_dense} dense layers precede the experts" if c.first_k_dense
        else f"global_every={c.global_every} mixes sliding-window and global attention layers")
    if pp > 1:
        v, m = lay.pp_virtual_stages, lay.pp_microbatches
        need(not mixed, f"a 'pp' axis splits one stack of identical layers into stages, but "
             f"{mixed}; use a mesh without 'pp'")
        need(c.n_layers % (pp * v) == 0, f"n_layers={c.n_layers} is not divisible by 'pp' size "
             f"{pp} x virtual stages {v}")
        need(v == 1 or m >= pp, f"the circular schedule with {v} virtual stages "
             f"needs microbatches >= 'pp' size {pp}, got {m}")
        need(batch_size % m == 0, f"batch size {batch_size} is not divisible by {m} "
             "microbatches")
    if cp > 1:
        need(not getattr(c, "attn_sinks", False), "attention sinks (gpt-oss) have no ring "
             "attention form over 'cp': use a mesh without 'cp'")
        need(seq_len % (2 * cp) == 0, f"--seq-len {seq_len} must divide into 2 x 'cp' size "
             f"{cp} = {2 * cp} load-balanced chunks")
    if ep > 1:
        experts = getattr(c, "n_experts", 0)
        need(experts > 0, f"an 'ep' axis of size {ep} needs a mixture-of-experts model "
             "(n_experts > 0, e.g. llama-moe-tiny)")
        need(experts % ep == 0, f"n_experts={experts} is not divisible by 'ep' size {ep}")
