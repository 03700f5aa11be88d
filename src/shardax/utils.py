"""Pytree paths, dtype helpers and a stateful RNG: ``scalax.utils`` names, scalax semantics.

Paths are what users write regular expressions against: dictionary keys, attribute names and
sequence indices. As in scalax, ``sep=None`` gives a tuple of keys and a string ``sep`` joins
them (shardax itself always passes ``sep="/"``).

>>> flatten_tree({"a": [1, 2]}, sep="/")
{'a/0': 1, 'a/1': 2}
>>> flatten_tree({"a": [1, 2]})
{('a', '0'): 1, ('a', '1'): 2}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "JaxRNG",
    "get_float_dtype_by_name",
    "float_tensor_to_dtype",
    "float_to_dtype",
    "tree_path_to_string",
    "named_tree_map",
    "flatten_tree",
    "print_pytree_structure",
    "leaf_shape",
    "array_nbytes",
    "human_bytes",
]


class JaxRNG:
    """A stateful wrapper around a JAX PRNG key: each call splits off fresh keys.

    ``rng()`` gives one key, ``rng(3)`` a tuple of three, ``rng(("params", "dropout"))`` a dict
    keyed by those names. ``JaxRNG.init_global_rng(seed)`` / ``JaxRNG.next_rng(...)`` keep one
    process-wide generator.

    >>> rng = JaxRNG.from_seed(0)
    >>> sorted(rng(("params", "dropout")))
    ['dropout', 'params']
    """

    global_rng_generator: JaxRNG | None = None

    def __init__(self, rng: jax.Array):
        self.rng = rng

    @classmethod
    def from_seed(cls, seed: int) -> JaxRNG:
        return cls(jax.random.PRNGKey(seed))

    def __call__(self, keys: int | Sequence[str] | None = None) -> Any:
        if keys is None:
            self.rng, split = jax.random.split(self.rng)
            return split
        count = keys if isinstance(keys, int) else len(keys)
        splits = jax.random.split(self.rng, num=count + 1)
        self.rng = splits[0]
        if isinstance(keys, int):
            return tuple(splits[1:])
        return dict(zip(keys, splits[1:]))

    @classmethod
    def init_global_rng(cls, seed: int) -> None:
        cls.global_rng_generator = cls.from_seed(seed)

    @classmethod
    def next_rng(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.global_rng_generator is None:
            raise RuntimeError("the global RNG is not initialized: call JaxRNG.init_global_rng")
        return cls.global_rng_generator(*args, **kwargs)


_FLOAT_DTYPES = {
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "fp16": jnp.float16, "float16": jnp.float16,
    "fp32": jnp.float32, "float32": jnp.float32,
    "fp64": jnp.float64, "float64": jnp.float64,
}


def get_float_dtype_by_name(dtype: str) -> Any:
    """``'bf16'`` / ``'bfloat16'`` (and fp16, fp32, fp64) -> the jnp dtype.

    >>> get_float_dtype_by_name("bf16")
    <class 'jax.numpy.bfloat16'>
    """
    if dtype not in _FLOAT_DTYPES:
        raise KeyError(f"unknown float dtype {dtype!r}; known: {sorted(_FLOAT_DTYPES)}")
    return _FLOAT_DTYPES[dtype]


def float_tensor_to_dtype(tensor: Any, dtype: Any) -> Any:
    """Casts a floating-point array to ``dtype`` (a name or a dtype); other leaves unchanged."""
    if dtype is None or dtype == "":
        return tensor
    if isinstance(dtype, str):
        dtype = get_float_dtype_by_name(dtype)
    if getattr(tensor, "dtype", None) in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64):
        tensor = tensor.astype(dtype)
    return tensor


def float_to_dtype(tree: Any, dtype: Any) -> Any:
    """:func:`float_tensor_to_dtype` over every leaf of ``tree``."""
    return jax.tree_util.tree_map(partial(float_tensor_to_dtype, dtype=dtype), tree)


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


def tree_path_to_string(path: tuple, sep: str | None = None) -> str | tuple[str, ...]:
    """A jax key path as a tuple of key strings, or joined by ``sep``.

    >>> path, _ = jax.tree_util.tree_flatten_with_path({"layer": {"w": 0}})[0][0]
    >>> tree_path_to_string(path, sep="/")
    'layer/w'
    >>> tree_path_to_string(path)
    ('layer', 'w')
    """
    keys = tuple(_key_to_string(k) for k in path)
    return keys if sep is None else sep.join(keys)


def named_tree_map(
    f: Callable[..., Any],
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    sep: str | None = None,
) -> Any:
    """``jax.tree.map`` where ``f`` also receives the leaf's path first.

    >>> named_tree_map(lambda path, x: f"{path}={x}", {"a": 1, "b": {"c": 2}}, sep="/")
    {'a': 'a=1', 'b': {'c': 'b/c=2'}}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x, *r: f(tree_path_to_string(path, sep=sep), x, *r),
        tree,
        *rest,
        is_leaf=is_leaf,
    )


def flatten_tree(
    xs: Any, is_leaf: Callable[[Any], bool] | None = None, sep: str | None = None
) -> dict[Any, Any]:
    """A flat ``{path: leaf}`` dict of the pytree ``xs``.

    >>> flatten_tree({"a": 1, "b": [2, 3]}, sep="/")
    {'a': 1, 'b/0': 2, 'b/1': 3}
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(xs, is_leaf=is_leaf)
    return {tree_path_to_string(path, sep=sep): leaf for path, leaf in leaves}


def print_pytree_structure(
    tree: Any, sep: str = "/", is_leaf: Callable[[Any], bool] | None = None
) -> None:
    """Prints one line per leaf: its path, shape and dtype.

    >>> print_pytree_structure({"w": jnp.zeros((2, 3))})
    w: shape: (2, 3), dtype: float32
    """

    def print_leaf(path: Any, leaf: Any) -> None:
        shape = getattr(leaf, "shape", "none")
        dtype = getattr(leaf, "dtype", "none")
        print(f"{path}: shape: {shape}, dtype: {dtype}")

    named_tree_map(print_leaf, tree, is_leaf=is_leaf, sep=sep)


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """Shape of an array-like leaf (arrays, ShapeDtypeStructs, Python and numpy scalars)."""
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(leaf))


def array_nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (PRNG key dtypes included)."""
    itemsize = getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def human_bytes(n: float) -> str:
    """A byte count as people read it, in binary units up to GiB.

    >>> human_bytes(512), human_bytes(3 * 2**20), human_bytes(5 * 2**40)
    ('512 B', '3.00 MiB', '5120.00 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
