"""The training inputs of a resolved run: its tokenizer and its sharded train/val batches.

`prepare_inputs` loads ``--tokenizer`` (resuming: the run's copy), checks that the model's
vocabulary holds it, tokenizes ``--data`` and ``--val-data`` (into the token cache, once),
holds out a validation split when there is no ``--val-data`` (none with ``--eval-every 0``; one
batch, or none, with a note, when a tenth of the data is short of a batch), and splits the
batches so that each process reads only the rows its devices hold. A ``--data`` with weights
(``PATH:WEIGHT``) is a mixture: one stream per entry, batches from `MixtureBatches`. Bad input is a
`UsageError` naming the flag or file. `Inputs.batch` and `Inputs.val_batches` give global
arrays sharded like the train step's batch.

>>> inputs = prepare_inputs(run, run_dir)                  # doctest: +SKIP
>>> inputs.batch(0)[0].shape                              # doctest: +SKIP
(16, 128)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax

from shardax import models
from shardax.data import lm_data as data_lib
from shardax.data.chat import ChatTemplate, chat_records, is_chat_file
from shardax.data.chat_data import ChatBatches, chat_val_batches, pack_chats
from shardax.data.mixture import weighted_entries
from shardax.data.mixture_data import MixtureBatches, source_names
from shardax.data.tokenizer import Tokenizer, load_tokenizer, run_tokenizer
from shardax.distributed import batch_part
from shardax.errors import UsageError
from shardax.train.config import TrainConfig
from shardax.train.resolve import Resolved
from shardax.train.run.notes import note
from shardax.train.rundir import RunDir

__all__ = ["Inputs", "checked_tokenizer", "holds_out", "prepare_inputs"]

#: validation batches per evaluation (fewer if the validation split is short)
VAL_BATCHES = 4


@dataclass
class Inputs:
    """A run's tokenizer and data: ``train`` and ``val`` hold this process's rows (``val``
    empty: no evaluation)."""

    tokenizer: Tokenizer
    # TokenBatches, ChatBatches, MixtureBatches or (shardax.train.post.preference_batches)
    # PreferenceBatches: batch(step), state(), restore()
    train: Any
    val: list
    sharding: jax.sharding.NamedSharding
    rows: int
    #: the ``--val-data`` source of each of ``val`` (`source_names`; None: one source)
    val_sources: list[str] | None = None

    def global_batch(self, local: tuple) -> tuple[jax.Array, ...]:
        """This process's rows of a batch -> one global array per field, ``rows`` rows,
        sharded like the train step's batch (a field of one value per row by its rows)."""
        row_only = jax.sharding.NamedSharding(self.sharding.mesh,
                                              jax.sharding.PartitionSpec(*self.sharding.spec[:1]))
        return tuple(jax.make_array_from_process_local_data(
            self.sharding if x.ndim > 1 else row_only, x, (self.rows, *x.shape[1:]))
            for x in local)

    def batch(self, step: int) -> tuple[jax.Array, ...]:
        """The global ``(inputs, targets)`` batch of ``step`` (0-based)."""
        return self.global_batch(self.train.batch(step))

    def val_batches(self) -> list[tuple[jax.Array, ...]]:
        """The global validation batches."""
        return [self.global_batch(b) for b in self.val]

    def position(self, step: int) -> dict[str, Any]:
        """The data state to save with checkpoint ``step`` (`restore` continues from it)."""
        if isinstance(self.train, MixtureBatches):
            return self.train.state(step)
        return {**self.train.state(), "step": step}

    def data_metrics(self, step: int) -> dict[str, int]:
        """``data/tokens/<source>`` of a weighted mixture after ``step`` steps ({}: none)."""
        return self.train.tokens_taken(step) if isinstance(self.train, MixtureBatches) else {}


def checked_tokenizer(config: TrainConfig, run_dir: RunDir, model_vocab: int) -> Tokenizer:
    """``--tokenizer`` (resuming: the run's copy of it, if any), checked to fit the model: the
    model's vocabulary (its preset's ``vocab_size``) must hold every id of the tokenizer."""
    try:
        tokenizer = (run_tokenizer(run_dir.out, config.tokenizer) if config.resume
                     else load_tokenizer(config.tokenizer))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if model_vocab < tokenizer.vocab_size:
        if config.init_from is not None:
            raise UsageError(
                f"--init-from {config.init_from} has a vocabulary of {model_vocab} tokens, fewer "
                f"than the {tokenizer.vocab_size} of --tokenizer {config.tokenizer}; pass the "
                "model's own tokenizer (--tokenizer with its directory)")
        fits = sorted(name for name, c in models.CONFIGS.items()
                      if c.vocab_size >= tokenizer.vocab_size)
        raise UsageError(
            f"--model {config.model} has a vocabulary of {model_vocab} tokens, fewer than the "
            f"{tokenizer.vocab_size} of --tokenizer {config.tokenizer}; choose a model whose "
            f"vocabulary holds it ({', '.join(fits) or 'none of the presets does'})")
    return tokenizer


_note = partial(note, "train")


def _open(paths: list[str], config: TrainConfig, tokenizer: Tokenizer, log: Any,
          name: str = "--data") -> Any:
    """All tokens of ``paths`` (no split); the built-in corpus's train files without paths."""
    if not paths:
        return data_lib.load_splits([], tokenizer, log=log)[0]
    split = config.data_split if name == "--data" else config.val_split
    try:
        return data_lib.open_data(paths, tokenizer, config.text_field, config.token_dtype, log,
                                  split)
    except data_lib.DataError as e:
        raise data_lib.DataError(str(e).replace("--data", name, 1)) from None


def _fit_split(config: TrainConfig, tokens: Any, say: bool = True) -> tuple[Any, Any]:
    """The automatic split of ``--data`` into (train, val): the last tenth, or, when that is
    short of one batch, exactly one batch if it leaves three quarters of the data to train on,
    else no validation at all (each with a one-line note unless not ``say``: the held-out
    part is not what validates) instead of refusing the run."""
    tell = _note if say else (lambda *a: None)
    train, val = data_lib.split_tokens(tokens)
    need = config.batch_size * config.seq_len + 1
    if data_lib.count_batches(len(val), config.seq_len, config.batch_size) >= 1:
        return train, val
    if len(tokens) < config.seq_len + 1:  # too short to train at all: `check_splits` says so
        return tokens, None
    if need <= len(tokens) // 4:
        tell(f"note: validation: the last {need:,} of the {len(tokens):,} tokens of --data (one "
             f"batch of --batch-size {config.batch_size} x --seq-len {config.seq_len} (+1); "
             "its last tenth is less than that)")
        return data_lib.split_tokens(tokens, need / len(tokens))
    tell(f"note: validation: skipped: --data holds {len(tokens):,} tokens, too few to hold out a "
         f"batch of --batch-size {config.batch_size} x --seq-len {config.seq_len} (+1) = "
         f"{need:,} and train on the rest; pass --val-data for a validation set, or "
         "--eval-every 0 to say so")
    return tokens, None


def _val_data(config: TrainConfig, tokenizer: Tokenizer, log: Any) -> Any:
    """The tokens of ``--val-data``, checked to hold one batch; of several entries that each
    hold a batch, a dict of each one's tokens by its `source_names` name (a validation loss
    per source; with a note, one stream of them all when one is short of a batch)."""
    if len(config.val_data) > 1:
        streams = {name: _open([path], config, tokenizer, log, "--val-data")
                   for name, path in zip(source_names(config.val_data), config.val_data)}
        short = [(name, len(t)) for name, t in streams.items()
                 if data_lib.count_batches(len(t), config.seq_len, config.batch_size) < 1]
        if not short:
            return streams
        _note(f"note: validation: --val-data {short[0][0]} holds {short[0][1]:,} tokens, fewer "
              f"than a batch of --batch-size {config.batch_size} x --seq-len {config.seq_len} "
              "(+1): one validation loss over all the --val-data entries, none per entry")
    val = _open(config.val_data, config, tokenizer, log, "--val-data")
    if data_lib.count_batches(len(val), config.seq_len, config.batch_size) < 1:
        raise UsageError(
            f"--val-data {' '.join(config.val_data)}: {len(val):,} tokens, fewer than "
            f"one batch of --batch-size {config.batch_size} x --seq-len "
            f"{config.seq_len} (+1) = {config.batch_size * config.seq_len + 1:,}; give "
            "more validation data or lower --batch-size or --seq-len")
    return val


def holds_out(config: TrainConfig) -> bool:
    """Whether a run trains on ``--data`` less a validation split it holds out itself (no
    ``--val-data``, ``--eval-every`` > 0). A resumed run keeps the split of the run it
    continues (its saved config), whatever its own ``--val-data`` says: validation data may
    be added, changed or removed on resume without changing the training batches.

    >>> holds_out(TrainConfig(data=["a.txt"])), holds_out(TrainConfig(val_data=["v.txt"]))
    (True, False)
    """
    return not config.val_data and config.eval_every > 0


def _unheld(config: TrainConfig) -> None:
    """The note of a resumed run that asks for validation the run never held out."""
    _note("note: validation: skipped: this run trains on all of --data (it was started with "
          "--val-data or --eval-every 0); pass --val-data for a validation set")


def _mixture_tokens(config: TrainConfig, tokenizer: Tokenizer,
                    entries: list[tuple[str, float]], log: Any,
                    split: bool) -> tuple[list, Any]:
    """Each source's training tokens and the validation tokens of a weighted mixture:
    ``--val-data``, nothing with ``--eval-every 0``, else each source's last tenth (a list,
    mixed by the same weights; none, with a note, when one is short of a window). ``split``:
    the run holds out those tenths (`holds_out` of the config it started with)."""
    streams = [_open([path], config, tokenizer, log) for path, _ in entries]
    held = None
    if split:
        splits = [data_lib.split_tokens(s) for s in streams]
        if all(len(v) > config.seq_len for _, v in splits):
            streams, held = [t for t, _ in splits], [v for _, v in splits]
        elif holds_out(config):
            _note(f"note: validation: skipped: the last tenth of a --data source holds fewer "
                  f"than --seq-len + 1 = {config.seq_len + 1} tokens; pass --val-data for a "
                  "validation set, or --eval-every 0 to say so")
    val = None
    if config.val_data:
        val = _val_data(config, tokenizer, log)
    elif config.eval_every:
        val = held
        if not split:
            _unheld(config)
    for (path, _), tokens in zip(entries, streams):
        data_lib.check_splits(len(tokens), 1 << 62, config.seq_len, config.batch_size,
                              data=[path])
    return streams, val


def _load_tokens(config: TrainConfig, tokenizer: Tokenizer,
                 entries: list[tuple[str, float]] | None = None,
                 split: bool | None = None) -> tuple[Any, Any]:
    """The (train, val) token streams (val None: no evaluation), tokenized ahead of training
    (into the token cache, once) and checked to hold a window and a validation batch:
    ``--val-data`` if given, nothing with ``--eval-every 0`` (all of ``--data`` trains), else
    an automatic split of ``--data`` (`_fit_split`) or the built-in corpus's val files.
    With weighted ``entries``: one training stream per entry (`_mixture_tokens`). ``split``:
    whether the run holds out part of ``--data`` (default `holds_out` of ``config``; a
    resumed run's is that of the run it continues)."""
    log = print if jax.process_index() == 0 else None
    split = holds_out(config) if split is None else split
    try:
        if entries is not None:
            return _mixture_tokens(config, tokenizer, entries, log, split)
        if not config.data:
            train, val = data_lib.load_splits([], tokenizer, log=log)
            val = None if config.eval_every == 0 else val
            if config.val_data:
                val = _val_data(config, tokenizer, log)
        elif split:
            train, val = _fit_split(config, _open(config.data, config, tokenizer, log),
                                    say=holds_out(config))
            if not holds_out(config):
                val = _val_data(config, tokenizer, log) if config.val_data else None
        else:
            train = _open(config.data, config, tokenizer, log)
            val = _val_data(config, tokenizer, log) if config.val_data else None
            if val is None and config.eval_every:
                _unheld(config)
        # a dict of --val-data sources: each already checked to hold a batch
        data_lib.check_splits(len(train), len(val) if val is not None
                              and not isinstance(val, dict) else 1 << 62,
                              config.seq_len, config.batch_size, data=config.data)
    except (OSError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        if isinstance(e, OSError) and e.strerror:  # name the file (or the flag's paths)
            raise UsageError(f"--data {e.filename or ' '.join(config.data)}: "
                             f"{e.strerror}") from None
        raise UsageError(str(e)) from None  # DataError: already names --data and the file
    return train, val


def _chat_inputs(config: TrainConfig, tokenizer: Tokenizer, part: int, parts: int
                 ) -> tuple[ChatBatches, list]:
    """Train and validation batches of chat data (every 10th conversation is held out; with
    fewer than 10, validation reuses the training conversations, with a note)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        raise UsageError("--data: chat records ('messages') are rendered with the tokenizer's "
                         "chat template: pass --tokenizer DIR (a Hugging Face tokenizer with "
                         "a chat_template in tokenizer_config.json)")
    log = print if jax.process_index() == 0 else (lambda *a: None)
    try:
        template = ChatTemplate(directory)
        records = [r for path in config.data
                   for r in chat_records(path, split=config.data_split)]
        held = records[9::10] if len(records) >= 10 else []
        train = [r for i, r in enumerate(records) if i % 10 != 9] if held else records
        rows = pack_chats([m for _, m in train], template, config.seq_len, tokenizer.eos_id,
                          config.loss_on, where=[w for w, _ in train])
        val_rows = (pack_chats([m for _, m in held], template, config.seq_len,
                               tokenizer.eos_id, config.loss_on, where=[w for w, _ in held])
                    if held else rows)
        if rows.tokens.max() >= tokenizer.vocab_size:
            raise ValueError(f"--data: token id {rows.tokens.max()} is outside the vocabulary "
                             f"of {tokenizer.vocab_size}")
        batches = ChatBatches(rows, config.batch_size, config.seed, part, parts)
        val = chat_val_batches(val_rows, config.batch_size, VAL_BATCHES, part, parts)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    log(f"chat data: {len(records)} conversations packed into {len(rows.tokens)} rows of "
        f"{config.seq_len + 1} tokens (loss on {config.loss_on} tokens); "
        f"{rows.truncated + (val_rows.truncated if held else 0)} longer than --seq-len "
        "truncated")
    if not held:
        log("note: fewer than 10 conversations: the validation loss is on the training "
            "conversations")
    return batches, val


def prepare_inputs(run: Resolved, run_dir: RunDir) -> Inputs:
    """The tokenizer and batches of a resolved run (nothing is written but the token cache)."""
    config, mesh = run.config, run.mesh
    tokenizer = checked_tokenizer(config, run_dir, run.model_config.vocab_size)
    entries = weighted_entries(config.data)
    if entries is None and config.data and all(is_chat_file(p, config.data_split)
                                               for p in config.data):
        sharding = jax.sharding.NamedSharding(
            mesh.mesh, run.rules.spec_for(("batch", "length"), mesh.mesh))
        part, parts = batch_part(sharding, (config.batch_size, config.seq_len))
        train, val = _chat_inputs(config, tokenizer, part, parts)
        return Inputs(tokenizer, train, val, sharding, config.batch_size)
    chat = [p for p, _ in entries or [] if is_chat_file(p, config.data_split)]
    if chat:
        raise UsageError(f"--data {chat[0]}: chat records ('messages') are not mixed by weight; "
                         "give text or token files with weights, or chat files without")
    started = run_dir.saved if config.resume and run_dir.saved is not None else config
    train_tokens, val_tokens = _load_tokens(config, tokenizer, entries, holds_out(started))
    sharding = jax.sharding.NamedSharding(
        mesh.mesh, run.rules.spec_for(("batch", "length"), mesh.mesh))
    try:
        # Each process reads only the rows its devices hold (all of them if a model axis spans
        # the processes); with one process that is the whole batch.
        part, parts = batch_part(sharding, (config.batch_size, config.seq_len))
        if entries is not None:
            return _mixture_inputs(config, tokenizer, entries, (train_tokens, val_tokens),
                                   sharding, (part, parts))
        batches = data_lib.TokenBatches(
            train_tokens, config.seq_len, config.batch_size, seed=config.seed,
            process_index=part, process_count=parts, vocab_size=tokenizer.vocab_size)
        val, sources = _val_rows(config, val_tokens, part, parts)
    except ValueError as e:
        raise UsageError(f"data: {e}") from None
    return Inputs(tokenizer, batches, val, sharding, config.batch_size, sources)


def _mixture_inputs(config: TrainConfig, tokenizer: Tokenizer, entries: list[tuple[str, float]],
                    tokens: tuple[list, Any], sharding: jax.sharding.NamedSharding,
                    split: tuple[int, int]) -> Inputs:
    """`Inputs` of a weighted mixture: `MixtureBatches` over the sources, validation on
    ``--val-data`` or on the sources' held-out tenths mixed by the same weights."""
    (train, val), (part, parts) = tokens, split
    paths, weights = [p for p, _ in entries], [w for _, w in entries]

    def mix(streams: list, log: Any = None) -> MixtureBatches:
        return MixtureBatches(list(zip(paths, streams)), weights, config.seq_len,
                              config.batch_size, seed=config.seed, process_index=part,
                              process_count=parts, vocab_size=tokenizer.vocab_size, log=log)

    say = (lambda m: print(f"shardax train: {m}", flush=True)) if jax.process_index() == 0 \
        else None
    batches = mix(train, say)
    sources = None
    if isinstance(val, list):
        held = mix(val)
        val_rows = [held.batch(i) for i in range(VAL_BATCHES)]
    else:
        val_rows, sources = _val_rows(config, val, part, parts)
    return Inputs(tokenizer, batches, val_rows, sharding, config.batch_size, sources)


def _val_rows(config: TrainConfig, tokens: Any, part: int, parts: int
              ) -> tuple[list, list[str] | None]:
    """This process's rows of up to `VAL_BATCHES` validation batches of ``tokens`` (None:
    none; a dict of sources: up to that many of each) and the source of each batch (None:
    one source)."""
    if tokens is None:
        return [], None
    if isinstance(tokens, dict):
        rows = {name: _val_rows(config, t, part, parts)[0] for name, t in tokens.items()}
        return ([b for batches in rows.values() for b in batches],
                [name for name, batches in rows.items() for _ in batches])
    return data_lib.val_batches(
        tokens, config.seq_len, config.batch_size,
        num_batches=min(VAL_BATCHES, data_lib.count_batches(
            len(tokens), config.seq_len, config.batch_size)),
        process_index=part, process_count=parts), None
