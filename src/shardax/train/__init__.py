"""Training: data, checkpoints, the train step and the ``shardax train`` loop."""

from shardax.train.checkpoint import Checkpointer, CorruptCheckpointError, Restored, abstract_state
from shardax.train.data import (
    SEPARATOR,
    DataError,
    TokenBatches,
    TokenStream,
    default_corpus,
    load_bytes,
    load_splits,
    open_data,
    split_tokens,
    val_batches,
)
from shardax.train.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "Restored",
    "abstract_state",
    "SEPARATOR",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "TokenBatches",
    "TokenStream",
    "Tokenizer",
    "default_corpus",
    "load_bytes",
    "load_splits",
    "load_tokenizer",
    "open_data",
    "split_tokens",
    "val_batches",
]
