"""The accelerator table: peak FLOP/s, memory and link bandwidths by ``device_kind``.

MFU (`shardax.train.run.mfu`) divides by the peak dense bf16 FLOP/s; the planner (``shardax plan``)
takes its hardware model from here: peak FLOP/s, HBM per device, two bandwidth tiers (one
device's links within a host / an ICI domain, and its share of the network across hosts), the
devices per host, and the fractions of peak FLOP/s and bandwidth a real training step achieves.

>>> device_spec('NVIDIA H100 80GB HBM3').peak_flops
989000000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "DeviceSpec", "GiB", "device_spec"]

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: ``peak_flops`` dense bf16 FLOP/s, ``hbm_bytes`` of memory,
    ``link_bytes_per_s``, the one-way bandwidth a device has to its peers within a host
    (NVLink; ICI within a TPU slice), ``host_link_bytes_per_s``, its share of the network
    across hosts (InfiniBand / RoCE NICs; DCN between TPU slices), ``devices_per_host`` (for
    TPUs: the chips one ICI domain can hold), ``flops_fraction`` and ``link_fraction``, the
    fractions of the peaks a training step achieves (``shardax plan --calibrate`` fits the
    first from real runs), ``reserved_bytes``, memory the framework holds outside the
    compiled program (CUDA context, NCCL and cuBLAS workspaces), and
    ``collective_latency_s``, the fixed cost of one collective whatever its size (launch and
    synchronisation of the devices taking part), and ``comm_overlap``, the fraction of the
    all-gathers' and reduce-scatters' time (FSDP's parameter gathers, prefetched, and gradient
    reductions, issued as the backward produces them) that runs under compute."""

    name: str
    peak_flops: float
    hbm_bytes: float
    link_bytes_per_s: float
    host_link_bytes_per_s: float = 50e9
    devices_per_host: int = 8
    flops_fraction: float = 0.4
    link_fraction: float = 0.75
    reserved_bytes: float = 2 * 1024**3
    collective_latency_s: float = 10e-6
    comm_overlap: float = 1.0


def _tpu(name: str, peak: float, hbm: float, ici: float, domain: int) -> DeviceSpec:
    return DeviceSpec(name, peak, hbm, ici, 3.125e9, domain, flops_fraction=0.5,
                      reserved_bytes=0.5 * 1024**3)


# Vendors' data sheets (dense, no sparsity). NVLink: half the bidirectional total per GPU.
# Across hosts: one NIC per GPU (400 Gb/s ConnectX-7 = 50 GB/s on H100/H200/B200 nodes, 200 Gb/s
# HDR on A100 nodes). TPU: bf16 peak and one-way ICI bandwidth per link, as in "How to Scale Your
# Model" (2025); a "host" is the largest ICI domain (pod or slice) and across it is DCN, about
# 25 Gb/s per chip. Achievable fractions: GPUs 0.4 of peak FLOP/s (published FSDP Llama runs
# on H100 measure 33-45% MFU), TPUs 0.5 (MaxText's tables: 45-60%); 0.75 of link bandwidth
# (NCCL bus bandwidth). Matched in order against jax's ``device_kind`` (case-insensitive, first
# hit wins), so the more specific names come first. Latency per collective: 10 µs, the order of
# NCCL's small-message all-reduce time within a node (nccl-tests); a TPU's ICI collectives are
# not faster by an order of magnitude, so the same default (it matters only for layouts issuing
# thousands of collectives per step: tensor and pipeline parallelism with many microbatches).
# Overlap: FSDP frameworks hide their gathers and reduce-scatters under compute (FSDP2's
# prefetch; XLA's async collectives and latency-hiding scheduler on GPU and TPU): with all of it
# hidden, published FSDP runs of Llama 3.1 8B (torchtitan on 8 and 128 H100s, MaxText on v6e-8
# and v6e-256) land within 12% of the estimate, with none hidden 1-41% below it
# (`benchmarks/published.py`). All-reduces, all-to-alls and permutes are never taken as hidden.
DEVICES: tuple[tuple[str, DeviceSpec], ...] = (
    ("h100 pcie", DeviceSpec("H100 PCIe", 756e12, 80e9, 64e9, 50e9, 8)),
    ("h100 nvl", DeviceSpec("H100 NVL", 835e12, 94e9, 300e9, 50e9, 8)),
    ("h100", DeviceSpec("H100 SXM", 989e12, 80e9, 450e9, 50e9, 8)),
    ("h200", DeviceSpec("H200 SXM", 989e12, 141e9, 450e9, 50e9, 8)),
    ("gh200", DeviceSpec("GH200", 989e12, 96e9, 450e9, 50e9, 4)),
    ("a100", DeviceSpec("A100", 312e12, 80e9, 300e9, 25e9, 8)),
    ("b200", DeviceSpec("B200", 2250e12, 180e9, 900e9, 50e9, 8)),
    ("tpu v4", _tpu("TPU v4", 275e12, 32 * GiB, 45e9, 4096)),
    ("tpu v5 lite", _tpu("TPU v5e", 197e12, 16 * GiB, 45e9, 256)),
    ("tpu v5e", _tpu("TPU v5e", 197e12, 16 * GiB, 45e9, 256)),
    ("tpu v5", _tpu("TPU v5p", 459e12, 95 * GiB, 90e9, 8960)),  # 'TPU v5p' and 'TPU v5'
    ("tpu v6 lite", _tpu("TPU v6e", 918e12, 32 * GiB, 90e9, 256)),
    ("tpu v6e", _tpu("TPU v6e", 918e12, 32 * GiB, 90e9, 256)),
)
# Short names ``shardax plan --target`` also takes (matched whole, not inside a device kind).
_SHORT = {"v4": "tpu v4", "v5e": "tpu v5e", "v5p": "tpu v5p", "v6e": "tpu v6e"}


def device_spec(device_kind: str) -> DeviceSpec | None:
    """The table's entry for a ``jax.Device.device_kind`` (``'NVIDIA H100 80GB HBM3'``,
    ``'TPU v5 lite'``), or also a short name (``'h100'``, ``'tpu v5p'``); None if unknown
    (CPU among them).

    >>> device_spec('TPU v5 lite').name, device_spec('v5p').name
    ('TPU v5e', 'TPU v5p')
    """
    kind = device_kind.lower().strip()
    kind = _SHORT.get(kind, kind)
    for key, spec in DEVICES:
        if key in kind or kind == spec.name.lower():
            return spec
    return None
