"""Computes, with ``peft``, the logits of the committed shardax LoRA export (PEFT format).

The adapter directory tests/fixtures/lora/adapter is written by shardax
(``python tests/test_lora.py``: tests/fixtures/hf/llama_gqa with rank-4 adapters whose B
factors are fixed random values). This script, run in a separate environment with torch,
transformers and peft (never installed by `make test`):

    python3 -m venv /work/venv-lora
    /work/venv-lora/bin/pip install torch transformers peft
    /work/venv-lora/bin/python tests/reference/make_lora_fixtures.py

loads it with ``peft.PeftModel.from_pretrained(AutoModelForCausalLM(llama_gqa), adapter)`` and
writes ``peft_logits.npz``: the reference ``tokens`` [2, 16] of llama_gqa and peft's float32
``logits`` for them, which tests/test_lora.py compares with shardax's adapter-applied logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import peft
import torch
import transformers

HERE = Path(__file__).resolve().parents[1] / "fixtures"


def main() -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(HERE / "hf" / "llama_gqa",
                                                             dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, HERE / "lora" / "adapter")
    model.eval()
    tokens = np.load(HERE / "hf" / "llama_gqa" / "reference.npz")["tokens"]
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.numpy()
        with model.disable_adapter():
            plain = model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(logits - plain).max() > 1e-2, "the adapters do not act"
    np.savez(HERE / "lora" / "peft_logits.npz", tokens=tokens, logits=logits)
    print("peft_logits.npz: max |logit|", float(np.abs(logits).max()), "adapter effect",
          float(np.abs(logits - plain).max()))


if __name__ == "__main__":
    main()
