"""Equinox: the non-array leaves of a module stay static, as ``eqx.filter_jit`` keeps them.

An Equinox (or Haliax) module is a pytree whose leaves are arrays *and* Python values: a
``Dropout``'s ``inference`` flag, an activation function, sizes. ``jax.jit`` would trace the
numbers into 0-d arrays (so ``if self.inference`` fails) and refuse the functions; ``sjit``
instead keeps them as compile-time constants: every leaf that is not an array is static when it
is not a Python number, and Python numbers are static inside an ``eqx.Module`` (outside one they
are traced, as ``jax.jit`` traces them). A static leaf travels as a ``Static`` node, a pytree
node with no children whose value sits in the tree structure, so it is part of the call
signature (a new value compiles anew) and comes back out of the call as the same Python object.
Equinox is never imported here (see ``shardax.frameworks``).

>>> import numpy as np
>>> tree = {"fn": abs, "x": np.ones(2), "n": 3}
>>> static_mask(tree)   # leaves in key order: fn, n, x
(True, False, False)
>>> wrapped = wrap(tree, static_mask(tree))
>>> jax.tree_util.tree_leaves(wrapped)
[3, array([1., 1.])]
>>> unwrap(wrapped)["fn"] is abs
True
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["Static", "static_mask", "wrap", "unwrap", "wrap_static"]

_NUMBERS = (bool, int, float, complex)


def _module_type() -> type | None:
    eqx = sys.modules.get("equinox")
    return None if eqx is None else eqx.Module


def _is_array(x: Any) -> bool:
    """Arrays of any kind: JAX and NumPy arrays and scalars, tracers, ``ShapeDtypeStruct``s."""
    return not isinstance(x, _NUMBERS) and hasattr(x, "shape") and hasattr(x, "dtype")


@jax.tree_util.register_pytree_node_class
class Static:
    """A leaf kept static: a pytree node with no children that carries ``value`` in its
    structure. Equal (and hashed) by type and value, so ``True`` and ``1`` differ."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple, Static]:
        return (), self

    @classmethod
    def tree_unflatten(cls, aux: Static, children: Any) -> Static:
        return aux

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Static) or type(self.value) is not type(other.value):
            return False
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - a value whose == is not a bool
            return self.value is other.value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def static_mask(tree: Any) -> tuple[bool, ...] | None:
    """For each leaf of ``tree`` (``jax.tree_util.tree_leaves`` order): whether it stays
    static; None when no leaf does (the common case, found in one pass)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(_is_array(x) for x in leaves):
        return None
    module = _module_type()
    if module is None or not any(isinstance(x, _NUMBERS) for x in leaves):
        in_module = [False] * len(leaves)
    else:
        in_module = []
        for item in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, module)):
            inside = isinstance(item, module)
            in_module.extend([inside] * (len(jax.tree_util.tree_leaves(item)) if inside else 1))
    mask = tuple(not _is_array(x) and (inside or not isinstance(x, _NUMBERS))
                 for x, inside in zip(leaves, in_module))
    return mask if any(mask) else None


def wrap(tree: Any, mask: Sequence[bool]) -> Any:
    """``tree`` with each leaf that ``mask`` marks replaced by a ``Static`` node."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [Static(x) if m else x for x, m in zip(leaves, mask)])


def _is_static(x: Any) -> bool:
    return isinstance(x, Static)


def unwrap(tree: Any) -> Any:
    """``tree`` with every ``Static`` node replaced by its value (``tree`` itself, rebuilt
    nowhere, when it has none)."""
    if not any(_is_static(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_static)):
        return tree
    return jax.tree_util.tree_map(lambda x: x.value if _is_static(x) else x, tree,
                                  is_leaf=_is_static)


def wrap_static(tree: Any) -> tuple[Any, bool]:
    """A function's output with its static leaves wrapped (so ``jax.jit`` passes them through
    as they are), and whether there were any."""
    mask = static_mask(tree)
    return (tree, False) if mask is None else (wrap(tree, mask), True)
