"""The thread-local state every shardax module reads: what is active now.

One stack of active sharding contexts (mesh helper, annotation shardings, logical axis rules),
one stack of logical rules pushed by hand (``use_logical_rules``), and the mesh rules are being
resolved against. Everything above reads it through the accessors here; nothing keeps a copy.
This module imports nothing from shardax, so every other module may import it.

>>> current() is None   # outside any ``sjit`` / ``mesh.get_context()``
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Frame",
    "ActiveFrames",
    "current",
    "pushed",
    "logical_rules",
    "pushed_logical_rules",
    "resolving_mesh",
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


def current() -> Frame | None:
    """The innermost active context of this thread, or None."""
    frames = _STATE.frames
    return frames[-1] if frames else None


def pushed(frame: Frame) -> contextlib.AbstractContextManager[Frame]:
    """Makes ``frame`` the innermost active context for the ``with`` block."""
    return _pushed_on(_STATE.frames, frame)


def logical_rules() -> Any:
    """The logical axis rules in force: pushed by hand, else the active context's, else None."""
    if _STATE.logical_rules:
        return _STATE.logical_rules[-1]
    frame = current()
    return None if frame is None else frame.logical_axis_rules


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


def resolving_mesh() -> Any:
    """The mesh rules are being matched against right now, or None."""
    return _STATE.resolving_mesh


@contextlib.contextmanager
def resolving_on(mesh: Any) -> Iterator[None]:
    """Makes ``mesh`` the one rules consult (axis sizes, axis names) while matching."""
    previous = _STATE.resolving_mesh
    _STATE.resolving_mesh = mesh
    try:
        yield
    finally:
        _STATE.resolving_mesh = previous
