"""Mixed precision: which dtype parameters are stored in, computed in, and returned in.

Parameters (and so gradients and optimizer state) stay in ``params`` dtype; the forward pass
runs on a copy cast to ``compute``; results are cast to ``output``. Casting is differentiable,
so gradients arrive in the parameter dtype without extra code.

>>> policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
>>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
dtype(bfloat16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "cast_floating"]

_ALIASES = {
    "f32": "float32", "fp32": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "f16": "float16", "fp16": "float16", "float16": "float16",
    "f64": "float64", "float64": "float64",
}


def _dtype(name: str) -> np.dtype:
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of {sorted(set(_ALIASES.values()))} "
            f"(or the short forms f32, bf16, f16)"
        )
    return jnp.dtype(_ALIASES[key])


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``; others are untouched."""

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy (``params`` / ``compute`` / ``output`` dtypes)."""

    params: np.dtype = jnp.dtype("float32")
    compute: np.dtype = jnp.dtype("float32")
    output: np.dtype = jnp.dtype("float32")

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parses ``"params=float32,compute=bfloat16,output=float32"``.

        A single dtype (``"bfloat16"``) sets compute only; ``"float32"`` is full precision.
        Missing keys keep their defaults (float32).
        """
        spec = str(spec).strip()
        if "=" not in spec:
            return cls(compute=_dtype(spec)) if spec else cls()
        fields: dict[str, np.dtype] = {}
        for part in spec.split(","):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not eq or key not in ("params", "compute", "output"):
                raise ValueError(
                    f"cannot read precision {spec!r}: expected comma-separated "
                    f"params=/compute=/output= dtype pairs, got {part!r}"
                )
            fields[key] = _dtype(value)
        return cls(**fields)

    def __str__(self) -> str:
        return f"params={self.params.name},compute={self.compute.name},output={self.output.name}"

    def cast_to_param(self, tree: Any) -> Any:
        return cast_floating(tree, self.params)

    def cast_to_compute(self, tree: Any) -> Any:
        return cast_floating(tree, self.compute)

    def cast_to_output(self, tree: Any) -> Any:
        return cast_floating(tree, self.output)
