"""The mixture-of-experts MLP of the Llama MoE variant (``LlamaConfig(n_experts=...)``).

Every layer's SwiGLU MLP becomes ``n_experts`` SwiGLU experts of ``mlp_dim`` hidden units and a
top-``top_k`` router (``shardax.parallel.moe_kernel.capacity_moe``; the layout runs it
expert-parallel as ``shardax.parallel.moe_mlp``). Expert weights carry the logical name 'expert'
first, so a rule on 'expert' splits them over the devices and the tokens travel to their experts
with ``all_to_all``. Routing groups are the batch rows (one sequence per group), so the routing,
and so the numbers, do not depend on the mesh.

Example::

    model = Llama(CONFIGS['llama-moe-tiny'], nnx.Rngs(0))
    logits, aux = model(tokens, return_aux=True)   # aux: load-balancing loss, 1 if balanced
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.models._layers import param
from shardax.models.protocol import MoEStats
from shardax.parallel.moe_kernel import capacity_moe

if TYPE_CHECKING:
    from shardax.models.configs import LlamaConfig

__all__ = ["MoE"]

_normal = nnx.initializers.normal


def init_experts(module: nnx.Module, c: LlamaConfig, rngs: nnx.Rngs) -> None:
    """Sets ``module``'s router and per-expert SwiGLU weights (``router``, ``w_gate``,
    ``w_up``, ``w_down``; experts on a leading ``'expert'`` axis): shared by both MoE kinds,
    so their parameters (and checkpoints) have one layout."""
    std, out_std = 0.02, 0.02 / (2 * c.n_layers) ** 0.5
    e, pd = c.n_experts, c.param_dtype
    module.router = param(rngs.params(), _normal(std), (c.dim, e), ("embed", None), pd)
    module.w_gate = param(rngs.params(), _normal(std), (e, c.dim, c.mlp_dim),
                          ("expert", "embed", "mlp"), pd)
    module.w_up = param(rngs.params(), _normal(std), (e, c.dim, c.mlp_dim),
                        ("expert", "embed", "mlp"), pd)
    module.w_down = param(rngs.params(), _normal(out_std), (e, c.mlp_dim, c.dim),
                          ("expert", "mlp", "embed"), pd)


class MoE(nnx.Module):
    """``moe(x [b, s, dim]) -> (y, stats)``; ``y`` excludes the residual, ``stats`` a
    `MoEStats` (load-balancing loss, tokens per expert, dropped fraction)."""

    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        self.config = c
        init_experts(self, c, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        return self.run(x, capacity_moe)

    def run(self, x: jax.Array, moe: Callable = capacity_moe, **kwargs
            ) -> tuple[jax.Array, MoEStats]:
        """``(y, stats)`` through ``moe`` (``capacity_moe``, or the layout's ``moe_mlp`` with
        its ``kwargs``), groups the batch rows."""
        c, dt = self.config, self.config.dtype
        y, aux = moe(
            x, self.router[...], self.w_up[...].astype(dt), self.w_down[...].astype(dt),
            self.w_gate[...].astype(dt), top_k=c.top_k, capacity_factor=c.capacity_factor,
            num_groups=x.shape[0], activation=jax.nn.silu, **kwargs,
        )
        # The global top-k assignments per expert, from their (exact) fraction of all of them.
        assigned = x.size // x.shape[-1] * c.top_k
        tokens = jnp.round(aux["expert_fraction"].astype(jnp.float32) * assigned)
        return y.astype(x.dtype), MoEStats(aux["load_balancing_loss"].astype(jnp.float32),
                                           tokens, aux["dropped_fraction"].astype(jnp.float32))
