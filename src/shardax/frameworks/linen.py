"""Flax linen: hand shardax's ``LogicalAxisRules`` to linen's own logical-axis machinery.

Parameters need nothing from here: ``LogicalAxisRules`` reads the names that
``nn.with_logical_partitioning`` stores in ``LogicallyPartitioned`` boxes, in ``params``, in a
``flax.training.train_state.TrainState`` and in the optax state built from boxed params alike.

Activations are different: ``nn.with_logical_constraint`` (and the constraint linen applies when
it unboxes a parameter under a mesh) read *Flax's* rule context. Every shardax context whose
``sjit`` has ``LogicalAxisRules`` sets it from those rules (``shardax.context``), so
one rule list decides parameters and activations, as ``with_logical_constraint`` does for NNX.
``logical_axis_rules(rules)`` is the same thing by hand, for code traced outside ``sjit``.

>>> from shardax import LogicalAxisRules, MeshShardingHelper
>>> mesh = MeshShardingHelper([-1, 2], ["fsdp", "tp"]).mesh  # no 'dp' axis
>>> rules = LogicalAxisRules([("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("mlp", "tp")])
>>> axis_rules(rules, mesh)  # then each mesh axis's own name, as LogicalAxisRules reads it
(('batch', 'fsdp'), ('embed', 'fsdp'), ('mlp', 'tp'), ('fsdp', 'fsdp'), ('tp', 'tp'))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from shardax import _context

__all__ = ["axis_rules", "logical_axis_rules"]

FlaxRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def axis_rules(rules: Iterable[tuple[str, Any]], mesh: Any | None = None) -> FlaxRules:
    """``rules`` in Flax's format, without the mesh axes ``mesh`` lacks.

    Flax resolves names the way ``LogicalAxisRules.spec_for`` does (priority order, a mesh axis
    used once per array, later entries as fallbacks) but would pass an absent mesh axis on to
    ``with_sharding_constraint``; shardax drops it. A rule left with no axis is dropped too, so
    the next rule for that name applies. Each mesh axis that no rule names is added last as a
    rule for itself (``LogicalAxisRules`` maps such a name to its axis). ``mesh`` defaults to
    the active one (inside ``sjit`` or ``mesh.get_context()``); with no mesh at all nothing is
    dropped or added.

    >>> axis_rules([("batch", ("dp", "fsdp")), ("mlp", "tp")])  # no mesh: nothing dropped
    (('batch', ('dp', 'fsdp')), ('mlp', 'tp'))
    """
    mesh = mesh if mesh is not None else _context.active().mesh
    present = None if mesh is None else set(mesh.axis_names)
    out = []
    named = set()
    for name, axes in rules:
        named.add(name)
        if axes is None:
            out.append((name, None))
            continue
        kept = (axes,) if isinstance(axes, str) else tuple(axes)
        if present is not None:
            kept = tuple(a for a in kept if a in present)
        if kept:
            out.append((name, kept[0] if len(kept) == 1 else kept))
    # Last, each mesh axis no rule names stands for itself, as in LogicalAxisRules.spec_for.
    out += [(axis, axis) for axis in (mesh.axis_names if mesh is not None else ())
            if axis not in named]
    return tuple(out)


@contextlib.contextmanager
def logical_axis_rules(
    rules: Iterable[tuple[str, Any]], mesh: Any | None = None
) -> Iterator[FlaxRules]:
    """Flax's ``nn.logical_axis_rules`` context, set from shardax rules.

    Enter it around the calls that *trace* a linen model (the first call of an ``sjit``
    function), so ``nn.with_logical_constraint`` inside the model follows the same rules as the
    parameters. Outside any mesh, linen's constraints stay no-ops, so the model still runs on one
    device.

    Example::

        step = mesh.sjit(train_step, in_shardings=(rules, batch_spec), out_shardings=(rules, None))
        with logical_axis_rules(rules, mesh.mesh):
            state, loss = step(state, batch)
    """
    import flax.linen as nn  # only users of linen get here

    flax_rules = axis_rules(rules, mesh)
    with nn.logical_axis_rules(flax_rules):
        yield flax_rules
