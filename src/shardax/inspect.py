"""``ShardingPlan``: what a compiled sharded step holds and moves, read from XLA itself.

Per-leaf shardings and bytes come from the compiled executable's input/output shardings (what
XLA actually chose, not what was asked for), collectives from its optimized HLO, memory from
``compiled.memory_analysis()``.

>>> print(step.plan(state, batch))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from shardax.utils import array_nbytes, tree_path_to_string

__all__ = ["ShardingPlan", "PlanRow", "CollectiveStats", "CollectiveOp", "hlo_collectives"]

COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass(frozen=True)
class CollectiveOp:
    """One collective in the optimized HLO.

    ``bytes`` is the larger of its input and output per device (the full gathered / reduced
    buffer), times ``multiplier`` (the trip count of enclosing loops, where XLA states it).
    """

    name: str
    kind: str
    dtype: str
    bytes: int
    multiplier: int
    computation: str


@dataclass
class CollectiveStats:
    """Totals of one collective kind: ``count`` executions and ``bytes`` per device per call."""

    count: int = 0
    bytes: int = 0


def _type_bytes(type_text: str) -> tuple[int, str]:
    """Bytes of an HLO type (arrays or tuples of arrays) and the widest element dtype."""
    total, widest, widest_size = 0.0, "", -1.0
    for dtype, dims in _ARRAY_TYPE.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        size = _DTYPE_BYTES[dtype]
        count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += size * count
        if size > widest_size:
            widest, widest_size = dtype, size
    return int(total), widest


def _split_type(rest: str) -> tuple[str, str]:
    """Splits ``"<type> opcode(...)..."`` into the type and the remainder."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _operands(text: str) -> tuple[str, str]:
    """``"op(a, b), attrs"`` -> (``"a, b"``, ``"attrs"``)."""
    depth = 0
    start = text.find("(")
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return text[start + 1 : i], text[i + 1 :]
    return text[start + 1 :], ""


def _parse_hlo(hlo: str):
    """Computations of an HLO module: name -> list of (name, type, opcode, operands, attrs)."""
    computations: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        type_text, rest = _split_type(rest.strip())
        opcode = rest.split("(", 1)[0].strip()
        operand_text, attrs = _operands(rest)
        operand_names = re.findall(r"%([\w.\-]+)", operand_text)
        computations[current].append((name, type_text, opcode, operand_names, attrs))
    return entry, computations


def hlo_collectives(hlo: str) -> list[CollectiveOp]:
    """Every collective of an optimized HLO module, async start/done pairs counted once.

    >>> ops = hlo_collectives(compiled.as_text())  # doctest: +SKIP
    """
    entry, computations = _parse_hlo(hlo)
    types = {i[0]: i[1] for instrs in computations.values() for i in instrs}
    done_types = {
        operands[0]: type_text
        for instrs in computations.values()
        for _, type_text, opcode, operands, _ in instrs
        if opcode.endswith("-done") and operands
    }
    ops: list[CollectiveOp] = []

    def visit(computation: str, multiplier: int, depth: int = 0) -> None:
        if depth > 64:  # malformed / recursive text: stop rather than loop
            return
        for name, type_text, opcode, operands, attrs in computations.get(computation, []):
            base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
            if base in COLLECTIVE_KINDS:
                is_start = opcode.endswith("-start")
                out_text = done_types.get(name, type_text) if is_start else type_text
                in_bytes, in_dtype = _type_bytes(" ".join(types.get(o, "") for o in operands))
                out_bytes, out_dtype = _type_bytes(out_text)
                if is_start and name not in done_types:
                    out_bytes = in_bytes  # no done op found: the start's type repeats inputs
                ops.append(CollectiveOp(name, base, in_dtype or out_dtype,
                                        max(in_bytes, out_bytes) * multiplier, multiplier,
                                        computation))
            trip = _TRIP_COUNT.search(attrs)
            for kind, callee in _CALLEE.findall(attrs):
                loop_body = opcode == "while" and kind == "body" and trip
                factor = int(trip.group(1)) if loop_body else 1
                visit(callee, multiplier * factor, depth + 1)
            for branches in _BRANCHES.findall(attrs):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    visit(callee, multiplier, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return ops


def summarize_collectives(ops: Iterable[CollectiveOp]) -> dict[str, CollectiveStats]:
    """``{kind: CollectiveStats}`` for every kind in ``COLLECTIVE_KINDS`` (zeros included)."""
    stats = {kind: CollectiveStats() for kind in COLLECTIVE_KINDS}
    for op in ops:
        stats[op.kind].count += op.multiplier
        stats[op.kind].bytes += op.bytes
    return stats


@dataclass(frozen=True)
class PlanRow:
    """One input or output leaf: where it lives and what one device holds of it."""

    kind: str  # "input" or "output"
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int


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
    return PlanRow(kind, path, tuple(shape), str(dtype), _spec_text(sharding, len(shape)),
                   array_nbytes(sharding.shard_shape(tuple(shape)), dtype))


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
        # None marks an argument jax.jit pruned as unused: it is never put on the devices.
        arg_shardings = jax.tree_util.tree_leaves(
            compiled.input_shardings[0], is_leaf=lambda x: x is None
        )
        avals = jax.tree_util.tree_leaves(compiled.in_avals[0])  # what the device holds
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
        analysis = compiled.memory_analysis()
        memory = {
            name: int(getattr(analysis, name))
            for name in dir(analysis)
            if name.endswith("_in_bytes") and not name.startswith("_")
        } if analysis is not None else {}
        return cls(
            mesh_shape=dict(zip(mesh.axis_names, mesh.axis_sizes)),
            rows=rows,
            collectives=summarize_collectives(ops),
            argument_bytes_per_device=sum(r.bytes_per_device for r in rows if r.kind == "input"),
            output_bytes_per_device=sum(r.bytes_per_device for r in rows if r.kind == "output"),
            collective_ops=ops,
            memory=memory,
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
        return "\n".join(lines)
