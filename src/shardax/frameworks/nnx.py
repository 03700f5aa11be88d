"""Flax NNX: in-place updates that a traced function makes to NNX Variables flow back out.

``jax.jit`` passes an ``nnx.Module`` / ``nnx.Optimizer`` as a pytree: the traced function gets
copies, so ``optimizer.update(model, grads)`` inside it changes nothing the caller holds.
``nnx.jit`` returns the changed Variables' values and writes them into the caller's objects;
``InPlace`` does the same for ``sjit``: while tracing, ``collect`` finds the Variable values the
function replaced and returns them as extra outputs (a value the function also returns is taken
from its output, not returned twice); after the call, ``write_back`` puts them into the caller's
Variables with ``Variable.update_from_state``. What cannot be written back this way (a changed
graph structure, a Variable shared by several references and updated through one of them) is an
error, never a silent no-op. Flax is never imported here (see ``shardax.frameworks``).

>>> def step(model, optimizer, x):  # doctest: +SKIP
...     loss, grads = nnx.value_and_grad(loss_fn)(model, x)
...     optimizer.update(model, grads)   # no return value needed
>>> mesh.sjit(step, in_shardings=(rules, rules, PS("fsdp")))(model, optimizer, x)  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax

from shardax.utils import tree_path_to_string

__all__ = ["InPlace", "in_place_for"]


def _variable_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else nnx.Variable


def in_place_for(tree: tuple[tuple, dict], donated: Sequence[int] = (),
                 arg_names: Sequence[str] = ()) -> InPlace | None:
    """An ``InPlace`` for calls whose ``(args, kwargs)`` are shaped like ``tree``, or None when
    they hold no NNX Variable. ``donated`` lists flat leaves whose buffers the call donates:
    when the function updates anything in place, those are written back even when unchanged
    (the caller's copy is gone). ``arg_names`` name
    the positional arguments in error messages."""
    variable = _variable_type()
    if variable is None:
        return None
    mask: list[bool] = []
    for item in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable)):
        mask.extend([isinstance(item, variable)] * len(jax.tree_util.tree_leaves(item)))
    if not any(mask):
        return None
    return InPlace(variable, tuple(mask), frozenset(donated), tuple(arg_names))


class InPlace:
    """Carries one call signature's in-place Variable updates out of the trace and back in.

    ``sources`` is filled while tracing: for each flat leaf (of the arguments) to write back,
    where its new value is, ``("out", i)`` (leaf ``i`` of the function's output) or
    ``("update", j)`` (entry ``j`` of the extra outputs). It stays empty for a function that
    changes nothing in place: such a program has no extra outputs.
    """

    def __init__(self, variable: type, mask: tuple[bool, ...], donated: frozenset[int],
                 arg_names: tuple[str, ...] = ()):
        self._variable = variable
        self.mask = mask
        self.donated = donated
        self.arg_names = arg_names
        self.sources: tuple[tuple[int, str, int], ...] = ()

    def _is_variable(self, x: Any) -> bool:
        return isinstance(x, self._variable)

    def collect(self, before: Sequence[Any], after: Any, treedef: Any, out: Any,
                name: str) -> list[Any]:
        """Inside the trace: the new values to return next to ``out``.

        ``before`` are the argument leaves the function received, ``after`` the argument
        objects once it returned (the same objects, changed in place) and ``treedef`` their
        structure when it was called.
        """
        after_leaves, after_def = jax.tree_util.tree_flatten(after)
        if after_def != treedef:
            raise ValueError(self._structure_error(before, treedef, after, name))
        changed = [self.mask[k] and new is not old
                   for k, (old, new) in enumerate(zip(before, after_leaves))]
        # A donated Variable is written back unchanged too (the caller's buffer is gone), but
        # only by a function that updates in place: a step that returns new objects instead
        # leaves its donated inputs behind, as jax.jit does, and carries no second copy out.
        keep = [c or (any(changed) and self.mask[k] and k in self.donated)
                for k, c in enumerate(changed)]
        out_ids = {id(x): i for i, x in enumerate(jax.tree_util.tree_leaves(out))}
        sources, updates = [], []
        for k, new in enumerate(after_leaves):
            if not keep[k]:
                continue
            if id(new) in out_ids:
                sources.append((k, "out", out_ids[id(new)]))
            else:
                sources.append((k, "update", len(updates)))
                updates.append(new)
        self.sources = tuple(sources)
        return updates

    def _structure_error(self, before: Sequence[Any], treedef: Any, after: Any,
                         name: str) -> str:
        was = set(self._variable_paths(jax.tree_util.tree_unflatten(treedef, before)))
        now = set(self._variable_paths(after))
        changes = [f"added {sorted(now - was)}"] if now - was else []
        changes += [f"removed {sorted(was - now)}"] if was - now else []
        what = "; ".join(changes) or (
            "a Python attribute, a Variable's metadata or a submodule's type changed")
        return (
            f"sjit: {name} changed the structure of its NNX arguments in place ({what}); sjit "
            f"writes back only new Variable values. Make the change outside the sjit function, "
            f"or return the changed object and use the returned one"
        )

    def write_back(self, args: Any, out: Any, updates: Sequence[Any]) -> Any:
        """After the call: puts the new values into the Variables of ``args``; returns ``out``."""
        if not self.sources:
            return out
        out_leaves = jax.tree_util.tree_leaves(out) if any(
            kind == "out" for _, kind, _ in self.sources) else []
        new = {k: out_leaves[i] if kind == "out" else updates[i] for k, kind, i in self.sources}
        items = jax.tree_util.tree_leaves(args, is_leaf=self._is_variable)
        pending, counts, start = [], {}, 0
        for index, item in enumerate(items):
            leaves, vdef = jax.tree_util.tree_flatten(item)
            if self._is_variable(item):
                counts[id(item)] = counts.get(id(item), 0) + 1
                if any(k in new for k in range(start, start + len(leaves))):
                    values = [new.get(start + i, leaf) for i, leaf in enumerate(leaves)]
                    pending.append((index, item, jax.tree_util.tree_unflatten(vdef, values)))
            start += len(leaves)
        if any(counts[id(item)] > 1 for _, item, _ in pending):
            paths = [p for p, _ in
                     jax.tree_util.tree_flatten_with_path(args, is_leaf=self._is_variable)[0]]
            shared = [self._name(paths[i]) for i, item, _ in pending if counts[id(item)] > 1]
            raise ValueError(
                f"sjit: the NNX Variables at {shared} are reachable from several places in the "
                f"arguments and were updated in place; sjit passes NNX objects as pytrees, which "
                f"copy such a Variable once per reference, so its updates cannot be merged. Pass "
                f"each object once (no shared Variables), or return the updated objects"
            )
        for _, item, value in pending:
            item.update_from_state(value)
        return out

    def _name(self, path: tuple) -> str:
        """``(args, kwargs)`` tree path -> ``'model/up/kernel'`` (the parameter name first)."""
        where, key, *rest = path
        head = getattr(key, "key", getattr(key, "idx", key))
        if getattr(where, "idx", None) == 0 and isinstance(head, int) \
                and head < len(self.arg_names):
            head = self.arg_names[head]
        return "/".join([str(head), *([tree_path_to_string(tuple(rest), sep="/")] if rest else [])])

    def _variable_paths(self, tree: Any) -> list[str]:
        return [
            self._name(path)
            for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=self._is_variable)[0]
            if self._is_variable(x)
        ]
