"""Training: data, checkpoints, the train step and the ``shardax train`` loop.

Modules, one job each: ``config`` (the `TrainConfig` / `GenerateConfig` dataclasses and their
checks), ``build`` (mesh, rules, model config, optimizer and state shapes from a config),
``loop`` (the training loop), ``stop`` (SIGTERM / Ctrl-C), ``report`` (progress,
``metrics.jsonl``, ``loss.png``), ``generate`` (sampling from a run directory), ``step`` (the
train step), ``checkpoint`` and ``data``.
"""

from shardax.train.checkpoint import Checkpointer, CorruptCheckpointError, Restored, abstract_state
from shardax.train.data import (
    SEPARATOR,
    TokenBatches,
    default_corpus,
    list_text_files,
    load_bytes,
    split_tokens,
    val_batches,
)

__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "Restored",
    "abstract_state",
    "SEPARATOR",
    "TokenBatches",
    "default_corpus",
    "list_text_files",
    "load_bytes",
    "split_tokens",
    "val_batches",
]
