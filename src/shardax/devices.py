"""The accelerator table: peak FLOP/s, memory and link bandwidth by ``device_kind``.

MFU (`shardax.train.mfu`) divides by the peak dense bf16 FLOP/s; the planner (``shardax plan``)
takes its roofline numbers from here: peak FLOP/s, HBM per device and the one-way bandwidth of
one device's fastest link.

>>> device_spec('NVIDIA H100 80GB HBM3').peak_flops
989000000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "DeviceSpec", "GiB", "device_spec"]

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
