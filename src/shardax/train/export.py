"""``shardax export``: a run's checkpoint -> a Hugging Face model directory.

The checkpoint is read (read-only) sharded over every device by the ``fsdp`` rules, then
written with ``shardax.hf.save_params``: each safetensors file by one process, tensor by tensor
(one per-tensor gather), so no host holds the whole model.

>>> export_run(check_export(ExportConfig(out="runs/a", to="export/a")))  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax import hf, models
from shardax.train.config import ExportConfig, UsageError
from shardax.train.generate import restore_model
from shardax.train.rundir import RunDir, check_run

__all__ = ["export_run"]


def export_run(config: ExportConfig, run_dir: RunDir | None = None) -> list[Path]:
    """Writes checkpoint ``--step`` (default: the newest good one) of run ``--out`` to ``--to``
    as a Hugging Face directory, for a checked config; returns the safetensors files this
    process wrote. ``run_dir``: what `check_run` returned for ``--out`` (read if not given)."""
    run_dir = run_dir or check_run(config.out, config.step)
    n = jax.device_count()
    model_config, model, _ = restore_model(run_dir, config.step, f"fsdp={n}",
                                           models.PRESETS["fsdp"])
    if getattr(model_config, "n_experts", 0) and model_config.moe_impl != "dropless":
        raise UsageError(f"--out {config.out}: a capacity-based mixture-of-experts model has "
                         "no Hugging Face form (the dropless one has)")
    dtype = config.dtype
    out_dtype = None if dtype == "auto" else np.dtype(dtype if dtype != "bfloat16" else
                                                      jax.numpy.bfloat16)
    try:
        return hf.save_params(model_config, nnx.state(model, nnx.Param), config.to,
                              max_shard_bytes=config.max_shard_mb * 2**20, dtype=out_dtype)
    except OSError as e:
        raise UsageError(f"--to {config.to}: cannot write it ({e.strerror or e})") from None
