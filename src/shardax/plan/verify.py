"""``shardax verify``: prove that a layout computes what one device computes, leaf by leaf.

The step under test is the user's own, given by a small protocol: a module-level function
(``STEP.py:make_step``) returning a `Step`, or the tuple ``(init_fn, step_fn, batch_fn,
rules)``:

- ``init_fn(key) -> params``: any pytree of arrays (plain JAX; ``nnx.split(model)[1]`` for
  Flax NNX; linen's variables; ``eqx.partition(model, eqx.is_array)[0]`` for Equinox);
- ``step_fn(params, batch) -> loss``: a scalar; it may call ``jax.shard_map`` over the layout's
  axis names (the mesh is set with ``jax.set_mesh``, and has every axis named by any layout);
- ``batch_fn(step) -> batch``: the global batch of step ``step`` (numpy or JAX arrays);
- ``rules``: shardax rules for the parameters (a `ShardingRule`, a ``PartitionSpec`` or a
  tree prefix of them); the batch is split on its leading dimension over the data axes 'dp'
  and 'fsdp' present (``Step.batch_spec`` overrides it).

`verify` differentiates ``step_fn`` and applies plain SGD (``params - lr * grads``) for
``steps`` steps, once on one device and once per layout over emulated devices, and compares
losses, gradients (every step) and the final parameters, each leaf's maximum absolute
difference relative to that leaf's largest magnitude. Also reported per layout: parameter
leaves of at least ``large_bytes`` left replicated (a warning: memory), per-device memory of
the compiled step and the bytes per collective kind.

>>> report = verify(make_step(), ["fsdp=8", "fsdp=4,tp=2"], steps=3)  # doctest: +SKIP
>>> report.ok, report.layouts[1].worst  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardax.hlo import hlo_collectives, memory_bytes, summarize_collectives
from shardax.inspect import _human
from shardax.mesh import parse_mesh_string
from shardax.rules import match_specs
from shardax.train.config import UsageError

__all__ = ["LayoutReport", "Report", "Step", "load_step", "parse_layouts", "verify"]

DATA_AXES = ("dp", "fsdp")


@dataclass
class Step:
    """The step under test (see the module docstring)."""

    init_fn: Callable[[jax.Array], Any]
    step_fn: Callable[[Any, Any], jax.Array]
    batch_fn: Callable[[int], Any]
    rules: Any
    batch_spec: PartitionSpec | None = None  # default: leading dim over 'dp' and 'fsdp'


@dataclass
class LayoutReport:
    """One layout against the single device: the largest relative difference of each kind and
    the leaf it is in, warnings, memory and collectives per device."""

    layout: str
    devices: int
    loss_diff: float = 0.0
    grad_diff: float = 0.0
    grad_leaf: str = ""
    param_diff: float = 0.0
    param_leaf: str = ""
    warnings: list[str] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    tolerance: float = 0.0

    @property
    def worst(self) -> tuple[str, float]:
        """``(what, relative difference)`` of the largest difference: ``'loss'``,
        ``"grads['w']"`` or ``"params['w']"``."""
        return max([("loss", self.loss_diff), (f"grads{self.grad_leaf}", self.grad_diff),
                    (f"params{self.param_leaf}", self.param_diff)], key=lambda x: x[1])

    @property
    def ok(self) -> bool:
        return self.worst[1] <= self.tolerance

    def line(self) -> str:
        peak = (self.memory.get("argument_size_in_bytes", 0)
                + self.memory.get("output_size_in_bytes", 0)
                - self.memory.get("alias_size_in_bytes", 0)
                + self.memory.get("temp_size_in_bytes", 0))
        moved = ", ".join(f"{k} x{v['count']} ({_human(v['bytes'])})"
                          for k, v in self.collectives.items() if v["count"]) or "none"
        what, diff = self.worst
        verdict = "same" if self.ok else f"DIFFERS in {what} by {diff:.3g}"
        return (f"{self.layout} ({self.devices} devices): {verdict}; max relative difference: "
                f"loss {self.loss_diff:.3g}, grads {self.grad_diff:.3g}{self.grad_leaf}, "
                f"params {self.param_diff:.3g}{self.param_leaf}; peak {_human(peak)} per device; "
                f"collectives per step: {moved}")


@dataclass
class Report:
    """Every layout's `LayoutReport`; ``ok`` when all are within the tolerance."""

    layouts: list[LayoutReport]
    steps: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.layouts)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": self.steps, "tolerance": self.tolerance,
                "jax": jax.__version__, "optimizer": "sgd",
                "layouts": [{**dataclasses.asdict(r), "ok": r.ok, "worst": list(r.worst)}
                            for r in self.layouts]}


def parse_layouts(text: str) -> list[dict[str, int]]:
    """``"fsdp=8;fsdp=4,tp=2"`` -> ``[{'fsdp': 8}, {'fsdp': 4, 'tp': 2}]``; a UsageError names
    the bad layout.

    >>> parse_layouts("fsdp=8; dp=2,tp=4")
    [{'fsdp': 8}, {'dp': 2, 'tp': 4}]
    """
    layouts = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        try:
            sizes = parse_mesh_string(part)
        except ValueError as e:
            raise UsageError(f"--layouts {part!r}: {e}") from None
        if any(size < 1 for size in sizes.values()):
            raise UsageError(f"--layouts {part!r}: sizes must be >= 1 (no -1: a layout states "
                             "its device count)")
        layouts.append(sizes)
    if not layouts:
        raise UsageError("--layouts: give at least one layout, e.g. 'fsdp=8;fsdp=4,tp=2'")
    return layouts


def load_step(spec: str) -> Step:
    """``'path/step.py:make_step'`` -> the `Step` that function returns; a UsageError names
    what is missing."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise UsageError(f"{spec!r}: expected FILE.py:FUNCTION, e.g. step.py:make_step")
    if not Path(path).is_file():
        raise UsageError(f"{spec!r}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"_shardax_verify_{Path(path).stem}",
                                                         path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    make = getattr(module, name, None)
    if not callable(make):
        raise UsageError(f"{spec!r}: {path} has no function {name}")
    made = make()
    if isinstance(made, Step):
        return made
    if isinstance(made, (tuple, list)) and len(made) == 4:
        return Step(*made)
    raise UsageError(f"{spec!r}: {name}() must return shardax.plan.verify.Step or "
                     f"(init_fn, step_fn, batch_fn, rules), got {type(made).__name__}")


def _path(keypath: Any) -> str:
    return "".join(str(k) for k in keypath)


def _rel_diffs(got: Any, want: Any) -> list[tuple[str, float]]:
    """Per leaf: max |got - want| / max |want| (absolute where want is all zeros)."""
    out = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        diff = float(np.max(np.abs(a - b))) if b.size else 0.0
        out.append((_path(path), diff / scale if scale > 0 else diff))
    return out


def _mesh(sizes: dict[str, int], names: list[str]) -> jax.sharding.Mesh:
    dims = [sizes.get(n, 1) for n in names]
    n = math.prod(dims)
    if n > jax.device_count():
        raise UsageError(f"layout {_text(sizes)} needs {n} devices; {jax.device_count()} exist")
    return jax.make_mesh(dims, names, devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _text(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def _run(step: Step, mesh: jax.sharding.Mesh, steps: int, lr: float, seed: int
         ) -> tuple[list[float], list[Any], Any, Any, Any]:
    """``(losses, grads per step, final params, compiled step, param shardings)``."""
    params = step.init_fn(jax.random.key(seed))
    try:
        specs = match_specs(step.rules, params, mesh)
    except ValueError as e:  # an axis no layout has, a size the mesh cannot divide
        layout = _text({k: v for k, v in mesh.shape.items() if v > 1}) or "one device"
        raise UsageError(f"layout {layout}: the rules do not apply: {e}") from None
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s if s is not None else
                                                    PartitionSpec()), specs,
                            is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    data = tuple(a for a in DATA_AXES if mesh.shape.get(a, 1) > 1)
    batch_spec = step.batch_spec if step.batch_spec is not None else PartitionSpec(data or None)
    batch0 = step.batch_fn(0)
    batch_sh = jax.tree.map(lambda x: NamedSharding(mesh, batch_spec if np.ndim(x) else
                                                    PartitionSpec()), batch0)

    def train_step(params: Any, batch: Any) -> tuple[Any, jax.Array, Any]:
        loss, grads = jax.value_and_grad(step.step_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

    jitted = jax.jit(train_step, in_shardings=(param_sh, batch_sh),
                     out_shardings=(param_sh, NamedSharding(mesh, PartitionSpec()), param_sh),
                     donate_argnums=0)
    losses, grads_seen = [], []
    with jax.set_mesh(mesh):
        params = jax.device_put(params, param_sh)
        compiled = jitted.lower(params, jax.device_put(batch0, batch_sh)).compile()
        for i in range(steps):
            params, loss, grads = jitted(params, jax.device_put(step.batch_fn(i), batch_sh))
            losses.append(float(loss))
            grads_seen.append(jax.device_get(grads))
    return losses, grads_seen, jax.device_get(params), compiled, param_sh


def verify(step: Step, layouts: list[dict[str, int]], *, steps: int = 3, lr: float = 0.1,
           tolerance: float = 1e-4, large_bytes: float = 2**20, seed: int = 0) -> Report:
    """Runs ``step`` on one device and on each layout; see the module docstring."""
    names = list(dict.fromkeys(n for sizes in layouts for n in sizes))
    reference = _run(step, _mesh({}, names), steps, lr, seed)
    reports = []
    for sizes in layouts:
        mesh = _mesh(sizes, names)
        losses, grads, params, compiled, shardings = _run(step, mesh, steps, lr, seed)
        report = LayoutReport(_text(sizes), mesh.size, tolerance=tolerance)
        report.loss_diff = max(abs(a - b) / max(abs(b), 1e-30)
                               for a, b in zip(losses, reference[0]))
        per_grad = [d for got, want in zip(grads, reference[1]) for d in _rel_diffs(got, want)]
        report.grad_leaf, report.grad_diff = max(per_grad, key=lambda x: x[1])
        report.param_leaf, report.param_diff = max(_rel_diffs(params, reference[2]),
                                                   key=lambda x: x[1])
        for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                          jax.tree.leaves(shardings)):
            if (mesh.size > 1 and leaf.nbytes >= large_bytes
                    and sharding.is_fully_replicated):
                report.warnings.append(
                    f"{report.layout}: params{_path(path)} ({'x'.join(map(str, leaf.shape))} "
                    f"{leaf.dtype}, {_human(leaf.nbytes)}) is replicated on all {mesh.size} "
                    "devices: no rule shards it")
        report.memory = memory_bytes(compiled)
        report.collectives = {k: {"count": v.count, "bytes": v.bytes} for k, v in
                              summarize_collectives(hlo_collectives(compiled.as_text())).items()}
        reports.append(report)
    return Report(reports, steps, tolerance)
