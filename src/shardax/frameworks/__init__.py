"""What the sharding rules need to know about each framework's parameter boxes.

Flax NNX keeps parameters in ``nnx.Variable`` objects and Flax linen in ``Partitioned`` /
``LogicallyPartitioned`` boxes; both carry logical axis names as metadata. A Haliax ``NamedArray``
is a box too: its logical names are its ``axis_names``. Rules treat such a box as one leaf: its
shape is the shape of the value inside and its logical names come from the metadata. No
framework is imported here: if the user's tree holds Flax or Haliax objects, that framework is
already loaded, so looking it up in ``sys.modules`` costs nothing and keeps plain-JAX users free
of it.
"""

from __future__ import annotations

import sys
from typing import Any

from shardax.frameworks.haliax import named_array_type

__all__ = ["is_box", "unbox", "logical_names"]

# Metadata keys under which Flax NNX has stored logical axis names, newest first.
_NNX_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def _box_types() -> tuple[type, ...]:
    types: list[type] = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        types.append(nnx.Variable)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None:
        types.append(meta.Partitioned)  # LogicallyPartitioned subclasses it
    named_array = named_array_type()
    if named_array is not None:
        types.append(named_array)
    return tuple(types)


def _is_named_array(x: Any) -> bool:
    named_array = named_array_type()
    return named_array is not None and isinstance(x, named_array)


def is_box(x: Any) -> bool:
    """True for a framework's parameter box (an NNX Variable, a linen Partitioned, a Haliax
    NamedArray)."""
    types = _box_types()
    return bool(types) and isinstance(x, types)


def unbox(x: Any) -> Any:
    """The array inside a box; anything else is returned as is."""
    if not is_box(x):
        return x
    if _is_named_array(x):
        return x.array
    get_value = getattr(x, "get_value", None)
    return get_value() if callable(get_value) else x.value


def logical_names(x: Any) -> tuple[str | None, ...] | None:
    """The logical axis names a box carries, or None when it carries none.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> param = nnx.Param(jnp.ones((2, 3)), out_sharding=("embed", "mlp"), eager_sharding=False)
    >>> logical_names(param)
    ('embed', 'mlp')
    """
    if not is_box(x):
        return None
    if _is_named_array(x):
        return tuple(x.axis_names)
    names = getattr(x, "names", None)  # linen Partitioned
    if names is not None:
        return tuple(names)
    get_metadata = getattr(x, "get_metadata", None)
    metadata = get_metadata() if callable(get_metadata) else {}
    for key in _NNX_NAME_KEYS:
        names = metadata.get(key)
        if isinstance(names, (tuple, list)):
            return tuple(names)
    return None
