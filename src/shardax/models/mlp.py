"""A plain MLP classifier/regressor in Flax NNX with logical axis names on every parameter.

Hidden kernels alternate ('embed', 'mlp') and ('mlp', 'embed') as in Megatron-style tensor
parallelism (column- then row-split), so no kernel names one logical axis twice.

Example::

    model = MLP(din=784, dhidden=256, dout=10, depth=2, rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((32, 784)))   # [32, 10]
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._annotate import constrain
from shardax.models._layers import param


class Dense(nnx.Module):
    """``x @ w + b`` whose kernel dims are named ``names`` (and bias ``names[1:]``)."""

    def __init__(self, din: int, dout: int, names: tuple[str | None, str | None],
                 rngs: nnx.Rngs):
        self.w = param(rngs.params(), nnx.initializers.lecun_normal(), (din, dout), names)
        self.b = param(rngs.params(), nnx.initializers.zeros, (dout,), names[1:])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...] + self.b[...]


class MLP(nnx.Module):
    """``depth`` hidden layers of width ``dhidden`` then a linear head of width ``dout``.

    Returns unnormalised outputs [batch, dout] (logits for a classifier, values for a regressor).
    """

    def __init__(self, din: int, dhidden: int, dout: int, depth: int, rngs: nnx.Rngs,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu):
        if depth < 1:
            raise ValueError(f"depth must be >= 1 hidden layer, got {depth}")
        self.activation = activation
        names, layers, width = ("embed", "mlp"), [], din
        for _ in range(depth):
            layers.append(Dense(width, dhidden, names, rngs))
            width, names = dhidden, names[::-1]
        self.hidden = nnx.List(layers)
        self.head = Dense(dhidden, dout, (names[0], None), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(jnp.asarray(x), ("batch", "embed"))
        for layer in self.hidden:
            x = self.activation(layer(x))
            x = constrain(x, ("batch", layer.w.get_metadata("out_sharding")[1]))
        return self.head(x)
