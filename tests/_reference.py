"""The one-device reference of the suite's sharded tests, and its one rule for "these
parameters trained like it".

`train_one_device` is the reference run (`train_step` jitted with no mesh on one device) and
`init_train_state` the state it starts from; every sharded training test builds on them.

Every test that compares parameters after optimizer steps (a sharded run against the same
steps on one device) calls `assert_trained_alike`; its tolerance is stated here and nowhere
else. It compares the parameter *updates* (``u = got - start`` against ``w = want - start``),
leaf by leaf, against the size of the reference update, plus the rounding floor of storing the
parameters: that is what the sharded program can get wrong, and what float32 noise scales with.

- Rounding floor: each step stores the parameters in their dtype, rounding each element by at
  most half an ulp, ``eps * |p| / 2``; over ``steps`` steps in two runs the updates can differ
  by ``steps * eps * max|p|`` with nothing else wrong (an update 1e-4 times smaller than its
  parameter is all rounding).
- ``"sgd"`` (any update linear in the gradient): the update is ``-lr * sum(grads)``. A sharded
  gradient is the same float32 math summed in another order; reassociating a sum moves it by
  about ``n * eps * sum(|terms|)``, relative to the leaf's gradient scale, not to each element
  (an element whose gradient is a near-cancelling sum may differ by 100% of itself). So,
  elementwise: ``max|u - w| <= SGD_RTOL * max|w| + floor``.
- ``"adam"`` (Adam, AdamW, any per-element normalised update): an element's step is
  ``lr * m / (sqrt(v) + eps)``, normalised by its own gradient history, so an element whose
  gradient is at float32 noise level steps by up to ``lr`` with a size and sign set by that
  noise: no elementwise bound holds (one element in 22,528 once ended 1.4e-5 apart at lr 3e-3,
  over an elementwise atol of 1e-5). Such elements are few and every other element moves as
  under SGD, so the bound holds on the leaf's l2 norm: ``||u - w|| <= ADAM_RTOL * ||w|| +
  floor``. A wrong gradient, a missing reduction or a skipped shard changes most elements of a
  leaf and misses this by orders of magnitude.

Losses are compared by each test at its own ``rtol`` (a scalar mean: no per-element noise).
Exact equality, where the math allows it, stays `np.testing.assert_array_equal`.

>>> start = {"w": np.zeros(3, np.float32)}
>>> assert_trained_alike({"w": np.ones(3)}, {"w": np.ones(3) + 1e-7}, start, steps=1,
...                      optimizer="sgd")
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax import models
from shardax.layout import Layout
from shardax.models._layers import token_nll
from shardax.train.step import init_state, train_step


def dense(din: int, dout: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    """An ``nnx.Linear`` as the Flax sharding guide writes it: logical names, eager sharding
    left at its default (on)."""
    init = nnx.initializers.lecun_normal()
    return nnx.Linear(din, dout, kernel_init=nnx.with_partitioning(init, names),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:]),
                      rngs=rngs)


class GuideMLP(nnx.Module):
    """The Flax NNX sharding guide's two-layer MLP (32 -> 64 -> 32)."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = dense(32, 64, ("embed", "mlp"), rngs)
        self.down = dense(64, 32, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


SGD_RTOL = 1e-4  # float32 reassociation (~1e-7 per add) through a few steps: 1000x margin
ADAM_RTOL = 1e-3  # the same, plus a few noise-level elements stepping up to lr apart


def assert_trained_alike(got: Any, want: Any, start: Any, *, steps: int, optimizer: str,
                         err_msg: str = "") -> None:
    """Asserts that ``got`` (a pytree of parameters after ``steps`` optimizer steps from
    ``start``) took the same steps as ``want`` (the one-device reference from the same
    ``start``), within the module docstring's tolerance for ``optimizer`` ('sgd' or 'adam').
    Fails too when the reference did not move (the comparison could not fail then)."""
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    got, want, start = (jax.device_get(t) for t in (got, want, start))
    assert jax.tree.structure(got) == jax.tree.structure(want), err_msg
    moved = False
    for (path, w), g, s in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                               jax.tree.leaves(start), strict=True):
        where = f"{err_msg}{jax.tree_util.keystr(path)}"
        assert np.shape(g) == np.shape(w) == np.shape(s), (where, np.shape(g), np.shape(w))
        eps = float(np.finfo(np.asarray(s).dtype).eps)
        g, w, s = (np.asarray(x, np.float64) for x in (g, w, s))
        u, v = g - s, w - s
        if optimizer == "sgd":
            norm, rtol = (lambda x: np.max(np.abs(x), initial=0.0)), SGD_RTOL
        else:
            norm, rtol = np.linalg.norm, ADAM_RTOL
        error, size = norm(u - v), norm(v)
        bound = rtol * size + steps * eps * max(norm(s), norm(w))
        assert error <= bound, (
            f"{where}: the update differs from the reference's by {error:.3g}, over {bound:.3g} "
            f"({optimizer}: {rtol:g} x its size {size:.3g}, + {steps} ulps of the parameter)")
        moved = moved or size > 0
    assert moved, f"{err_msg}the reference did not move: this comparison could not fail"


# The tiny `shardax train` run of the suite: llama-tiny (the default model), 8 x 32 tokens,
# plain SGD with a step large enough that a wrong gradient shows in the next losses, every
# step logged, no evaluation (each run would compile an eval step; files that check
# ``val_loss`` set ``eval_every``), a checkpoint every 2 steps. Files change what they test
# (``{**TINY_TRAIN, "steps": 6}``), nothing else.
TINY_TRAIN = dict(steps=4, batch_size=8, seq_len=32, lr=0.03, optimizer="sgd", log_every=1,
                  eval_every=0, ckpt_every=2)


def init_train_state(model_config: Any, tx: Any, *, seed: int = 0, abstract: bool = False
                     ) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, state)`` of `init_state` for ``models.create(model_config,
    nnx.Rngs(seed))`` in one compiled call (eager init compiles every initializer apart);
    ``abstract``: shapes only, nothing compiled."""
    graphdefs = []

    def state_only():
        graphdef, state = init_state(lambda: models.create(model_config, nnx.Rngs(seed)), tx)
        graphdefs.append(graphdef)  # static structure, no tracers
        return state

    state = jax.eval_shape(state_only) if abstract else jax.jit(state_only)()
    return graphdefs[0], state


class OneDeviceRun(NamedTuple):
    losses: list[float]
    start: Any  # the parameters before the first step (host arrays)
    state: Any  # the train state after the last step (host arrays)
    before_last: Any = None  # the train state before the last step (host arrays)


def train_one_device(model_config: Any, tx: Any, batches: Any, *, seed: int = 0,
                     scan_layers: bool = False, **step_options: Any) -> OneDeviceRun:
    """The reference of every sharded training test: `train_step` (with ``step_options``)
    jitted without a mesh on ``jax.devices()[0]``, where every `shardax.parallel` block falls
    back to single-device math, over ``batches`` (``(inputs, targets)`` pairs); the layers
    scanned with ``scan_layers`` (without a ``layout`` option: one that scans)."""
    if scan_layers and "layout" not in step_options:
        step_options["layout"] = Layout(scan_layers=True)
    with jax.default_device(jax.devices()[0]):
        graphdef, state = init_train_state(model_config, tx, seed=seed)
        start = jax.device_get(state.params)
        step = jax.jit(partial(train_step, graphdef=graphdef, tx=tx, **step_options))
        losses = []
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:
                before_last = jax.device_get(state)
            state, metrics = step(state, tuple(jnp.asarray(x) for x in batch))
            losses.append(float(metrics["loss"]))
    return OneDeviceRun(losses, start, jax.device_get(state), before_last)


def documents_alone_loss(params: Any, rest: Any, graphdef: Any, docs: list, length: int
                         ) -> jax.Array:
    """The reference for packed rows: the mean cross-entropy over the kept targets of documents
    each run alone from position 0. ``docs``: ``(inputs, targets, keep)`` numpy rows, each at
    most ``length`` long. They run as one batch, right-padded: under causal attention a token
    never sees the padding after it, so each row is its document alone."""
    inputs = np.ones((len(docs), length), np.int32)
    targets = np.ones((len(docs), length), np.int32)
    keep = np.zeros((len(docs), length), bool)
    for i, (x, y, k) in enumerate(docs):
        inputs[i, :len(x)], targets[i, :len(y)], keep[i, :len(k)] = x, y, k
    nll = token_nll(nnx.merge(graphdef, params, rest)(jnp.asarray(inputs)), jnp.asarray(targets))
    return jnp.sum(jnp.where(keep, nll, 0.0)) / keep.sum()
