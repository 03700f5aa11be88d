"""``shardax export``: a run's checkpoint -> a Hugging Face model directory.

The checkpoint is read (read-only) sharded over every device by the ``fsdp`` rules, then
written with ``shardax.hf.save_params``: each safetensors file by one process, tensor by tensor
(one per-tensor gather), so no host holds the whole model.

>>> export_run("runs/a", "export/a", max_shard_mb=500)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax import hf, models
from shardax.train.config import ExportConfig, UsageError, check_export
from shardax.train.generate import restore_model

__all__ = ["export_run"]


def export_run(out: str, to: str, step: int | None = None, max_shard_mb: int = 2048,
               dtype: str = "auto") -> list[Path]:
    """Writes checkpoint ``step`` (default: the newest good one) of run ``out`` to ``to`` as a
    Hugging Face directory; returns the safetensors files this process wrote."""
    check_export(ExportConfig(out=out, to=to, step=step, max_shard_mb=max_shard_mb, dtype=dtype))
    n = jax.device_count()
    model_config, model, _ = restore_model(out, step, f"fsdp={n}", models.PRESETS["fsdp"])
    if getattr(model_config, "n_experts", 0):
        raise UsageError(f"--out {out}: a mixture-of-experts model has no Hugging Face form here")
    out_dtype = None if dtype == "auto" else np.dtype(dtype if dtype != "bfloat16" else
                                                      jax.numpy.bfloat16)
    try:
        return hf.save_params(model_config, nnx.state(model, nnx.Param), to,
                              max_shard_bytes=max_shard_mb * 2**20, dtype=out_dtype)
    except OSError as e:
        raise UsageError(f"--to {to}: cannot write it ({e.strerror or e})") from None
