"""What is active now (mesh, mesh helper, logical rules): thread-local state and its one accessor.

One stack of active sharding contexts (mesh helper, annotation shardings, logical axis rules),
one stack of logical rules pushed by hand (``use_logical_rules``), and the mesh rules are being
resolved against. Every reader goes through ``active()``; nothing keeps a copy. JAX's own ambient
mesh is read through ``_compat`` (the one module below this one), so every other module may
import this one.

>>> active().mesh_helper is None   # outside any ``sjit`` / ``mesh.get_context()``
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardax import _compat

__all__ = [
    "Frame",
    "ActiveFrames",
    "Active",
    "active",
    "pushed",
    "pushed_logical_rules",
    "resolving_on",
]


@dataclass(eq=False)
class Frame:
    """One active sharding context: the mesh helper, named annotation shardings and logical
    axis rules in force, and the annotation names already warned about."""

    mesh_helper: Any
    annotation_shardings: Mapping[str, Any] | None = None
    logical_axis_rules: Any = None
    warned_annotations: set[str] = field(default_factory=set)


class _State(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.logical_rules: list[Any] = []
        self.resolving_mesh: Any = None


_STATE = _State()


class ActiveFrames:
    """A class attribute that reads this thread's active contexts, innermost last."""

    def __get__(self, instance: Any, owner: Any) -> list[Frame]:
        return list(_STATE.frames)


class Active:
    """A view of what is active in this thread now; each attribute is read when asked for.

    Attributes:
      frame: the innermost active context (``sjit`` / ``mesh.get_context()``), or None.
      mesh_helper: its ``MeshShardingHelper``, or None.
      annotation_shardings: its ``annotation_shardings``, or None.
      logical_rules: the logical axis rules in force: pushed by ``use_logical_rules``, else
        the context's, else None.
      mesh: the mesh rules consult: the one being matched against, else the context's, else
        JAX's ambient one (``jax.set_mesh``), else None.
      abstract_mesh: JAX's ambient abstract mesh (what a trace sees, manual ``shard_map``
        axes included), or None.
    """

    __slots__ = ()

    @property
    def frame(self) -> Frame | None:
        frames = _STATE.frames
        return frames[-1] if frames else None

    @property
    def mesh_helper(self) -> Any:
        frame = self.frame
        return None if frame is None else frame.mesh_helper

    @property
    def annotation_shardings(self) -> Mapping[str, Any] | None:
        frame = self.frame
        return None if frame is None else frame.annotation_shardings

    @property
    def logical_rules(self) -> Any:
        if _STATE.logical_rules:
            return _STATE.logical_rules[-1]
        frame = self.frame
        return None if frame is None else frame.logical_axis_rules

    @property
    def mesh(self) -> Any:
        if _STATE.resolving_mesh is not None:
            return _STATE.resolving_mesh
        helper = self.mesh_helper
        return helper.mesh if helper is not None else _compat.abstract_mesh()

    @property
    def abstract_mesh(self) -> Any:
        return _compat.abstract_mesh()


_ACTIVE = Active()


def active() -> Active:
    """What is active in this thread now (see ``Active``).

    >>> with mesh.get_context():  # doctest: +SKIP
    ...     assert active().mesh is mesh.mesh
    """
    return _ACTIVE


def pushed(frame: Frame) -> contextlib.AbstractContextManager[Frame]:
    """Makes ``frame`` the innermost active context for the ``with`` block."""
    return _pushed_on(_STATE.frames, frame)


def pushed_logical_rules(rules: Any) -> contextlib.AbstractContextManager[Any]:
    """Makes ``rules`` the logical axis rules in force for the ``with`` block."""
    return _pushed_on(_STATE.logical_rules, rules)


@contextlib.contextmanager
def _pushed_on(stack: list, item: Any) -> Iterator[Any]:
    stack.append(item)
    try:
        yield item
    finally:
        stack.pop()


@contextlib.contextmanager
def resolving_on(mesh: Any) -> Iterator[None]:
    """Makes ``mesh`` the one rules consult (axis sizes, axis names) while matching."""
    previous = _STATE.resolving_mesh
    _STATE.resolving_mesh = mesh
    try:
        yield
    finally:
        _STATE.resolving_mesh = previous
