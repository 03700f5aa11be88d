"""The optax optimizers of ``--optimizer`` and their learning-rate schedules.

`make_optimizer` builds ``adamw``, ``lion``, ``adafactor``, ``muon`` or ``sgd`` on the
`make_schedule` learning rate; `defaults` is the one place that says what the schedule and
regularisation flags are when none is given (`shardax.train.config.check` fills them in from
it). `boxed` runs an optimizer whose state does not mirror the parameters on NNX parameters,
keeping their logical names so the rules shard its state.

>>> tx = make_optimizer("adamw", 1e-3, steps=100)  # warm-up 5 steps, cosine to 1e-4
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
import optax.contrib

from shardax import frameworks

__all__ = ["OPTIMIZERS", "boxed", "defaults", "make_optimizer", "make_schedule",
           "muon_dimensions"]


#: ``--optimizer`` names, in the order the docs list them.
OPTIMIZERS = ("adamw", "sgd", "lion", "adafactor", "muon")


def defaults(name: str, steps: int) -> dict[str, Any]:
    """The warm-up, final lr ratio, weight decay and gradient clipping of optimizer ``name``
    over ``steps`` when none is given: for ``sgd`` a constant lr, no decay, no clipping; for
    the others a warm-up over the first twentieth of the steps, a cosine to a tenth of the lr,
    decoupled weight decay 0.01 and the global gradient norm clipped to 1.

    >>> defaults("adamw", 100)
    {'warmup': 5, 'min_lr_ratio': 0.1, 'weight_decay': 0.01, 'clip_grad_norm': 1.0}
    >>> defaults("sgd", 100)
    {'warmup': 0, 'min_lr_ratio': 1.0, 'weight_decay': 0.0, 'clip_grad_norm': 0.0}
    """
    if name == "sgd":
        return {"warmup": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0, "clip_grad_norm": 0.0}
    return {"warmup": steps // 20, "min_lr_ratio": 0.1, "weight_decay": 0.01,
            "clip_grad_norm": 1.0}


def make_schedule(name: str, lr: float, steps: int, warmup: int | None = None, *,
                  min_lr_ratio: float | None = None) -> optax.Schedule:
    """The learning rate ``make_optimizer(name, ...)`` applies at each update (0-based count):
    constant for ``sgd``; else a linear warm-up over ``warmup`` updates that starts above 0
    (update 0 already moves the weights: ``lr / (warmup + 1)``), then cosine decay to
    ``lr * min_lr_ratio`` at ``steps`` (None: the `defaults`).

    >>> round(float(make_schedule("adamw", 1.0, 100, warmup=4)(0)), 6)
    0.2
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")
    if name == "sgd":
        return optax.constant_schedule(lr)
    default = defaults(name, steps)
    warmup = default["warmup"] if warmup is None else warmup
    min_lr_ratio = default["min_lr_ratio"] if min_lr_ratio is None else min_lr_ratio
    warmup = max(warmup, 1)  # the decay needs >= 1 step after the warm-up: --steps 1 works
    return optax.warmup_cosine_decay_schedule(
        lr / (warmup + 1), lr, warmup, max(steps, warmup + 1), end_value=lr * min_lr_ratio
    )


def make_optimizer(
    name: str, lr: float, steps: int, warmup: int | None = None, *,
    min_lr_ratio: float | None = None, weight_decay: float | None = None,
    clip_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """The optax optimizer of ``--optimizer``: ``adamw``, ``lion``, ``adafactor`` or ``muon``
    (Muon on the hidden weight matrices, AdamW on the rest: `muon_dimensions`) on the
    `make_schedule` learning rate, or plain ``sgd`` at a constant ``lr``.
    ``weight_decay`` (decoupled) and ``clip_grad_norm`` (the global gradient norm is clipped
    to it first; 0: off); None: the `defaults`.

    >>> tx = make_optimizer("lion", 1e-4, steps=100, warmup=5, weight_decay=0.1)
    """
    schedule = make_schedule(name, lr, steps, warmup, min_lr_ratio=min_lr_ratio)
    default = defaults(name, steps)
    decay = default["weight_decay"] if weight_decay is None else weight_decay
    clip = default["clip_grad_norm"] if clip_grad_norm is None else clip_grad_norm
    if name == "sgd":
        tx = optax.sgd(lr)
        if decay:
            tx = optax.chain(optax.add_decayed_weights(decay), tx)
    elif name == "adamw":
        tx = optax.adamw(schedule, weight_decay=decay)
    elif name == "lion":
        tx = optax.lion(schedule, weight_decay=decay)
    elif name == "adafactor":
        tx = boxed(lambda _: optax.adafactor(schedule, weight_decay_rate=decay or None))
    else:
        tx = boxed(lambda params: optax.contrib.muon(
            schedule, weight_decay=decay, adam_weight_decay=decay,
            muon_weight_dimension_numbers=muon_dimensions(params)))
    return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


def muon_dimensions(params: Any) -> Any:
    """Which parameters Muon updates and how it sees them as matrices, from their logical
    names: a weight with an ``embed`` axis at one end and other model axes at the other (an
    attention or MLP projection; ``layers``/``experts`` axes are batch axes); None (AdamW)
    for embeddings, the output head (``vocab`` axes), norms and biases.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> w = nnx.Param(jnp.ones((4, 2, 3)), out_sharding=("embed", "heads", "head_dim"),
    ...               eager_sharding=False)
    >>> muon_dimensions({"wq": w})["wq"]
    MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2))
    """
    def dims(leaf):
        names = frameworks.logical_names(leaf)
        if names is None or "vocab" in names:
            return None
        axes = [i for i, n in enumerate(names) if n not in _BATCH_AXES]
        if len(axes) < 2 or "embed" not in (names[axes[0]], names[axes[-1]]):
            return None
        if names[axes[0]] == "embed":
            return optax.contrib.MuonDimensionNumbers((axes[0],), tuple(axes[1:]))
        return optax.contrib.MuonDimensionNumbers(tuple(axes[:-1]), (axes[-1],))

    return jax.tree.map(dims, params, is_leaf=frameworks.is_box)


# Axes of a parameter that Muon treats as a batch of matrices.
_BATCH_AXES = ("layers", "experts")


def boxed(make: Callable[[Any], optax.GradientTransformation]
          ) -> optax.GradientTransformation:
    """The optimizer ``make(params)`` (``params``: the boxed parameters, or gradients, whose
    names it may read) run on the bare arrays of NNX parameters, with each leaf of its state that
    belongs to a parameter (by tree path) re-boxed with that parameter's logical names, so the
    rules shard it like the parameter: the same shape keeps all names, a factored statistic
    (a dimension dropped, Adafactor's ``v_row``/``v_col``) keeps the others; any other leaf is
    a bare (replicated) array. For optimizers whose state leaves do not all have their
    parameter's shape (``adafactor``, ``muon``): those break the names' one-per-dimension rule
    otherwise.

    >>> tx = boxed(lambda params: optax.adafactor(1e-3))
    """
    def bare(tree):
        return jax.tree.map(frameworks.unbox, tree, is_leaf=frameworks.is_box)

    def rebox(state, params):
        boxes = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(
                params, is_leaf=frameworks.is_box)[0]:
            if frameworks.is_box(leaf):
                boxes[tuple(map(str, path))] = leaf

        def one(path, x):
            keys = tuple(map(str, path))
            for n in range(len(keys), 0, -1):
                box = boxes.get(keys[-n:])
                if box is not None:
                    return _like(box, x)
            return x

        return jax.tree_util.tree_map_with_path(one, state)

    def init(params):
        return rebox(make(params).init(bare(params)), params)

    def update(updates, state, params=None):
        new, state = make(updates).update(bare(updates), bare(state), bare(params))
        leaves = jax.tree.leaves(new)
        return (jax.tree.unflatten(jax.tree.structure(updates), leaves),
                rebox(state, updates))

    return optax.GradientTransformation(init, update)


def _like(box: Any, x: Any) -> Any:
    """``x`` in a box like ``box`` (a parameter), with its logical names where ``x`` has the
    parameter's shape or lacks one of its dimensions; ``x`` itself otherwise."""
    names = frameworks.logical_names(box)
    shape = tuple(frameworks.unbox(box).shape)
    xs = tuple(getattr(x, "shape", ()))
    if names is None or len(xs) == 0:
        return x
    if xs != shape:
        drops = [i for i in range(len(shape)) if shape[:i] + shape[i + 1:] == xs]
        if not drops:
            return x
        names = names[:drops[0]] + names[drops[0] + 1:]
    return box.replace(x, out_sharding=tuple(names))
