"""Training: data, checkpoints, the train step and the ``shardax`` train/generate/export commands.

Modules, one job each: ``config`` (the command dataclasses and their checks), ``configfile``
(settings from a ``--config`` file), ``resolve`` (a config -> the resolved run, once),
``rundir`` (every path and check of a run directory), ``inputs`` (tokenizer and sharded
batches of a run), ``build`` (train state and compiled step of a resolved run), ``step``
(the train step and `TrainState`), ``optimizers`` (``--optimizer`` and its schedule, and
their defaults), ``checkpoint`` (sharded checkpoints and the train state's checkpoint format),
``fingerprint`` (what a checkpoint verifies its arrays against), ``orbax_logs`` (orbax's log
noise), ``loop`` (the training loop), ``notes`` (what a command tells the user), ``stop``
(SIGTERM / Ctrl-C), ``report`` and
``trackers`` (progress, ``metrics.jsonl``, ``loss.png``, TensorBoard / W&B), ``profiler``,
``mfu`` (model FLOPs), ``generate`` and ``export``, ``data`` / ``readers`` / ``encode`` /
``tokenizer`` (the data pipeline).
"""

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
