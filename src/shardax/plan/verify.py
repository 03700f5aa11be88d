"""``shardax verify``: prove that a layout computes what one device computes, leaf by leaf.

The step under test is the user's own, given by a small protocol: a module-level function
(``STEP.py:make_step``) returning a `Step`, or the tuple ``(init_fn, step_fn, batch_fn,
rules)``:

- ``init_fn(key) -> params``: any pytree (plain JAX dicts; ``nnx.split(model)[1]`` for Flax
  NNX; ``model.init(...)['params']`` for linen, ``LogicallyPartitioned`` boxes included; an
  Equinox module as it is). Its float arrays are trained; other arrays (PRNG keys, integer
  counters) are held fixed and replicated; other leaves (Equinox's functions, Python numbers)
  are kept as they are and never cross the ``jit`` boundary;
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
leaves of at least ``large_bytes`` left replicated (a warning: memory), what the rules
silently drop or disagree on (`shardax.rulecheck`: an axis a rule names that the mesh
lacks or cannot divide, two rules matching one leaf differently, one mesh axis wanted by two
dims), per-device memory of the compiled step and the bytes per collective kind.

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
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardax.hlo import hlo_collectives, memory_bytes, peak_bytes, summarize_collectives
from shardax.inspect import _human
from shardax.mesh import parse_mesh_string
from shardax.rulecheck import rule_findings
from shardax.rules import match_specs_flat
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
    rule_findings: list[dict[str, str]] = field(default_factory=list)  # kind, leaf, message
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
        peak = peak_bytes(self.memory)
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
    if module_spec is None or module_spec.loader is None:  # what Python cannot import
        raise UsageError(f"{spec!r}: {path} is not a Python file; expected FILE.py:FUNCTION")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UsageError(f"{spec!r}: {e.filename}:{e.lineno}: {e.msg}") from None
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


def _rel_diffs(got: list[Any], want: list[Any], paths: list[str]) -> list[tuple[str, float]]:
    """Per leaf: max |got - want| / max |want| (absolute where want is all zeros)."""
    out = []
    for path, a, b in zip(paths, got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        diff = float(np.max(np.abs(a - b))) if b.size else 0.0
        out.append((path, diff / scale if scale > 0 else diff))
    return out


@dataclass
class _State:
    """``init_fn``'s tree taken apart: the float arrays SGD trains, the other arrays (integer
    counters, PRNG keys) held fixed, and everything else (an Equinox module's functions and
    Python numbers) kept as it is; ``combine`` puts the tree back together inside the step."""

    tree: Any
    treedef: Any
    kinds: list[str]  # per leaf: 'train', 'fixed' or 'static'

    @classmethod
    def of(cls, tree: Any) -> _State:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        kinds = ["static" if not isinstance(x, (jax.Array, np.ndarray)) else
                 "train" if jnp.issubdtype(x.dtype, jnp.inexact) else "fixed"
                 for x in leaves]
        return cls(tree, treedef, kinds)

    def part(self, kind: str) -> list[Any]:
        return [x for x, k in zip(jax.tree.leaves(self.tree), self.kinds) if k == kind]

    def paths(self) -> list[str]:
        """The trained leaves' paths, e.g. ``"['w1']"``."""
        found = jax.tree_util.tree_flatten_with_path(self.tree)[0]
        return [_path(p) for (p, _), k in zip(found, self.kinds) if k == "train"]

    def masked(self) -> Any:
        """The tree with only its trained leaves (None elsewhere): what the rules shard."""
        return jax.tree_util.tree_unflatten(self.treedef, [
            x if k == "train" else None
            for x, k in zip(jax.tree.leaves(self.tree), self.kinds)])

    def combine(self, train: list[Any], fixed: list[Any]) -> Any:
        parts = {"train": iter(train), "fixed": iter(fixed)}
        return jax.tree_util.tree_unflatten(self.treedef, [
            x if k == "static" else next(parts[k])
            for x, k in zip(jax.tree.leaves(self.tree), self.kinds)])


def _mesh(sizes: dict[str, int], names: list[str]) -> jax.sharding.Mesh:
    dims = [sizes.get(n, 1) for n in names]
    n = math.prod(dims)
    if n > jax.device_count():
        raise UsageError(f"layout {_text(sizes)} needs {n} devices; {jax.device_count()} exist")
    return jax.make_mesh(dims, names, devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _text(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


@dataclass
class _Run:
    """One run of the step: losses and gradients per step, final parameters (trained leaves,
    in tree order), the compiled step, the parameters' shardings and their paths."""

    losses: list[float]
    grads: list[list[Any]]
    params: list[Any]
    compiled: Any
    shardings: list[NamedSharding]
    paths: list[str]
    state: _State


def _run(step: Step, mesh: jax.sharding.Mesh, steps: int, lr: float, seed: int) -> _Run:
    state = _State.of(step.init_fn(jax.random.key(seed)))
    try:
        _, _, specs = match_specs_flat(step.rules, state.masked(), mesh)
    except ValueError as e:  # an axis no layout has, a size the mesh cannot divide
        layout = _text({k: v for k, v in mesh.shape.items() if v > 1}) or "one device"
        raise UsageError(f"layout {layout}: the rules do not apply: {e}") from None
    replicated = NamedSharding(mesh, PartitionSpec())
    param_sh = [NamedSharding(mesh, s) if s is not None else replicated for s in specs]
    fixed_sh = [replicated] * len(state.part("fixed"))
    data = tuple(a for a in DATA_AXES if mesh.shape.get(a, 1) > 1)
    batch_spec = step.batch_spec if step.batch_spec is not None else PartitionSpec(data or None)
    batch0 = step.batch_fn(0)
    batch_sh = jax.tree.map(lambda x: NamedSharding(mesh, batch_spec if np.ndim(x) else
                                                    PartitionSpec()), batch0)

    def train_step(params: list[Any], fixed: list[Any], batch: Any
                   ) -> tuple[list[Any], jax.Array, list[Any]]:
        loss, grads = jax.value_and_grad(
            lambda p: step.step_fn(state.combine(p, fixed), batch))(params)
        return [p - lr * g for p, g in zip(params, grads)], loss, grads

    jitted = jax.jit(train_step, in_shardings=(param_sh, fixed_sh, batch_sh),
                     out_shardings=(param_sh, replicated, param_sh), donate_argnums=0)
    losses, grads_seen = [], []
    with jax.set_mesh(mesh):
        params = jax.device_put(state.part("train"), param_sh)
        fixed = jax.device_put(state.part("fixed"), fixed_sh)
        compiled = jitted.lower(params, fixed, jax.device_put(batch0, batch_sh)).compile()
        for i in range(steps):
            params, loss, grads = jitted(params, fixed,
                                         jax.device_put(step.batch_fn(i), batch_sh))
            losses.append(float(loss))
            grads_seen.append(jax.device_get(grads))
    return _Run(losses, grads_seen, jax.device_get(params), compiled, param_sh, state.paths(),
                state)


def verify(step: Step, layouts: list[dict[str, int]], *, steps: int = 3, lr: float = 0.1,
           tolerance: float = 1e-4, large_bytes: float = 2**20, seed: int = 0) -> Report:
    """Runs ``step`` on one device and on each layout; see the module docstring."""
    names = list(dict.fromkeys(n for sizes in layouts for n in sizes))
    reference = _run(step, _mesh({}, names), steps, lr, seed)
    reports = []
    for sizes in layouts:
        mesh = _mesh(sizes, names)
        run = _run(step, mesh, steps, lr, seed)
        report = LayoutReport(_text(sizes), mesh.size, tolerance=tolerance)
        report.loss_diff = max(abs(a - b) / max(abs(b), 1e-30)
                               for a, b in zip(run.losses, reference.losses))
        per_grad = [d for got, want in zip(run.grads, reference.grads)
                    for d in _rel_diffs(got, want, run.paths)]
        report.grad_leaf, report.grad_diff = max(per_grad, key=lambda x: x[1])
        report.param_leaf, report.param_diff = max(
            _rel_diffs(run.params, reference.params, run.paths), key=lambda x: x[1])
        for path, leaf, sharding in zip(run.paths, run.params, run.shardings):
            if (mesh.size > 1 and leaf.nbytes >= large_bytes
                    and sharding.is_fully_replicated):
                report.warnings.append(
                    f"{report.layout}: params{path} ({'x'.join(map(str, leaf.shape))} "
                    f"{leaf.dtype}, {_human(leaf.nbytes)}) is replicated on all {mesh.size} "
                    "devices: no rule shards it")
        report.rule_findings = [
            {"kind": f.kind, "leaf": f"params{run.paths[f.leaf]}", "message": f.message}
            for f in rule_findings(step.rules, run.state.masked(), mesh)]
        report.memory = memory_bytes(run.compiled)
        report.collectives = {k: {"count": v.count, "bytes": v.bytes} for k, v in
                              summarize_collectives(hlo_collectives(run.compiled.as_text())).items()}
        reports.append(report)
    return Report(reports, steps, tolerance)
