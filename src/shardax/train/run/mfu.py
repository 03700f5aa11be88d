"""Model FLOPs per token and MFU (model FLOP/s over the devices' peak).

Model FLOPs per token of a decoder (PaLM, appendix B), forward and backward:

    6 · N  +  12 · L · d · T

N the parameters that take part in matmuls for one token (all but lookup tables: the input
embedding unless it is tied to the output projection, GPT-2's position table; for a mixture
of experts only the ``top_k`` experts a token is routed to), L layers, d = heads · head_dim,
T the sequence length (the attention term counts the full T x T scores, as the
implementation computes them; causal masking does not skip any). Recomputation under remat
is not model FLOPs, so remat lowers MFU: MFU = model FLOP/s / peak FLOP/s.

Peak FLOP/s per accelerator come from the device table, `shardax.devices`.

>>> flops_per_token(models.get_config('llama-1b'), 2048)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from shardax import models

__all__ = ["flops_per_token", "matmul_params", "mfu"]

def matmul_params(config: Any) -> int:
    """Parameters one token's forward pass multiplies by (N in 6·N): the model's parameters
    without lookup tables, and with only ``top_k`` of the ``n_experts`` experts."""
    n = models.param_count(config)
    if isinstance(config, models.GPT2Config):
        return n - config.max_seq_len * config.dim  # positions are looked up; wte is tied
    if not config.tie_embeddings:
        n -= config.vocab_size * config.dim  # the input table is a lookup
    if config.n_experts:
        expert = 3 * config.dim * config.mlp_dim
        n -= config.n_layers * (config.n_experts - config.top_k) * expert
    return n


def flops_per_token(config: Any, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward): 6·N + 12·L·d·T.

    Example::

        flops_per_token(models.get_config('llama-1b'), 2048)   # 7.9e9
    """
    d = config.n_heads * config.head_dim
    return 6.0 * matmul_params(config) + 12.0 * config.n_layers * d * seq_len


def mfu(model_flops_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: model FLOP/s / (peak FLOP/s per device x devices); None when
    the peak is unknown (a CPU, or a device the table lacks and no ``--peak-tflops``)."""
    if not peak_flops:
        return None
    return model_flops_per_s / (peak_flops * devices)
