"""Hugging Face import and KV-cache generation.

    python benchmarks/hf.py [--json out.json] [--gb 1.2]

1. Import: a Llama of >= 1 GB in float32 is written locally as random safetensors (no
   transformers needed; two files with an index), then loaded by ``shardax.hf.load_model`` in
   a fresh process, on 1 device and on fsdp=8 (emulated CPU devices). Reported: wall time and
   peak host RSS (``ru_maxrss``). On CPU the devices' buffers are host memory, so the model
   itself is part of the RSS; the overhead that matters is the peak minus (the RSS just before
   loading + the model's bytes), given in units of the largest tensor.
2. Generation: tokens/s of ``shardax.models.decode.generate`` with the KV cache vs full
   recompute of the window for every token (same masks, same tokens), after a warm-up call
   (compile excluded).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

LOADER = r"""
import json, resource, sys, time
import os
sys.path.insert(0, sys.argv[3])
import jax
from shardax import hf
from shardax.sharding import MeshShardingHelper
mesh = MeshShardingHelper.from_string(sys.argv[2])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
jax.devices()
before = rss()  # current, after JAX started its backend
t0 = time.perf_counter()
model = hf.load_model(sys.argv[1], mesh)
jax.block_until_ready(jax.tree.leaves(model))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss_before": before, "rss_peak": peak}))
"""


def write_model(directory: Path, gb: float) -> dict:
    """A random Llama (dim 2048, GQA 16/4 heads, vocab 32000) with enough layers for ``gb``."""
    import numpy as np

    from shardax.hf.configs import config_to_hf
    from shardax.hf.files import write_safetensors
    from shardax.hf.mapping import param_maps
    from shardax.models import LlamaConfig

    base = dict(vocab_size=32000, dim=2048, n_heads=16, n_kv_heads=4, mlp_dim=5632,
                max_seq_len=2048)
    per_layer = 4 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 5632 + 2 * 2048)
    head = 4 * (2 * 32000 * 2048 + 2048)
    layers = max(1, math.ceil((gb * 1e9 - head) / per_layer))
    config = LlamaConfig(n_layers=layers, **base)
    specs = {}
    for m in param_maps(config).values():
        for one in m if isinstance(m, list) else [m]:
            specs[one.name] = (np.float32, one.hf_shape)
    names = list(specs)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for fname, group in files.items():
        write_safetensors(directory / fname, {n: specs[n] for n in group},
                          lambda n: (rng.standard_normal(specs[n][1], np.float32) * 0.02))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, g in files.items() for n in g}}))
    (directory / "config.json").write_text(json.dumps(config_to_hf(config)))
    sizes = [4 * math.prod(s) for _, s in specs.values()]
    return {"layers": layers, "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "tensors": len(sizes)}


def import_case(directory: Path, mesh: str, model: dict) -> dict:
    devices = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-c", LOADER, str(directory), mesh,
                           str(HERE.parent / "src")], env=env, capture_output=True, text=True,
                          check=True, timeout=1200)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    overhead = r["rss_peak"] - r["rss_before"] - model["model_bytes"]
    return {"mesh": mesh, **r, "overhead_bytes": overhead,
            "overhead_in_largest_tensors": overhead / model["largest_tensor_bytes"],
            "peak_over_largest": r["rss_peak"] / model["largest_tensor_bytes"]}


def generation(prompt_len: int = 16, new: int = 192, batch: int = 4) -> dict:
    import _common  # noqa: F401  (sets 8 CPU devices before JAX)
    import numpy as np
    from flax import nnx

    from shardax import models
    from shardax.models import decode

    cfg = models.get_config("llama-tiny", dim=256, n_heads=8, n_kv_heads=4, mlp_dim=704,
                            n_layers=4, max_seq_len=prompt_len + new)
    model = models.create(cfg, nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, 256, (batch, prompt_len)).tolist()
    out = {}
    for name, cache in (("kv_cache", True), ("recompute", False)):
        decode.generate(model, prompts, new, use_cache=cache)  # compile
        t0 = time.perf_counter()
        got = decode.generate(model, prompts, new, use_cache=cache)
        seconds = time.perf_counter() - t0
        out[name] = {"seconds": seconds, "tokens_per_s": batch * new / seconds,
                     "tokens": got.tokens}
    same = out["kv_cache"].pop("tokens") == out["recompute"].pop("tokens")
    return {"model": f"llama dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/"
                     f"{cfg.n_kv_heads} heads", "batch": batch, "prompt": prompt_len,
            "new_tokens": new, **out, "same_tokens": same,
            "speedup": out["kv_cache"]["tokens_per_s"] / out["recompute"]["tokens_per_s"]}


def render(result: dict) -> str:
    m, g = result["model"], result["generation"]
    lines = [
        "## 9. Hugging Face import and KV-cache generation",
        "",
        f"Import (`shardax.hf.load_model`) of a random Llama written as safetensors: "
        f"{m['layers']} layers, dim 2048, vocab 32000, {m['model_bytes'] / 1e9:.2f} GB float32 "
        f"in {m['tensors']} tensors (largest {m['largest_tensor_bytes'] / 1e6:.0f} MB), two "
        "files with an index; fresh process per row. On CPU the device buffers are host "
        "memory, so peak RSS includes the model; the overhead is peak − (RSS before loading + "
        "model bytes).",
        "",
        "| mesh | seconds | peak RSS GB | overhead MB | overhead / largest tensor | "
        "peak / largest tensor |",
        "|---|---|---|---|---|---|",
        *(f"| {r['mesh']} | {r['seconds']:.1f} | {r['rss_peak'] / 1e9:.2f} | "
          f"{r['overhead_bytes'] / 1e6:.0f} | {r['overhead_in_largest_tensors']:.2f} | "
          f"{r['peak_over_largest']:.1f} |" for r in result["import"]),
        "",
        f"Generation ({g['model']}; batch {g['batch']}, prompt {g['prompt']}, "
        f"{g['new_tokens']} new tokens, greedy; compile excluded): KV cache "
        f"{g['kv_cache']['tokens_per_s']:.0f} tokens/s vs full recompute "
        f"{g['recompute']['tokens_per_s']:.0f} tokens/s: {g['speedup']:.1f}x; same tokens: "
        f"{g['same_tokens']}.",
        "",
    ]
    return "\n".join(lines)


def summary(result: dict) -> list[dict]:
    from _common import goal_row

    worst = max(r["overhead_in_largest_tensors"] for r in result["import"])
    g = result["generation"]
    return [goal_row("9 hf", "import host overhead / largest tensor", worst, "≤ 2",
                     worst <= 2),
            goal_row("9 hf", "generation tokens/s, KV cache / recompute", g["speedup"], "> 1",
                     g["speedup"] > 1 and g["same_tokens"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here (default: stdout)")
    parser.add_argument("--gb", type=float, default=1.2, help="model size to import")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    with tempfile.TemporaryDirectory(prefix="shardax-bench-hf-") as tmp:
        model = write_model(Path(tmp), args.gb)
        imports = [import_case(Path(tmp), mesh, model) for mesh in ("dp=1", "fsdp=8")]
    result = {"model": model, "import": imports, "generation": generation()}
    from _common import emit

    emit(result, args.json)
    print(render(result), file=sys.stderr)


if __name__ == "__main__":
    main()
