"""Reading compiled programs: the collectives of an optimized HLO module and its memory use.

``hlo_collectives`` parses the text of ``compiled.as_text()`` (async start/done pairs counted
once, loop bodies times their trip count); ``memory_bytes`` reads ``compiled.memory_analysis()``.

>>> summarize_collectives(hlo_collectives(compiled.as_text()))["all-gather"]  # doctest: +SKIP
CollectiveStats(count=2, bytes=4096)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "CollectiveStats",
    "hlo_collectives",
    "replica_groups",
    "summarize_collectives",
    "memory_bytes",
    "peak_bytes",
]

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
    groups: tuple[tuple[int, ...], ...] | None = None
    """The device ids that communicate, one tuple per group (``replica_groups`` in any of
    XLA's spellings; a collective-permute's rings); None: all devices, or a form not known."""


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """``[2,4]`` and ``T(1,0)`` of an iota device list -> the ids in that order."""
    shape = [int(d) for d in dims.split(",") if d]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(attrs: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a collective's attributes, in any of XLA's spellings: explicit
    ``replica_groups={{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, the mesh form
    ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}``, and a permute's
    ``source_target_pairs`` (the rings it moves along: connected devices form a group). None:
    all devices, or a form not known.

    >>> replica_groups("replica_groups=[2,2]<=[4]")
    ((0, 1), (2, 3))
    """
    pairs = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", attrs)
    if pairs:
        return _components([tuple(int(i) for i in g.split(",")) for g in
                            re.findall(r"\{([\d,]+)\}", pairs.group(1))])
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if explicit:
        groups = tuple(tuple(int(i) for i in g.split(",") if i) for g in
                       re.findall(r"\{([\d,]*)\}", explicit.group(1)))
        return groups if groups and groups[0] else None
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                     attrs)
    if iota:
        ids = _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)),
                                                          int(iota.group(2)))
        return tuple(tuple(int(i) for i in row) for row in ids)
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
                     r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attrs)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2)
               else np.arange(int(np.prod(sizes)))).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(4))]
        rest = [i for i in range(len(names)) if i not in over]
        ids = ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[i] for i in over])))
        return tuple(tuple(int(i) for i in row) for row in ids)
    return None


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
                                        computation, replica_groups(attrs)))
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


def _components(pairs: list[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """Connected components of the devices a set of (source, target) pairs links."""
    parent: dict[int, int] = {}

    def root(d: int) -> int:
        while parent.setdefault(d, d) != d:
            d = parent[d]
        return d

    for a, b in pairs:
        parent[root(a)] = root(b)
    comps: dict[int, list[int]] = {}
    for d in sorted(parent):
        comps.setdefault(root(d), []).append(d)
    return tuple(tuple(c) for c in comps.values())


def summarize_collectives(ops: Iterable[CollectiveOp]) -> dict[str, CollectiveStats]:
    """``{kind: CollectiveStats}`` for every kind in ``COLLECTIVE_KINDS`` (zeros included)."""
    stats = {kind: CollectiveStats() for kind in COLLECTIVE_KINDS}
    for op in ops:
        stats[op.kind].count += op.multiplier
        stats[op.kind].bytes += op.bytes
    return stats


def memory_bytes(compiled: Any) -> dict[str, int]:
    """The ``*_in_bytes`` fields of ``compiled.memory_analysis()`` (per device), or ``{}``
    where the backend reports none.

    >>> memory_bytes(step.lower(state, batch).compile())["temp_size_in_bytes"]  # doctest: +SKIP
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    return {
        name: int(getattr(analysis, name))
        for name in dir(analysis)
        if name.endswith("_in_bytes") and not name.startswith("_")
    }


def peak_bytes(memory: dict[str, int]) -> int:
    """Peak bytes per device of a compiled program from its `memory_bytes`: arguments +
    outputs - outputs aliased to donated arguments + temporaries.

    >>> peak_bytes({"argument_size_in_bytes": 8, "output_size_in_bytes": 8,
    ...             "alias_size_in_bytes": 8, "temp_size_in_bytes": 4})
    12
    """
    return (memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
            - memory.get("alias_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0))
