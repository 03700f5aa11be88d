"""Reference models (Flax NNX) with logical axis names on every parameter and key activation:
architectures only (how they run on a mesh is `shardax.layout`).

Example::

    from flax import nnx
    from shardax import models

    model = models.create(models.get_config('llama-tiny'), nnx.Rngs(0))
    logits = model(tokens[:, :-1])
    loss = models.cross_entropy(logits, tokens[:, 1:])
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from shardax.models import gpt2, llama
from shardax.models._annotate import constrain, current_logical_rules, use_logical_rules
from shardax.models._layers import cross_entropy, stack_states
from shardax.models.configs import CONFIGS, GPT2Config, LlamaConfig, RopeScaling, check_overrides
from shardax.models.gpt2 import GPT2
from shardax.models.llama import Llama
from shardax.models.lora import add_lora
from shardax.models.mlp import MLP
from shardax.models.protocol import LanguageModel
from shardax.models.remat import REMAT_POLICIES

__all__ = [
    "CONFIGS", "GPT2", "GPT2Config", "LanguageModel", "Llama", "LlamaConfig", "MLP",
    "REMAT_POLICIES", "RopeScaling", "check_overrides", "constrain", "create", "cross_entropy",
    "current_logical_rules", "get_config", "param_count", "stack_states", "use_logical_rules",
]


def get_config(name: str, **overrides: Any) -> LlamaConfig | GPT2Config:
    """A named config (see ``CONFIGS``) with fields replaced by ``overrides``.

    Example::

        cfg = get_config('llama-125m', dtype=jnp.bfloat16)

    How the model runs (``remat``, ``attention``, ``scan_layers``, tensor/pipeline modes) is
    not an override: it is a ``shardax.layout.Layout``.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    check_overrides(f"get_config({name!r})", overrides)
    return dataclasses.replace(CONFIGS[name], **overrides)


def create(config: LlamaConfig | GPT2Config, rngs: nnx.Rngs) -> Llama | GPT2:
    """Build the model a config describes (with LoRA adapters when ``config.lora`` is set:
    ``shardax.models.lora``): identical layers stacked on a leading 'layers' axis, layers
    that differ (``config.mixed_layers``) in a list. Whether a stack runs as a scan or a loop
    is the layout's (``Layout.scan_layers``).

    Example::

        model = create(get_config('llama-tiny'), nnx.Rngs(0))
    """
    if isinstance(config, LlamaConfig):
        model = Llama(config, rngs)
    elif isinstance(config, GPT2Config):
        model = GPT2(config, rngs)
    else:
        raise ValueError(f"expected a LlamaConfig or GPT2Config, got {type(config).__name__}")
    if config.lora is not None:
        add_lora(model, config.lora, rngs)
    return model


def param_count(config: LlamaConfig | GPT2Config) -> int:
    """Analytic parameter count of the model a config describes."""
    if isinstance(config, LlamaConfig):
        return llama.param_count(config)
    if isinstance(config, GPT2Config):
        return gpt2.param_count(config)
    raise ValueError(f"expected a LlamaConfig or GPT2Config, got {type(config).__name__}")
