"""``ShardingPlan``: the table of what a compiled sharded step holds and moves, per leaf.

Per-leaf shardings and bytes come from the compiled executable's input/output shardings (what
XLA actually chose, not what was asked for); collectives and memory are read from the compiled
program by ``shardax.hlo``.

>>> print(step.plan(state, batch))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import jax

from shardax.hlo import (
    CollectiveOp,
    CollectiveStats,
    hlo_collectives,
    memory_bytes,
    summarize_collectives,
)
from shardax.utils import array_nbytes, tree_path_to_string

__all__ = ["ShardingPlan", "PlanRow"]


@dataclass(frozen=True)
class PlanRow:
    """One input or output leaf: where it lives and what one device holds of it."""

    kind: str  # "input" or "output"
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int
    memory_kind: str | None = None  # None: the device's default memory


def _spec_text(sharding: Any, ndim: int) -> str:
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        if all(entry is None for entry in spec):
            return "replicated"
        return str(tuple(spec) + (None,) * (ndim - len(spec)))
    return "replicated" if sharding.is_fully_replicated else type(sharding).__name__


def _row(kind: str, path: str, shape: tuple, dtype: Any, sharding: Any) -> PlanRow:
    if sharding is None:  # an input the compiled program does not use
        return PlanRow(kind, path, tuple(shape), str(dtype), "unused", 0)
    kind_of_memory = getattr(sharding, "memory_kind", None)
    return PlanRow(kind, path, tuple(shape), str(dtype), _spec_text(sharding, len(shape)),
                   array_nbytes(sharding.shard_shape(tuple(shape)), dtype),
                   None if kind_of_memory in (None, "device") else kind_of_memory)


def _separate_host_memory(memory: dict[str, int], rows: list[PlanRow]) -> dict[str, int]:
    """``memory`` with the inputs and outputs placed in host memory (``HostOffloadRule``)
    counted as host bytes. Backends whose ``memory_analysis()`` has no host figures (CPU,
    where both memories are the same RAM) count them as device arguments and outputs."""
    host = {k: sum(r.bytes_per_device for r in rows if r.kind == k and r.memory_kind)
            for k in ("input", "output")}
    if not memory or not any(host.values()) or memory.get("host_argument_size_in_bytes"):
        return memory
    out = dict(memory)
    out["argument_size_in_bytes"] -= host["input"]
    out["host_argument_size_in_bytes"] = host["input"]
    out["output_size_in_bytes"] -= host["output"]
    out["host_output_size_in_bytes"] = host["output"]
    aliased = min(host["input"], host["output"], out.get("alias_size_in_bytes", 0))
    out["alias_size_in_bytes"] = out.get("alias_size_in_bytes", 0) - aliased  # donated state
    out["host_alias_size_in_bytes"] = aliased
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class ShardingPlan:
    """How one compiled step is laid out on the mesh.

    Attributes:
      mesh_shape: ``{axis: size}``.
      rows: one ``PlanRow`` per input and output leaf.
      argument_bytes_per_device: bytes one device holds of all inputs.
      output_bytes_per_device: the same for outputs.
      collectives: ``{kind: CollectiveStats}`` from the optimized HLO (per step, per device).
      collective_ops: every collective found, for a closer look.
      memory: ``compiled.memory_analysis()`` fields (bytes per device).
      hlo: the optimized HLO text.
    """

    mesh_shape: dict[str, int]
    rows: list[PlanRow]
    collectives: dict[str, CollectiveStats]
    argument_bytes_per_device: int
    output_bytes_per_device: int
    collective_ops: list[CollectiveOp] = field(repr=False, default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    hlo: str = field(repr=False, default="")



    @classmethod
    def from_compiled(
        cls, compiled: jax.stages.Compiled, in_paths: list[str], mesh: Any
    ) -> ShardingPlan:
        """Builds the plan of an executable whose flat inputs are named by ``in_paths``."""
        # Read the shardings leaf by leaf of the inputs' own structure: a None there is an
        # argument jax.jit pruned as unused (never put on the devices), while the inputs' None
        # subtrees and empty containers hold no leaf at all.
        avals, inputs = jax.tree_util.tree_flatten(compiled.in_avals[0])  # what devices hold
        arg_shardings = inputs.flatten_up_to(compiled.input_shardings[0])
        rows = [
            _row("input", path, aval.shape, aval.dtype, sharding)
            for path, aval, sharding in zip(in_paths, avals, arg_shardings)
        ]
        out_leaves = jax.tree_util.tree_flatten_with_path(compiled.out_info)[0]
        rows += [
            _row("output", "output" + (f"/{tree_path_to_string(p, sep='/')}" if p else ""),
                 info.shape, info.dtype, info.sharding)
            for p, info in out_leaves
        ]
        hlo = compiled.as_text()
        ops = hlo_collectives(hlo)
        return cls(
            mesh_shape=dict(zip(mesh.axis_names, mesh.axis_sizes)),
            rows=rows,
            collectives=summarize_collectives(ops),
            argument_bytes_per_device=sum(r.bytes_per_device for r in rows if r.kind == "input"),
            output_bytes_per_device=sum(r.bytes_per_device for r in rows if r.kind == "output"),
            collective_ops=ops,
            memory=_separate_host_memory(memory_bytes(compiled), rows),
            hlo=hlo,
        )

    def where(self, keep: Any) -> ShardingPlan:
        """The same plan showing only the rows for which ``keep(row)`` is true (totals and
        collectives are kept whole).

        >>> print(plan.where(lambda row: "params" in row.path))  # doctest: +SKIP
        """
        return dataclasses.replace(self, rows=[r for r in self.rows if keep(r)])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no HLO)."""
        return {
            "mesh": self.mesh_shape,
            "rows": [vars(r) | {"shape": list(r.shape)} for r in self.rows],
            "argument_bytes_per_device": self.argument_bytes_per_device,
            "output_bytes_per_device": self.output_bytes_per_device,
            "collectives": {k: vars(v) for k, v in self.collectives.items()},
            "memory": self.memory,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        head = ("", "path", "shape", "dtype", "spec", "per device")
        body = [
            (r.kind[:3], r.path, "x".join(map(str, r.shape)) or "scalar", r.dtype, r.spec,
             _human(r.bytes_per_device))
            for r in self.rows
        ]
        widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:{'>' if i == 5 else '<'}{w}}}" for i, w in enumerate(widths))
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines = [f"ShardingPlan on mesh ({mesh})", fmt.format(*head)]
        lines += [fmt.format(*row) for row in body]
        lines.append(f"inputs per device: {_human(self.argument_bytes_per_device)}   "
                     f"outputs per device: {_human(self.output_bytes_per_device)}")
        used = {k: v for k, v in self.collectives.items() if v.count}
        if used:
            lines.append("collectives per step: " + ", ".join(
                f"{k} x{v.count} ({_human(v.bytes)})" for k, v in used.items()))
        else:
            lines.append("collectives per step: none")
        if self.memory:
            keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                    "alias_size_in_bytes")
            lines.append("compiled memory per device: " + ", ".join(
                f"{k.removesuffix('_size_in_bytes')} {_human(self.memory[k])}"
                for k in keys if k in self.memory))
            if self.memory.get("host_argument_size_in_bytes"):
                lines.append("in host memory per device: " + _human(
                    self.memory["host_argument_size_in_bytes"]) + " (inputs placed there)")
        return "\n".join(lines)
