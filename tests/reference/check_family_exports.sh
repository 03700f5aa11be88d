#!/bin/bash
# Each model family: a byte-vocabulary model of its fixture's architecture trains one step from
# hf:DIR, is exported, and transformers' AutoTokenizer and AutoModelForCausalLM load the export
# and generate. Not part of the suite (torch + transformers): run it in the reference
# environment of make_hf_fixtures.py:  REF_PYTHON=/path/to/python bash tests/reference/check_family_exports.sh
set -u
if [ -z "${REF_PYTHON:-}" ]; then echo "set REF_PYTHON to a python with torch and transformers" >&2; exit 2; fi
cd "$(dirname "$0")/../.."
OUT=$(mktemp -d)
for arch in ${ARCHS:-qwen3 gemma2 gemma3 mistral_window mixtral qwen2_moe qwen3_moe deepseek_v3 gpt_oss llama_gqa}; do
  PYTHONPATH=src .venv/bin/python - <<PY
import json, pathlib
from flax import nnx
from shardax import hf, models
from shardax.hf.configs import config_from_hf
fx = pathlib.Path("tests/fixtures/hf/$arch")
cfg = config_from_hf(json.loads((fx / "config.json").read_text()), vocab_size=256)
hf.save_model(models.create(cfg, nnx.Rngs(0)), "$OUT/$arch-base")
PY
  PYTHONPATH=src .venv/bin/shardax train --init-from hf:$OUT/$arch-base --steps 1 --batch-size 8 --seq-len 32 --optimizer sgd --lr 1e-9 --eval-every 0 --out $OUT/$arch-run --devices 8 >/dev/null 2>$OUT/$arch.err || { echo "$arch train failed"; tail -2 $OUT/$arch.err; continue; }
  PYTHONPATH=src .venv/bin/shardax export --out $OUT/$arch-run --to $OUT/$arch-export >/dev/null 2>>$OUT/$arch.err || { echo "$arch export failed"; tail -2 $OUT/$arch.err; continue; }
  "$REF_PYTHON" - <<PY
import transformers, torch
d = "$OUT/$arch-export"
tok = transformers.AutoTokenizer.from_pretrained(d)
model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
ids = tok("Hello", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=4, do_sample=False)
print("$arch", type(tok).__name__, type(model).__name__, "ids", ids.tolist()[0][:6], "generated", out.shape[1] - ids.shape[1], "tokens")
PY
done
