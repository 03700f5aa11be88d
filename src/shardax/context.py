"""Entering a sharding context: shardax's active state, JAX's ambient mesh, the frameworks' own.

``mesh.get_context()`` returns one; ``sjit`` enters one while it traces. Inside it
``with_sharding_constraint`` / ``with_sharding_annotation`` take effect, logical names map by its
rules, and bare ``PartitionSpec``s work because JAX's ambient mesh is set (``jax.set_mesh`` at
top level, the abstract mesh under a trace, so a context may be entered inside ``jax.jit``).

>>> import jax
>>> import jax.numpy as jnp
>>> from jax.sharding import PartitionSpec
>>> from shardax import MeshShardingHelper
>>> from shardax.constraints import with_sharding_annotation
>>> mesh = MeshShardingHelper([-1], ["fsdp"])
>>> f = jax.jit(lambda x: with_sharding_annotation(x * 2, "act"))
>>> with mesh.get_context(annotation_shardings={"act": PartitionSpec("fsdp")}):
...     y = f(jnp.ones(8))
>>> y.sharding.spec
P('fsdp',)
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from shardax import _compat, _context
from shardax.frameworks import haliax, linen

__all__ = ["ShardingContext"]


@dataclass(eq=False)
class ShardingContext(_context.Frame):
    """The active mesh helper, its annotation shardings and logical axis rules, as a context
    manager (scalax's ``MeshShardingContext``).

    Entering it also turns off Flax NNX's eager sharding of new variables (inside ``sjit`` the
    output rules place them, so a model written with logical names is created directly in its
    sharded layout) and sets Flax linen's logical-axis rules and Haliax's axis mapping from
    ``logical_axis_rules``.
    """

    _exits: list[contextlib.ExitStack] = field(default_factory=list, repr=False)
    global_contexts = _context.ActiveFrames()  # scalax's class attribute: this thread's stack

    @classmethod
    def get_global_context(cls) -> _context.Frame | None:
        """The innermost active context of this thread, or None (scalax's classmethod)."""
        return _context.active().frame

    def __enter__(self) -> ShardingContext:
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(_compat.mesh_context(self.mesh_helper.mesh))
            for context in _framework_contexts(self.logical_axis_rules, self.mesh_helper.mesh):
                stack.enter_context(context)
            stack.enter_context(_context.pushed(self))
        except BaseException:
            stack.close()
            raise
        self._exits.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exits.pop().__exit__(*exc)


def _framework_contexts(logical_axis_rules: Any, mesh: Any) -> list[Any]:
    """Context managers of the frameworks the user has loaded (looked up, never imported)."""
    contexts: list[Any] = []
    nnx = sys.modules.get("flax.nnx")
    use_eager_sharding = getattr(nnx, "use_eager_sharding", None)
    if use_eager_sharding is not None:
        contexts.append(use_eager_sharding(False))
    if logical_axis_rules is not None and "flax.linen" in sys.modules:
        contexts.append(linen.logical_axis_rules(logical_axis_rules, mesh))
    if logical_axis_rules is not None:
        mapping = haliax.axis_mapping(logical_axis_rules, mesh)  # None without Haliax loaded
        if mapping is not None:
            contexts.append(mapping)
    return contexts
