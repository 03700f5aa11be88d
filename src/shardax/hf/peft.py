"""A model's LoRA adapters -> a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, DIR)`` loads.

Each adapted weight (`shardax.models.lora.LoRAWeight`) becomes PEFT's ``lora_A.weight``
[rank, in] and ``lora_B.weight`` [out, rank] of the Hugging Face module its base maps to
(`shardax.hf.mapping`), in that module's own input and output order: the order is read off
the map by writing an array of indices through it, so head and projection layouts need no
case of their own. PEFT scales by ``lora_alpha / r``, as shardax does. Llama-layout models
only (GPT-2's fused ``c_attn`` has no per-projection module).

Example::

    save_adapters(model, 'export/adapter', base_model='hf/llama')
    # peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('hf/llama'),
    #                                'export/adapter')
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax.filewrite import check_target_dir, write_text
from shardax.hf.export import sync_processes, to_host
from shardax.hf.files import write_safetensors
from shardax.hf.mapping import TensorMap, param_maps, to_hf
from shardax.models.configs import LlamaConfig
from shardax.models.lora import lora_weights

__all__ = ["save_adapters"]

_PREFIX = "base_model.model."


def _orders(m: TensorMap) -> tuple[np.ndarray, np.ndarray]:
    """For the HF ``[out, in]`` tensor of ``m``: the shardax input index of each HF column and
    the shardax output index of each HF row (shardax weights are ``[in..., out...]``)."""
    shape = m.shape()
    index = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    out = np.empty(m.hf_shape, np.int64)
    to_hf(m, index, out)
    return out, index


def _factors(m: TensorMap, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ``(lora_A [r, in], lora_B [out, r])`` of one layer's shardax factors
    ``a [in..., r]`` and ``b [r, out...]``."""
    r = a.shape[-1]
    out_size = math.prod(b.shape[1:])
    hf, _ = _orders(m)
    if len(m.hf_shape) != 2 or m.select:
        raise ValueError(f"{m.name}: not a [out, in] projection")
    in_of_col, out_of_row = hf[0] // out_size, hf[:, 0] % out_size
    if not np.array_equal(hf, in_of_col[None] * out_size + out_of_row[:, None]):
        raise ValueError(f"{m.name}: its rows are not the weight's outputs")
    return (a.reshape(-1, r)[in_of_col].T.copy(), b.reshape(r, out_size)[:, out_of_row].T.copy())


def save_adapters(model: nnx.Module, directory: str | os.PathLike, *, base_model: str = "",
                  dtype: object = None) -> Path:
    """Writes the LoRA adapters of ``model`` (a shardax Llama-layout model with ``config.lora``)
    as a PEFT directory; returns the safetensors path. ``base_model`` is recorded as
    ``base_model_name_or_path``; ``dtype`` casts the tensors (default: as stored).

    Example::

        save_adapters(model, 'export/adapter', base_model='hf/llama')
    """
    config = model.config
    if not isinstance(config, LlamaConfig) or config.lora is None:
        raise ValueError("PEFT adapters need a Llama-layout model trained with LoRA "
                         "(--lora-rank)")
    maps = param_maps(config)
    tensors: dict[str, np.ndarray] = {}
    modules = set()
    for path, weight in lora_weights(model).items():
        if path not in maps:
            raise ValueError(f"adapted weight {path!r} has no Hugging Face module")
        a, b = to_host(weight.lora_a[...]), to_host(weight.lora_b[...])
        layered = maps[path] if isinstance(maps[path], list) else [maps[path]]
        for layer, m in enumerate(layered):
            la, lb = (a[layer], b[layer]) if isinstance(maps[path], list) else (a, b)
            lora_a, lora_b = _factors(m, la, lb)
            module = m.name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            tensors[f"{_PREFIX}{module}.lora_A.weight"] = lora_a
            tensors[f"{_PREFIX}{module}.lora_B.weight"] = lora_b
    out_dtype = np.dtype(dtype) if dtype is not None else next(iter(tensors.values())).dtype
    d = Path(directory)
    path = d / "adapter_model.safetensors"
    check_target_dir(d, "adapter directory")  # on every process: all of them stop
    if jax.process_index() == 0:
        d.mkdir(parents=True, exist_ok=True)
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora.rank,
            "lora_alpha": config.lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(modules), "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "modules_to_save": None,
            "init_lora_weights": True, "base_model_name_or_path": base_model or None,
        }
        write_text(d / "adapter_config.json", json.dumps(adapter_config, indent=2) + "\n")
        write_safetensors(path, {k: (out_dtype, v.shape) for k, v in tensors.items()},
                          lambda k: tensors[k].astype(out_dtype))
    sync_processes("shardax-peft-export")
    return path
