"""Hugging Face checkpoints in and out: Llama (2/3, GQA, ``rope_theta``, Llama-3
``rope_scaling``, tied or untied embeddings), Mistral (sliding window), Qwen2 (q/k/v biases),
Qwen3 (q/k norm), Gemma 2 and Gemma 3 text (sliding/global layers, soft-capping, GeGLU),
Mixtral, Qwen2-MoE and Qwen3-MoE (dropless mixture of experts), DeepSeek-V3 (latent attention,
first dense layers, sigmoid routing with its correction bias), gpt-oss (attention sinks,
biased experts with the clamped SwiGLU, YaRN) and GPT-2.

* :func:`load_model` / :func:`load_params`: a model directory (``config.json`` + single or
  sharded ``*.safetensors``) -> shardax NNX model, created in its sharded layout on any mesh;
  each process reads only its devices' slices (``ReadLog`` records them).
* :func:`config_from_hf` / :func:`config_to_hf`: ``config.json`` dicts <-> shardax model
  configs.
* :func:`save_model` / :func:`save_params`: shardax parameters -> a directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads, in safetensors files of bounded
  size, written tensor by tensor.

Example::

    from shardax import hf
    model = hf.load_model('TinyLlama-1.1B', MeshShardingHelper.from_string('fsdp=4,tp=2'))
    hf.save_model(model, 'export/tinyllama', max_shard_bytes=2**30)
"""

from shardax.hf.configs import config_from_hf, config_to_hf
from shardax.hf.export import save_model, save_params
from shardax.hf.files import ReadLog, SafetensorsFile
from shardax.hf.load import default_rules, load_config, load_model, load_params
from shardax.hf.mapping import TensorMap, param_maps

__all__ = ["ReadLog", "SafetensorsFile", "TensorMap", "config_from_hf", "config_to_hf",
           "default_rules", "load_config",
           "load_model", "load_params", "param_maps", "save_model", "save_params"]
