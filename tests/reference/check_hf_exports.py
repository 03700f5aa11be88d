"""Loads shardax exports in transformers and compares them with the fixtures' references.

Run in the reference environment (torch + transformers, see make_hf_fixtures.py), with pairs
of a fixture directory (holding ``reference.npz``) and the directory shardax exported it to:

    /work/hfref/bin/python tests/reference/check_hf_exports.py FIXTURE EXPORT [FIXTURE EXPORT ...]

For each pair, ``AutoModelForCausalLM.from_pretrained(EXPORT)`` must give the reference logits
(within 1e-4 of the largest, float32) and the same 32 greedy tokens per prompt; it prints one
line per pair and exits 1 if any differs. ``tests/test_hf.py`` runs it when
``SHARDAX_HF_REFERENCE_PYTHON`` names that environment's python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import transformers

REL = 1e-4


def check(fixture: Path, export: Path) -> bool:
    ref = np.load(fixture / "reference.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    model.eval()
    tokens = torch.from_numpy(ref["tokens"].astype(np.int64))
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        seq = tokens
        for _ in range(ref["greedy"].shape[1] - tokens.shape[1]):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    err = float(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max())
    same = bool((seq.numpy() == ref["greedy"]).all())
    ok = err <= REL and same
    print(f"{fixture.name}: {type(model).__name__} rel logits error {err:.2e}, greedy "
          f"{'identical' if same else 'DIFFERENT'}: {'ok' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    args = [Path(a) for a in sys.argv[1:]]
    if not args or len(args) % 2:
        sys.exit("usage: check_hf_exports.py FIXTURE EXPORT [FIXTURE EXPORT ...]")
    results = [check(f, e) for f, e in zip(args[::2], args[1::2])]
    sys.exit(0 if all(results) else 1)
