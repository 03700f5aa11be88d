"""Model FLOPs per token, accelerator peak numbers by ``device_kind``, and MFU.

Model FLOPs per token of a decoder (PaLM, appendix B), forward and backward:

    6 · N  +  12 · L · d · T

N the parameters that take part in matmuls for one token (all but lookup tables: the input
embedding unless it is tied to the output projection, GPT-2's position table; for a mixture
of experts only the ``top_k`` experts a token is routed to), L layers, d = heads · head_dim,
T the sequence length (the attention term counts the full T x T scores, as the
implementation computes them; causal masking does not skip any). Recomputation under remat
is not model FLOPs, so remat lowers MFU: MFU = model FLOP/s / peak FLOP/s.

The same table gives the planner (``shardax plan``) its roofline numbers: peak dense bf16
FLOP/s, HBM per device and the one-way bandwidth of one device's fastest link.

>>> flops_per_token(models.get_config('llama-1b'), 2048)  # doctest: +SKIP
>>> device_spec('NVIDIA H100 80GB HBM3').peak_flops       # doctest: +SKIP
989000000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceSpec", "DEVICES", "device_spec", "flops_per_token", "matmul_params", "mfu"]

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: ``peak_flops`` dense bf16 FLOP/s, ``hbm_bytes`` of memory and
    ``link_bytes_per_s``, the one-way bandwidth a device has to its peers (NVLink / ICI)."""

    name: str
    peak_flops: float
    hbm_bytes: float
    link_bytes_per_s: float


# Vendors' data sheets (dense, no sparsity). NVLink: half the bidirectional total per GPU.
# TPU: bf16 peak and one-way ICI bandwidth per link, as in "How to Scale Your Model" (2025).
# Matched in order against jax's ``device_kind`` (case-insensitive, first hit wins), so the
# more specific names come first.
DEVICES: tuple[tuple[str, DeviceSpec], ...] = (
    ("h100 pcie", DeviceSpec("H100 PCIe", 756e12, 80e9, 64e9)),
    ("h100 nvl", DeviceSpec("H100 NVL", 835e12, 94e9, 300e9)),
    ("h100", DeviceSpec("H100 SXM", 989e12, 80e9, 450e9)),
    ("h200", DeviceSpec("H200 SXM", 989e12, 141e9, 450e9)),
    ("gh200", DeviceSpec("GH200", 989e12, 96e9, 450e9)),
    ("a100", DeviceSpec("A100", 312e12, 80e9, 300e9)),
    ("b200", DeviceSpec("B200", 2250e12, 180e9, 900e9)),
    ("tpu v4", DeviceSpec("TPU v4", 275e12, 32 * GiB, 45e9)),
    ("tpu v5 lite", DeviceSpec("TPU v5e", 197e12, 16 * GiB, 45e9)),
    ("tpu v5e", DeviceSpec("TPU v5e", 197e12, 16 * GiB, 45e9)),
    ("tpu v5", DeviceSpec("TPU v5p", 459e12, 95 * GiB, 90e9)),  # 'TPU v5p' and 'TPU v5'
    ("tpu v6 lite", DeviceSpec("TPU v6e", 918e12, 32 * GiB, 90e9)),
    ("tpu v6e", DeviceSpec("TPU v6e", 918e12, 32 * GiB, 90e9)),
)


def device_spec(device_kind: str) -> DeviceSpec | None:
    """The table's entry for a ``jax.Device.device_kind`` (``'NVIDIA H100 80GB HBM3'``,
    ``'TPU v5 lite'``), or also a short name (``'h100'``, ``'tpu v5p'``); None if unknown
    (CPU among them).

    >>> device_spec('TPU v5 lite').name
    'TPU v5e'
    """
    kind = device_kind.lower()
    for key, spec in DEVICES:
        if key in kind or kind == spec.name.lower():
            return spec
    return None


def matmul_params(config: Any) -> int:
    """Parameters one token's forward pass multiplies by (N in 6·N): the model's parameters
    without lookup tables, and with only ``top_k`` of the ``n_experts`` experts."""
    from shardax import models

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
