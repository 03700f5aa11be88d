"""LoRA adapters on a model's weight parameters: ``W + (alpha / rank) * A @ B``, base frozen.

`add_lora` replaces each parameter whose path matches ``targets`` (a regular expression over
'/'-joined paths such as ``layers/0/attn/wq``) by a `LoRAWeight`: the frozen base (an
``nnx.Param``) and two ``nnx.LoRAParam`` factors, ``lora_a`` [in..., rank] (uniform in
±1/sqrt(fan-in), as PEFT's Kaiming init) and ``lora_b`` [rank, out...] (zeros, so the model is
unchanged at step 0). The model's code reads a weight as ``self.w[...]``, which a
`LoRAWeight` answers with the merged weight, so every layout runs unchanged; the factors
carry the base's logical axis names on their own dims (None on the rank), so the same rules
shard them. A weight's input dims are its
first dim when that is 'embed' (q/k/v, gate/up) or unnamed (DeepSeek's latent attention
``wq_b``/``wkv_b`` read the rank-``q/kv_lora_rank`` latent), else all but its last (o, down);
the default targets include MLA's low-rank projections (``wq_a``, ``wq_b``, ``wkv_a``,
``wkv_b``); the stacked expert weights of a mixture of experts are left frozen. Training
differentiates only ``nnx.LoRAParam`` (`trainable`): the base gets no gradient and no
optimizer state. `merge_lora` folds the adapters back into plain parameters (export,
generation).

Example::

    model = models.create(dataclasses.replace(cfg, lora=LoRA(rank=8, alpha=16)), nnx.Rngs(0))
    graphdef, adapters, rest = nnx.split(model, trainable(model.config), ...)
    merge_lora(model)                  # plain parameters again, W + (alpha / rank) A @ B
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["DEFAULT_TARGETS", "LoRA", "LoRAError", "LoRAWeight", "add_lora", "lora_weights",
           "merge_lora", "trainable"]

#: attention and MLP projections of the Llama and GPT-2 models
DEFAULT_TARGETS = r"attn/w([qkvo]|q_a|q_b|kv_a|kv_b)$|mlp/w_(gate|up|down|fc|proj)$"


class LoRAError(ValueError):
    """LoRA settings that do not fit the model; ``setting`` is ``'rank'`` or ``'targets'``."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


@dataclasses.dataclass(frozen=True)
class LoRA:
    """LoRA settings of a model config (``config.lora``): ``rank``, ``alpha`` (the update is
    scaled by ``alpha / rank``) and ``targets``, a regular expression over parameter paths."""

    rank: int
    alpha: float = 16.0
    targets: str = DEFAULT_TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ValueError(f"LoRA targets {self.targets!r}: not a regular expression "
                             f"({e})") from None


class LoRAWeight(nnx.Module):
    """A frozen weight with a low-rank update; ``self[...]`` is the merged weight.

    ``stacked``: the base has a leading 'layers' axis (a layer stack); the factors get it too,
    and ``key`` holds one key per layer (layer ``i``'s factor is what a lone layer's adapter
    draws from ``key[i]``).
    """

    def __init__(self, base: nnx.Param, n_in: int, settings: LoRA, key: jax.Array,
                 stacked: bool = False):
        names = tuple(base.get_metadata().get("out_sharding") or (None,) * base.ndim)
        lead = int(stacked)
        shape = base.shape
        ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
        r = settings.rank
        bound = 1.0 / math.sqrt(math.prod(ins))

        def uniform(key, shape, dtype):
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        def make(init, shape, axes):
            if stacked:
                one = init
                init = lambda keys, shape, dtype: jax.vmap(  # noqa: E731
                    lambda k: one(k, shape[1:], dtype))(keys)
            init = nnx.with_partitioning(init, axes, eager_sharding=False)
            return nnx.LoRAParam(init(key, shape, base.dtype))

        self.base = base
        self.lora_a = make(uniform, (*shape[:lead], *ins, r), (*names[:lead + n_in], None))
        self.lora_b = make(nnx.initializers.zeros, (*shape[:lead], r, *outs),
                           (*names[:lead], None, *names[lead + n_in:]))
        self.n_in = n_in
        self.scale = settings.alpha / r

    def delta(self) -> jax.Array:
        """``(alpha / rank) * A @ B`` in the base's shape (and dtype)."""
        a, b = self.lora_a[...], self.lora_b[...]
        lead = a.shape[:a.ndim - self.n_in - 1]
        ins, outs = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
        d = jnp.matmul(a.reshape(*lead, math.prod(ins), a.shape[-1]),
                       b.reshape(*lead, b.shape[len(lead)], math.prod(outs)))
        return (self.scale * d).reshape(*lead, *ins, *outs).astype(self.base.dtype)

    def __getitem__(self, key: Any) -> jax.Array:
        return (self.base[...] + self.delta())[key]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> Any:
        return self.base.dtype


def _n_in(names: tuple, stacked: bool) -> int:
    names = names[int(stacked):]
    # A leading unnamed axis is a low-rank input (MLA's q_b / kv_b take the latent).
    return 1 if names[:1] in (("embed",), (None,)) else len(names) - 1


def add_lora(model: nnx.Module, settings: LoRA, rngs: nnx.Rngs) -> list[str]:
    """Wraps every parameter of ``model`` whose path matches ``settings.targets`` in a
    `LoRAWeight` (in place); returns the wrapped paths. Raises `LoRAError`, before anything
    is allocated or changed, when none matches or the rank exceeds a matched weight's
    ``min(inputs, outputs)`` (a larger rank adds parameters, not expressiveness).

    Example::

        add_lora(model, LoRA(rank=4), nnx.Rngs(1))   # ['layers/attn/wq', ...]
    """
    pattern = re.compile(settings.targets)
    found = []
    for path, node in list(nnx.iter_graph(model)):
        name = "/".join(map(str, path))
        if not (isinstance(node, nnx.Param) and not isinstance(node, nnx.LoRAParam)
                and node.ndim >= 2 and pattern.search(name)):
            continue
        names = tuple(node.get_metadata().get("out_sharding") or ())
        if "expert" in names:  # experts' stacked weights are not adapted (they stay frozen)
            continue
        stacked = names[:1] == ("layers",)
        n_in = _n_in(names, stacked) if names else 1
        shape = node.shape[int(stacked):]
        most = min(math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        if settings.rank > most:
            raise LoRAError("rank", f"rank {settings.rank} exceeds the largest useful rank of "
                            f"weight {name} {'x'.join(map(str, shape))}: min(inputs, outputs) "
                            f"= {most}")
        found.append((name, path, node, n_in, stacked))
    if not found:
        raise LoRAError("targets", f"LoRA targets {settings.targets!r} match no weight of the "
                        "model")
    for (_name, path, node, n_in, stacked), key in zip(found, _keys(found, rngs), strict=True):
        parent = model
        for part in path[:-1]:
            parent = parent[part] if isinstance(part, int) else getattr(parent, part)
        setattr(parent, path[-1], LoRAWeight(node, n_in, settings, key, stacked))
    return [name for name, *_ in found]


def _keys(found: list, rngs: nnx.Rngs) -> list[jax.Array]:
    """One key per adapted weight (a key per layer for a stacked one), drawn in the order a
    list of the same layers would draw them (layer 0's weights, then layer 1's, ...), so a
    stack's adapters hold the numbers of adapters on the same layers kept in a list."""
    keys, i = [], 0
    while i < len(found):
        if not found[i][4]:
            keys.append(rngs.params())
            i += 1
            continue
        group = i
        while i < len(found) and found[i][4]:  # a run of stacked weights: one layer stack
            i += 1
        n, width = found[group][2].shape[0], i - group
        drawn = [rngs.params() for _ in range(n * width)]
        keys += [jnp.stack(drawn[j::width]) for j in range(width)]
    return keys


def lora_weights(model: nnx.Module) -> dict[str, LoRAWeight]:
    """``{path: LoRAWeight}`` of a model's adapted weights ('/'-joined paths)."""
    return {"/".join(map(str, p)): n for p, n in nnx.iter_graph(model)
            if isinstance(n, LoRAWeight)}


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds every `LoRAWeight` into a plain ``nnx.Param`` holding ``W + (alpha / rank) A @ B``
    (in place); the model then has the layout of one built without LoRA. Returns it."""
    for name, weight in lora_weights(model).items():
        path = name.split("/")
        parent = model
        for part in path[:-1]:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        merged = weight[...]
        base = weight.base
        base[...] = merged
        setattr(parent, path[-1], base)
    return model


def trainable(config: Any) -> Any:
    """The NNX filter of what training updates: the adapters under LoRA, else every
    parameter."""
    return nnx.LoRAParam if getattr(config, "lora", None) is not None else nnx.Param
