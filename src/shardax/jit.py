"""``sjit``: ``jax.jit`` whose shardings come from rules resolved against the actual arguments.

Data flows one way: rules + argument tree + mesh -> PartitionSpecs -> NamedShardings -> jax.jit.
Each distinct call signature (mesh, static values, tree structure, shapes, dtypes) resolves its
rules once and keeps its own ``jax.jit`` object; a bounded LRU holds them. The traced function
enters the sharding context itself, so an sjit function called under any JAX transformation
(``jit``, ``grad``, ``vmap``, ``eval_shape``, another sjit...) is a nested ``jax.jit`` with the
resolved shardings. After the first call, a call with the same tree structure goes straight to
that ``jax.jit`` object, whose C++ dispatch checks the rest.

Flax NNX objects (modules, ``nnx.Optimizer``, metrics) may be passed as they are: rules resolve
against their Variables, and what the function changes in place is written back to them, as
``nnx.jit`` does (``shardax.frameworks.nnx``). A function without any rules runs where
``jax.jit`` would run it, on the mesh only if it names the mesh inside (a constraint, a
``shard_map``).

>>> step = mesh.sjit(train_step, in_shardings=(FSDPShardingRule(), None),
...                  out_shardings=(FSDPShardingRule(), None))  # doctest: +SKIP
>>> state, metrics = step(state, batch)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import inspect as _inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardax import _compat, _context
from shardax.constraints import with_sharding_constraint
from shardax.context import ShardingContext
from shardax.frameworks import equinox as static_leaves
from shardax.frameworks.nnx import InPlace, in_place_for
from shardax.inspect import ShardingPlan
from shardax.rulecheck import warn_replicated
from shardax.rules import (
    LogicalAxisRules,
    ShardingRule,
    mappings_as_rules,
    match_shardings_flat,
)
from shardax.utils import tree_path_to_string

__all__ = ["sjit", "ShardedFunction", "SJITCompiledFunction"]

_SCALARS = (bool, int, float, complex)
CACHE_SIZE = 64  # resolved signatures kept per sjit function (least recently used dropped)
WARN_REPLICATED_BYTES = 2**20  # leaves this large that the rules leave replicated: a warning


class _NewSignature(Exception):
    """Raised while tracing a signature's ``jax.jit`` with arguments it was not resolved for."""


def _as_tuple(x: int | str | Sequence[Any] | None) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def _rule_tuple(rules: Any) -> Any:
    """scalax accepted lists for per-argument rules; jax trees treat lists and tuples alike
    only when both sides agree, so lists become tuples. A Haliax ``ResourceMapping`` anywhere
    in the rule tree becomes ``LogicalAxisRules`` (so it also maps activation names)."""
    return mappings_as_rules(tuple(rules) if isinstance(rules, list) else rules)


def _leaf_key(x: Any) -> tuple:
    """What a (non-static) leaf contributes to the cache key: its abstract value."""
    if isinstance(x, _SCALARS):
        return (type(x),)
    return (tuple(x.shape), x.dtype, bool(getattr(getattr(x, "aval", x), "weak_type", False)))


def _shape_dtype(x: Any) -> tuple:
    """What a signature's shardings depend on: shape and dtype (None for Python scalars)."""
    if isinstance(x, _SCALARS):
        return ((), None)
    return (tuple(np.shape(x)), _canonical(x.dtype))


def _canonical(dtype: Any) -> Any:
    """The dtype a value has once on a device (host float64 becomes float32 without x64)."""
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _same_signature(expected: tuple, flat: Sequence[Any]) -> bool:
    return len(expected) == len(flat) and all(
        shape == tuple(np.shape(x)) and (dtype is None or (
            hasattr(x, "dtype") and dtype == _canonical(x.dtype)))
        for (shape, dtype), x in zip(expected, flat)
    )


@dataclass
class _Signature:
    """One resolved call signature."""

    jitted: Any  # the jax.jit object: over the arguments if positional, else the flat leaves
    positional: bool  # only positional dynamic arguments (no static, no keyword ones)
    args_treedef: Any  # tree structure of the dynamic positional arguments
    in_paths: list[str]
    in_shardings: list[NamedSharding | None]  # one per flat dynamic leaf
    out_shardings: Any
    arg_shardings: tuple  # in_shardings as one tree per dynamic positional argument
    needs_mesh: bool  # no sharding anywhere: call under the ambient mesh to get the devices
    in_place: InPlace | None  # NNX Variables the function updates in place: written back
    by_args: Any = None  # for a non-positional signature, the jax.jit taking the arguments
    static_leaf: str | None = None  # the first argument leaf kept static (None: none is)


@dataclass(frozen=True)
class _Fast:
    """The last positional signature called; the next call tries its jax.jit first."""

    jitted: Any
    mesh: Any  # set the ambient mesh around the call (only when the program needs it)
    in_place: InPlace | None


class ShardedFunction:
    """What ``sjit`` returns: call it like the function; ``lower`` and ``plan`` to inspect it."""

    def __init__(
        self,
        fun: Callable[..., Any],
        mesh: Any = None,
        in_shardings: Any = None,
        out_shardings: Any = None,
        static_argnums: int | Sequence[int] | None = None,
        args_sharding_constraint: Any = None,
        annotation_shardings: dict[str, Any] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
        warn_replicated_bytes: float | None = WARN_REPLICATED_BYTES,
        **jit_kwargs: Any,
    ):
        if not callable(fun):
            raise TypeError(f"sjit expects a function, got {type(fun).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.mesh_helper = mesh
        self.in_shardings = _rule_tuple(in_shardings)
        self.out_shardings = _rule_tuple(out_shardings)
        self.args_sharding_constraint = _rule_tuple(args_sharding_constraint)
        if annotation_shardings is not None:
            annotation_shardings = {k: _rule_tuple(v) for k, v in annotation_shardings.items()}
        self.annotation_shardings = annotation_shardings
        logical_axis_rules = mappings_as_rules(logical_axis_rules)
        self.logical_axis_rules = logical_axis_rules or _find_logical_rules(
            self.in_shardings, self.out_shardings, self.args_sharding_constraint
        )
        self._static_out = False  # some output had static leaves: calls unwrap their outputs
        self.jit_kwargs = jit_kwargs
        self.warn_replicated_bytes = warn_replicated_bytes  # None: never warn
        self._warned = False  # a ReplicationWarning is given once per function
        self._cache: OrderedDict[tuple, _Signature] = OrderedDict()
        self._fast: _Fast | None = None
        try:
            self._signature = _inspect.signature(fun)
        except (TypeError, ValueError):
            self._signature = None
        # As in jax.jit, a parameter named by position is also static / donated when passed by
        # keyword, and the other way round.
        self.static_argnums, self.static_argnames = self._both_ways(static_argnums, static_argnames)
        donate_nums, self.donate_argnames = self._both_ways(donate_argnums, donate_argnames)
        self.donate_argnums = frozenset(donate_nums)

    def __repr__(self) -> str:
        return f"<sjit {getattr(self.fun, '__qualname__', self.fun)!r} on {self._helper()!r}>"

    # ------------------------------------------------------------------ argument handling

    def _both_ways(self, argnums: Any, argnames: Any) -> tuple[tuple[int, ...], frozenset]:
        """Completes argument numbers with their names and names with their numbers."""
        nums, names = set(_as_tuple(argnums)), set(_as_tuple(argnames))
        if self._signature is not None:
            positional = [
                p.name for p in self._signature.parameters.values()
                if p.kind in (_inspect.Parameter.POSITIONAL_ONLY,
                              _inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
            keyword_ok = {
                p.name for p in self._signature.parameters.values()
                if p.kind is not _inspect.Parameter.POSITIONAL_ONLY
            }
            nums |= {i for i, name in enumerate(positional) if name in names}
            names |= {positional[i] for i in nums
                      if 0 <= i < len(positional) and positional[i] in keyword_ok}
        return tuple(sorted(nums)), frozenset(names)

    @property
    def mesh(self) -> Any:
        """The ``MeshShardingHelper`` given at creation (scalax's attribute), or None."""
        return self.mesh_helper

    def _helper(self) -> Any:
        helper = self.mesh_helper or _context.active().mesh_helper
        if helper is None:
            raise ValueError(
                "this sjit function has no mesh: create it with mesh.sjit(...) or call it inside "
                "`with mesh.get_context():`"
            )
        return helper

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple, dict]:
        """Splits arguments into (static positional, static keyword, dynamic args, kwargs)."""
        n = len(args)
        # Like jax.jit: a static parameter not passed positionally is static by keyword (or
        # keeps its default).
        static_nums = tuple(i for i in (j if j >= 0 else j + n for j in self.static_argnums)
                            if 0 <= i < n)
        static_args = tuple((i, args[i]) for i in static_nums)
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in static_nums)
        static_kwargs = tuple(
            sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)
        )
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        for where, value in static_args + static_kwargs:
            try:
                hash(value)
            except TypeError as e:
                shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
                raise TypeError(
                    f"static argument {where!r} ({shown}) of type {type(value).__name__} is not "
                    f"hashable ({e}); static arguments must be hashable (as in jax.jit). A "
                    f"module or pytree can be passed as a dynamic argument instead: sjit keeps "
                    f"its non-array leaves static, as eqx.filter_jit does"
                ) from None
        return static_args, static_kwargs, dynamic_args, dynamic_kwargs

    def _resolve(self, args: tuple, kwargs: dict) -> tuple[_Signature, list]:
        helper = self._helper()
        static_args, static_kwargs, dyn_args, dyn_kwargs = self._split(args, kwargs)
        static_leaf = None
        mask = static_leaves.static_mask((dyn_args, dyn_kwargs))
        if mask is not None:  # functions, strings, a module's Python numbers: kept static
            static_leaf = self._check_static(dyn_args, dyn_kwargs, static_args, mask)
            if in_place_for((dyn_args, dyn_kwargs)) is not None:
                raise TypeError(
                    f"sjit: argument {static_leaf!r} is not an array (sjit would keep it "
                    f"static) and the call also passes Flax NNX objects, whose in-place "
                    f"updates sjit cannot write back next to static leaves; pass it as a "
                    f"static argument (static_argnums / static_argnames) or close over it")
            dyn_args, dyn_kwargs = static_leaves.wrap((dyn_args, dyn_kwargs), mask)
        flat, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        leaf_keys = tuple(_leaf_key(x) for x in flat)
        # The mesh itself (devices, axis names and types), never an object id: a helper
        # built later may reuse a collected one's id.
        key = (helper.mesh, static_args, static_kwargs, treedef, leaf_keys)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(helper, static_args, static_kwargs, dyn_args, dyn_kwargs, treedef)
            entry.static_leaf = static_leaf
            self._cache[key] = entry
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return entry, flat

    def _check_static(self, dyn_args: tuple, dyn_kwargs: dict, static_args: tuple,
                      mask: Sequence[bool]) -> str:
        """The path of the first static leaf; a static leaf that cannot be a compile-time
        constant (unhashable: it could change between calls unseen) is a ``TypeError``."""
        flat = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        paths = self._paths(dyn_args, dyn_kwargs, static_args)
        for path, x, static in zip(paths, flat, mask):
            if not static:
                continue
            try:
                hash(static_leaves.Static(x))
            except TypeError:
                raise TypeError(
                    f"argument {path!r} of type {type(x).__name__} is not an array, so sjit "
                    f"keeps it static (as eqx.filter_jit does), but it is not hashable: make "
                    f"it hashable (a tuple, a frozen dataclass), an array, or close over it"
                ) from None
        return next(path for path, static in zip(paths, mask) if static)

    def _arg_names(self, dyn_args: tuple, static_args: tuple) -> list[str]:
        """The parameter name of each dynamic positional argument (``args[i]`` for ``*args``)."""
        static_nums = {i for i, _ in static_args}
        positions = [i for i in range(len(dyn_args) + len(static_nums)) if i not in static_nums]
        params = list(self._signature.parameters.values()) if self._signature is not None else []
        positional = (_inspect.Parameter.POSITIONAL_ONLY, _inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [params[i].name if i < len(params) and params[i].kind in positional
                else f"args[{i}]" for i in positions]

    def _paths(self, dyn_args: tuple, dyn_kwargs: dict, static_args: tuple) -> list[str]:
        """Human names for every dynamic leaf: the parameter name, then the path inside it."""
        out = []
        for name, arg in zip(self._arg_names(dyn_args, static_args), dyn_args):
            for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]:
                out.append(_join(name, path))
        for name, value in dyn_kwargs.items():
            for path, _ in jax.tree_util.tree_flatten_with_path(value)[0]:
                out.append(_join(name, path))
        return out

    def _build(self, helper, static_args, static_kwargs, dyn_args, dyn_kwargs, treedef):
        mesh = helper.mesh
        n_args = len(jax.tree_util.tree_leaves(dyn_args))
        n_kwargs = len(jax.tree_util.tree_leaves(dyn_kwargs))
        paths = self._paths(dyn_args, dyn_kwargs, static_args)

        if self.in_shardings is None:
            arg_specs: list[Any] = [None] * n_args
        else:
            rules = self._per_arg(self.in_shardings, dyn_args, "in_shardings")
            arg_specs = match_shardings_flat(
                rules, dyn_args, mesh, what="in_shardings", paths=paths[:n_args]
            )
        in_shardings = arg_specs + [None] * n_kwargs
        args_treedef = jax.tree_util.tree_structure(dyn_args)
        arg_shardings = jax.tree_util.tree_unflatten(args_treedef, in_shardings[:n_args])

        flat = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        expected = tuple(_shape_dtype(x) for x in flat)
        in_place = in_place_for((dyn_args, dyn_kwargs),
                                self._donated_leaves(dyn_args, dyn_kwargs, static_args),
                                self._arg_names(dyn_args, static_args))
        # A call with positional dynamic arguments only (the usual train step) gets a jax.jit
        # over those arguments themselves, so later calls go straight to its C++ dispatch;
        # static or keyword arguments need the flat form (jax.jit refuses keyword arguments
        # next to in_shardings).
        positional = not dyn_kwargs and not static_args and not static_kwargs
        if positional:
            body = self._positional_body(helper, args_treedef, expected, in_place)
            abstract = jax.tree_util.tree_unflatten(args_treedef, _abstract(flat))
            jit_in, donate = arg_shardings, tuple(i for i in sorted(self.donate_argnums)
                                                  if 0 <= i < len(dyn_args))
        else:
            body = self._body(helper, static_args, static_kwargs, treedef, expected, in_place)
            abstract = _abstract(flat)
            jit_in, donate = tuple(in_shardings), self._donated_leaves(dyn_args, dyn_kwargs,
                                                                       static_args)
        out_shardings = None
        if self.out_shardings is not None or in_place is not None:
            # Traced as the call and `lower` trace it (same function, input shardings and
            # donation, no ambient mesh), so jit's trace cache serves the jax.jit below: the
            # step is traced once. This trace also tells in_place which Variables the
            # function updates.
            sharded = _abstract(flat, in_shardings)  # as `lower` and the call pass them
            if positional:
                sharded = jax.tree_util.tree_unflatten(args_treedef, sharded)
            out_shape = jax.jit(body, in_shardings=jit_in, donate_argnums=donate,
                                **self.jit_kwargs).trace(*sharded).out_info
            if in_place is not None and in_place.sources:
                out_shape = out_shape[0]
            else:
                in_place = None  # reads its NNX arguments, or returns new ones: nothing to do
        checked = [(self.in_shardings, dyn_args, arg_specs, paths[:n_args])]
        if self.out_shardings is not None:
            out_flat = match_shardings_flat(self.out_shardings, out_shape, mesh,
                                            what="out_shardings")
            out_shardings = jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(out_shape), out_flat)
            checked.append((self.out_shardings, out_shape, out_flat, _output_paths(out_shape)))
        if self.warn_replicated_bytes is not None and not self._warned:
            self._warned = warn_replicated(getattr(self.fun, "__qualname__", repr(self.fun)),
                                           mesh, self.warn_replicated_bytes, checked)
        jit_out = out_shardings
        if in_place is not None:  # an updated Variable keeps the sharding it came in with
            jit_out = (out_shardings, [in_shardings[k] for k, kind, _ in in_place.sources
                                       if kind == "update"])
        named = [s for s in in_shardings + jax.tree_util.tree_leaves(jit_out) if s is not None]
        jitted = jax.jit(body, in_shardings=jit_in, out_shardings=jit_out,
                         donate_argnums=donate, **self.jit_kwargs)
        # With no sharding anywhere, only the ambient mesh can tell a program that names the
        # mesh inside (a constraint, a shard_map) its devices; one that names none runs where
        # jax.jit puts it, as scalax's does (under an outer trace, the outer program decides).
        needs_mesh = not named and (
            any(_compat.is_tracer(x) for x in flat)
            or _compat.uses_mesh(jitted.trace(*abstract).jaxpr)
        )
        return _Signature(jitted, positional, args_treedef, paths, in_shardings, out_shardings,
                          arg_shardings, needs_mesh=needs_mesh, in_place=in_place)

    def _per_arg(self, rules: Any, dyn_args: tuple, what: str) -> Any:
        """Checks that a per-argument rule tuple has one entry per dynamic positional arg."""
        if isinstance(rules, tuple) and len(rules) != len(dyn_args):
            raise ValueError(
                f"{what} has {len(rules)} entries but the function was called with "
                f"{len(dyn_args)} dynamic positional arguments (static ones excluded; keyword "
                f"arguments are never covered by {what})"
            )
        return rules

    def _donated_leaves(self, dyn_args: tuple, dyn_kwargs: dict, static_args: tuple) -> tuple:
        static_nums = {i for i, _ in static_args}
        positions = [i for i in range(len(dyn_args) + len(static_nums)) if i not in static_nums]
        donated, start = [], 0
        for pos, arg in zip(positions, dyn_args):
            count = len(jax.tree_util.tree_leaves(arg))
            if pos in self.donate_argnums:
                donated.extend(range(start, start + count))
            start += count
        for name, value in dyn_kwargs.items():
            count = len(jax.tree_util.tree_leaves(value))
            if name in self.donate_argnames:
                donated.extend(range(start, start + count))
            start += count
        return tuple(donated)

    def _body(self, helper, static_args, static_kwargs, treedef, expected, in_place) -> Callable:
        """The traced function of a signature with static or keyword arguments: the flat
        dynamic leaves in, the user's output out (and the NNX updates, with ``in_place``). It
        refuses arguments of another signature, whose shardings would have to be resolved
        again."""

        def body(*flat):
            if not _same_signature(expected, flat):
                raise _NewSignature
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, flat)
            return self._run(helper, static_args, static_kwargs, dyn_args, dyn_kwargs, in_place)

        body.__name__ = getattr(self.fun, "__name__", "sjit_body")
        return body

    def _positional_body(self, helper, args_treedef, expected, in_place) -> Callable:
        """The traced function of a signature with positional dynamic arguments only; it
        refuses another tree structure or other shapes (checked while tracing only)."""

        def body(*args):
            flat, treedef = jax.tree_util.tree_flatten(args)
            if treedef != args_treedef or not _same_signature(expected, flat):
                raise _NewSignature
            return self._run(helper, (), (), args, {}, in_place)

        body.__name__ = getattr(self.fun, "__name__", "sjit_body")
        return body

    def _run(self, helper, static_args, static_kwargs, dyn_args, dyn_kwargs,
             in_place: InPlace | None = None, wrap_out: bool = True) -> Any:
        """The user's function under its sharding context, entered while it is traced
        (wherever that happens: top level or under another transformation). With
        ``in_place`` and a function that changes NNX Variables in place, returns
        ``(output, updates)``: their new values (see ``InPlace.collect``). With ``wrap_out``,
        static leaves come in wrapped (``shardax.frameworks.equinox``) and go out wrapped."""
        with self._context(helper):
            if self.args_sharding_constraint is not None:
                rules = self._per_arg(self.args_sharding_constraint, dyn_args,
                                      "args_sharding_constraint")
                dyn_args = with_sharding_constraint(dyn_args, rules,
                                                    what="args_sharding_constraint")
            if in_place is not None:
                before, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
            if wrap_out:  # the static leaves of the arguments, as the caller passed them
                dyn_args, dyn_kwargs = static_leaves.unwrap((dyn_args, dyn_kwargs))
            args = list(dyn_args)
            for i, value in static_args:
                args.insert(i, value)
            out = self.fun(*args, **dyn_kwargs, **dict(static_kwargs))
            if wrap_out:  # non-array outputs pass through jax.jit as they are
                out, wrapped = static_leaves.wrap_static(out)
                self._static_out = self._static_out or wrapped
            if in_place is None:
                return out
            name = getattr(self.fun, "__qualname__", repr(self.fun))
            updates = in_place.collect(before, (dyn_args, dyn_kwargs), treedef, out, name)
            # A function that updates nothing in place keeps its own output.
            return (out, updates) if in_place.sources else out

    def _context(self, helper: Any) -> ShardingContext:
        return ShardingContext(helper, self.annotation_shardings, self.logical_axis_rules)

    # ------------------------------------------------------------------ public

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fast = self._fast
        if fast is not None and not kwargs:
            try:
                if fast.mesh is None:
                    out = fast.jitted(*args)
                else:
                    with _compat.set_mesh(fast.mesh):  # refuses under a trace: resolved below
                        out = fast.jitted(*args)
            except (_NewSignature, ValueError, TypeError):
                pass  # new structure, shapes or leaf kinds, or an input on another sharding
            else:
                if fast.in_place is not None:
                    out = fast.in_place.write_back((args, {}), *out)
                return self._outputs(out)
        entry, flat = self._resolve(args, kwargs)
        mesh = self._helper().mesh
        placed = _placed(flat, entry.in_shardings)
        with _compat.mesh_context(mesh) if entry.needs_mesh else contextlib.nullcontext():
            if entry.positional:
                out = entry.jitted(*jax.tree_util.tree_unflatten(entry.args_treedef, placed))
            else:
                out = entry.jitted(*placed)
        if entry.positional and self.mesh_helper is not None and not self.static_argnums \
                and not self.static_argnames and entry.static_leaf is None:
            self._fast = _Fast(entry.jitted, mesh if entry.needs_mesh else None, entry.in_place)
        if entry.in_place is not None:
            _, _, dyn_args, dyn_kwargs = self._split(args, kwargs)
            out = entry.in_place.write_back((dyn_args, dyn_kwargs), *out)
        return self._outputs(out)

    def _outputs(self, out: Any) -> Any:
        """The call's output as the function returned it: static leaves unwrapped."""
        return static_leaves.unwrap(out) if self._static_out else out

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` for these arguments (``.as_text()``, ``.compile()``...).

        Arrays may be replaced by ``jax.ShapeDtypeStruct``s.
        """
        entry, flat = self._resolve(args, kwargs)
        abstract = _abstract(flat, entry.in_shardings)
        if entry.positional:
            abstract = jax.tree_util.tree_unflatten(entry.args_treedef, abstract)
        with _compat.mesh_context(self._helper().mesh) if entry.needs_mesh \
                else contextlib.nullcontext():
            return entry.jitted.lower(*abstract)

    def plan(self, *args: Any, **kwargs: Any) -> ShardingPlan:
        """The ``ShardingPlan``: per-leaf specs and bytes, collectives and memory of the step.

        >>> print(step.plan(state, batch))  # doctest: +SKIP
        """
        entry, _ = self._resolve(args, kwargs)
        compiled = self.lower(*args, **kwargs).compile()
        return ShardingPlan.from_compiled(compiled, entry.in_paths, self._helper().mesh)

    # scalax's SJITCompiledFunction fields: the functions behind __call__, lower and
    # get_jitted_function_by_args.

    @property
    def call_fn(self) -> Callable[..., Any]:
        """Calls the function (scalax's field): the same as calling this object."""
        return self.__call__

    @property
    def lower_fn(self) -> Callable[..., jax.stages.Lowered]:
        """Lowers the function for these arguments (scalax's field): the same as ``lower``."""
        return self.lower

    @property
    def jit_fn_by_static_args_fn(self) -> Callable[..., Any]:
        """The ``jax.jit`` object for these arguments (scalax's field): the same as
        ``get_jitted_function_by_args``."""
        return self.get_jitted_function_by_args

    def get_jitted_function_by_args(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.jit`` object for these arguments' signature (scalax's method).

        It takes the same positional arguments as the sjit function (static ones included),
        has the resolved shardings, enters the sharding context when it traces, and is the same
        object for every call with this signature.
        """
        entry, _ = self._resolve(args, kwargs)
        if entry.static_leaf is not None:
            raise ValueError(
                f"{getattr(self.fun, '__qualname__', self.fun)!r} is called with non-array "
                f"leaves that sjit keeps static (first: {entry.static_leaf!r}), which a jax.jit "
                f"object would trace or refuse; call the sjit function itself"
            )
        if entry.in_place is not None:
            raise ValueError(
                f"{getattr(self.fun, '__qualname__', self.fun)!r} updates NNX Variables of its "
                f"arguments in place, which a jax.jit object cannot write back to the caller's "
                f"objects; call the sjit function itself (it writes them back)"
            )
        if entry.positional:
            return entry.jitted
        if entry.by_args is None:
            helper = self._helper()

            def by_args(*call_args: Any, **call_kwargs: Any) -> Any:
                static_args, static_kwargs, dyn_args, dyn_kwargs = self._split(call_args,
                                                                               call_kwargs)
                return self._run(helper, static_args, static_kwargs, dyn_args, dyn_kwargs,
                                 wrap_out=False)

            entry.by_args = jax.jit(
                functools.wraps(self.fun)(by_args),
                in_shardings=entry.arg_shardings,
                out_shardings=entry.out_shardings,
                static_argnums=self.static_argnums,
                static_argnames=tuple(self.static_argnames),
                donate_argnums=tuple(sorted(self.donate_argnums)),
                **self.jit_kwargs,
            )
        return entry.by_args


SJITCompiledFunction = ShardedFunction  # scalax's name for what sjit returns


def _find_logical_rules(*rule_trees: Any) -> LogicalAxisRules | None:
    """The first ``LogicalAxisRules`` among the rule trees: by default it also maps the
    logical names of activations (``with_logical_constraint``)."""
    for tree in rule_trees:
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardingRule))
        for leaf in leaves:
            if isinstance(leaf, LogicalAxisRules):
                return leaf
    return None


def _output_paths(tree: Any) -> list[str]:
    """``output/...`` paths of an output tree's leaves, as the ``ShardingPlan`` names them."""
    return [_join("output", p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _join(name: str, path: tuple) -> str:
    rest = tree_path_to_string(path, sep="/")
    return f"{name}/{rest}" if rest else name


def _abstract(flat: Sequence[Any], shardings: Sequence[Any] | None = None) -> list:
    """Abstract values of the leaves (keeps tracing free of device transfers).

    With ``shardings``, each leaf is described as the call passes it to ``jax.jit``: a leaf
    with a sharding of its own (a committed array, a ``ShapeDtypeStruct`` with one) on its
    rule's sharding, where the call moves it (so a committed input on another sharding does
    not stop lowering), other leaves without one. The out-shape trace, ``lower`` and the call
    then trace the same abstract values, and jit's trace cache serves all three.
    """
    shardings = shardings or [None] * len(flat)
    return [
        x if isinstance(x, _SCALARS) or _compat.is_tracer(x)
        else jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=_placed_on(x, s),
                                  weak_type=getattr(x, "weak_type", False))
        for x, s in zip(flat, shardings)
    ]


def _placed_on(x: Any, rule: Any) -> Any:
    """The sharding ``x`` reaches ``jax.jit`` on: none if it has none of its own (a NumPy
    array, an uncommitted one), else ``rule``'s, else its own."""
    own = (x.sharding if x.committed else None) if isinstance(x, jax.Array) \
        else getattr(x, "sharding", None)
    return own if own is None or rule is None else rule


def _placed(flat: list, shardings: list) -> list:
    """Moves each committed input that lives on another sharding than the program takes.

    ``jax.jit`` moves uncommitted inputs itself and refuses committed ones; sjit's rules decide
    where a leaf belongs, so it moves those too.
    """
    return [
        jax.device_put(x, s)
        if s is not None and isinstance(x, jax.Array) and not _compat.is_tracer(x)
        and x.committed and not x.sharding.is_equivalent_to(s, x.ndim)
        else x
        for x, s in zip(flat, shardings)
    ]


def sjit(
    fun: Callable[..., Any] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    args_sharding_constraint: Any = None,
    annotation_shardings: dict[str, Any] | None = None,
    *,
    mesh: Any = None,
    logical_axis_rules: LogicalAxisRules | None = None,
    warn_replicated_bytes: float | None = WARN_REPLICATED_BYTES,
    **jit_kwargs: Any,
) -> ShardedFunction | Callable[[Callable[..., Any]], ShardedFunction]:
    """``jax.jit`` with sharding *rules* for inputs, outputs, arguments and annotations.

    Args:
      fun: the single-device function; leave it out to get a decorator.
      in_shardings: a tree prefix of the dynamic positional arguments whose leaves are
        ``ShardingRule``s, ``PartitionSpec``s or None (XLA decides).
      out_shardings: the same for the output, resolved from a trace of the function (the
        ``jax.jit`` it builds reuses that trace: the function is traced once).
      static_argnums: positional arguments that are compile-time constants.
      args_sharding_constraint: rules applied to the dynamic positional arguments as the
        first thing inside the function.
      annotation_shardings: ``{name: rule_or_spec}`` for ``with_sharding_annotation`` calls.
      mesh: the ``MeshShardingHelper``; defaults to the innermost active context's.
      logical_axis_rules: maps the names given to ``with_logical_constraint`` inside the
        function; defaults to the first ``LogicalAxisRules`` among the rules above.
      warn_replicated_bytes: the first time the rules resolve, leaves of at least this many
        bytes that they leave replicated on every device without being asked to (a logical
        name no rule knows, an axis that divides no dimension) give one
        ``shardax.ReplicationWarning`` naming them; None never warns.
      **jit_kwargs: passed to ``jax.jit`` (``static_argnames``, ``donate_argnums``,
        ``donate_argnames``...).

    >>> @partial(mesh.sjit, in_shardings=(FSDPShardingRule(), None))  # doctest: +SKIP
    ... def train_step(state, batch): ...
    """
    options = dict(
        mesh=mesh,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        args_sharding_constraint=args_sharding_constraint,
        annotation_shardings=annotation_shardings,
        logical_axis_rules=logical_axis_rules,
        warn_replicated_bytes=warn_replicated_bytes,
        **jit_kwargs,
    )
    if fun is None:
        return lambda f: ShardedFunction(f, **options)
    return ShardedFunction(fun, **options)
