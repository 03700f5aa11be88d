"""Compile one configuration in a fresh process (``shardax plan --search --jobs N`` runs these).

    python -m shardax.plan.worker '{"model": "llama-8b", "mesh": "fsdp=64", ...}' out.json [BYTES]

BYTES: the memory of one target device (`resolve`'s ``device_memory``). Writes the
``Compiled`` result as JSON to the output path; any failure is a non-zero exit
with the reason on stderr (a compiler crash only ends this process).
"""

import dataclasses
import json
import sys

from shardax.plan.estimate import compile_config, config_from_dict
from shardax.train.resolve import resolve

if __name__ == "__main__":
    fields, out = json.loads(sys.argv[1]), sys.argv[2]
    memory = float(sys.argv[3]) if len(sys.argv) > 3 else None
    try:
        compiled = compile_config(resolve(config_from_dict(fields), memory, weights=False))
    except Exception as e:
        print(f"shardax plan worker: {type(e).__name__}: {str(e).splitlines()[0]}",
              file=sys.stderr)
        sys.exit(1)
    with open(out, "w") as f:
        json.dump(dataclasses.asdict(compiled), f)
