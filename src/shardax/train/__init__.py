"""Training: data, checkpoints, the train step and the ``shardax train`` loop."""

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
