"""Pytree path helpers shared by every module.

Paths are the strings users write regular expressions against, so they are kept plain:
dictionary keys, attribute names and sequence indices joined by ``/``.

>>> flatten_tree({"a": [1, 2]})
{'a/0': 1, 'a/1': 2}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = [
    "tree_path_to_string",
    "named_tree_map",
    "flatten_tree",
    "leaf_shape",
    "array_nbytes",
]


def _key_to_string(key: Any) -> str:
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return str(key.name)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def tree_path_to_string(path: tuple, sep: str | None = None) -> str:
    """Turns a jax key path into a string, keys joined by ``sep`` (default ``/``).

    >>> path, _ = jax.tree_util.tree_flatten_with_path({"layer": {"w": 0}})[0][0]
    >>> tree_path_to_string(path)
    'layer/w'
    """
    return ("/" if sep is None else sep).join(_key_to_string(k) for k in path)


def named_tree_map(
    f: Callable[..., Any],
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    sep: str | None = None,
) -> Any:
    """``jax.tree.map`` where ``f`` also receives the leaf's path string first.

    >>> named_tree_map(lambda path, x: f"{path}={x}", {"a": 1, "b": {"c": 2}})
    {'a': 'a=1', 'b': {'c': 'b/c=2'}}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x, *r: f(tree_path_to_string(path, sep=sep), x, *r),
        tree,
        *rest,
        is_leaf=is_leaf,
    )


def flatten_tree(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None, sep: str | None = None
) -> dict[str, Any]:
    """A flat ``{path: leaf}`` dict of a pytree.

    >>> flatten_tree({"a": 1, "b": [2, 3]})
    {'a': 1, 'b/0': 2, 'b/1': 3}
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {tree_path_to_string(path, sep=sep): leaf for path, leaf in leaves}


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """Shape of an array-like leaf (arrays, ShapeDtypeStructs, Python and numpy scalars)."""
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(leaf))


def array_nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (PRNG key dtypes included)."""
    itemsize = getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize
