"""Training: checkpoints, the train step and the ``shardax`` train/generate/eval/export
commands, on top of `shardax.data` (files into batches).

Sub-packages by concern, imports only going down the list:

- ``run``: the machinery around a run (checkpoints, fingerprints, the run lock, stopping,
  non-finite steps, profiler, progress and metrics, MFU, the compilation cache);
- this package's own modules, one job each: ``config`` (the command dataclasses and their
  checks), ``configfile`` (settings from a ``--config`` file), ``optimizers`` (``--optimizer``
  and its schedule), ``rundir`` (every path and check of a run directory), ``resolve`` (a
  config -> the resolved run, once), ``step`` (the train step and `TrainState`), ``balance``
  (MoE router bias), ``build`` (train state and compiled step of a resolved run), ``inputs``
  (tokenizer and sharded batches of a run), ``elastic`` (a config fitted to the devices left);
- ``post``: post-training objectives (DPO/SimPO/ORPO, GRPO) on top of the step;
- the commands: ``loop`` (``shardax train``), ``generate``, ``evaluate`` / ``harness`` /
  ``task_evals`` (``shardax eval``, lm-eval tasks), ``export``.
"""

from shardax.data.lm_data import (
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
from shardax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from shardax.train.run.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    Restored,
    abstract_state,
)

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
