"""``shardax export``: a run's checkpoint -> a Hugging Face model directory (a LoRA run:
its merged weights, or with ``--adapter-only`` a PEFT adapter directory).

The checkpoint is read (read-only) sharded over every device by the ``fsdp`` rules, then
written with ``shardax.hf.save_params``: each safetensors file by one process, tensor by tensor
(one per-tensor gather), so no host holds the whole model. The run's tokenizer goes with it
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``; a byte-level run
gets a byte-level ``tokenizer.json`` with the same ids) and its bos/eos/pad ids go into
``config.json`` and ``generation_config.json``, so ``AutoTokenizer`` and ``generate`` of
transformers work on the export.

>>> export_run(check_export(ExportConfig(out="runs/a", to="export/a")))  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax import hf, layout
from shardax.data.tokenizer import Tokenizer, run_tokenizer
from shardax.errors import UsageError
from shardax.filewrite import write_text
from shardax.hf.export import EXPORTED
from shardax.hf.peft import save_adapters
from shardax.models.lora import merge_lora
from shardax.train.config import ExportConfig
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
                                           layout.PRESETS["fsdp"])
    if getattr(model_config, "n_experts", 0) and model_config.moe_impl != "dropless":
        raise UsageError(f"--out {config.out}: a capacity-based mixture-of-experts model has "
                         "no Hugging Face form (the dropless one has)")
    dtype = config.dtype
    out_dtype = None if dtype == "auto" else np.dtype(dtype if dtype != "bfloat16" else
                                                      jax.numpy.bfloat16)
    if config.adapter_only and model_config.lora is None:
        raise UsageError(f"--adapter-only: run {config.out} was not trained with LoRA "
                         "(--lora-rank); export its full weights without --adapter-only")
    try:
        tokenizer = run_tokenizer(run_dir.out, run_dir.saved.tokenizer)
    except ValueError as e:
        raise UsageError(f"--out {config.out}: {e}") from None
    try:
        if config.adapter_only:
            init = run_dir.saved.init_from
            try:
                return [save_adapters(model, config.to, dtype=out_dtype,
                                      base_model=init.removeprefix("hf:") if init else "")]
            except ValueError as e:
                raise UsageError(f"--adapter-only: {e}") from None
        ids = _write_tokenizer(tokenizer, Path(config.to), model_config.max_seq_len)
        merge_lora(model)  # LoRA: the merged weights W + (alpha / rank) A @ B
        return hf.save_params(model_config, nnx.state(model, EXPORTED), config.to,
                              max_shard_bytes=config.max_shard_mb * 2**20, dtype=out_dtype,
                              config_extra=ids)
    except OSError as e:
        raise UsageError(f"--to {config.to}: cannot write it ({e.strerror or e})") from None


def _write_tokenizer(tokenizer: Tokenizer, directory: Path, max_len: int) -> dict[str, int]:
    """The run's tokenizer files and ``generation_config.json`` (its bos/eos/pad ids; pad is
    eos where the tokenizer has none, as transformers' ``generate`` does), written by process
    0; returns the ids for ``config.json``."""
    if jax.process_index() != 0:
        return {}  # process 0 writes config.json
    ids = tokenizer.export(directory, max_len)
    generation = {**ids, "pad_token_id": ids.get("pad_token_id", ids["eos_token_id"])}
    write_text(directory / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    return ids
