"""Preference batches for DPO, SimPO and ORPO: pairs sampled by step, and their reference file.

`preference_inputs` reads ``--data`` (`shardax.data.preference_data`: records with ``prompt``,
``chosen``, ``rejected``), encodes them into chosen and rejected rows and returns the run's
`shardax.train.inputs.Inputs`. `PreferenceBatches` gives the batch of a step as a pure function
of ``(seed, step)`` (each epoch visits every pair once, in an order drawn from ``(seed,
epoch)``, as `shardax.data.chat_data.ChatBatches`), ``--batch-size`` pairs: ``(inputs,
labels, completion_mask, reference)``, ``2B`` rows, the chosen sequences then the rejected ones,
and each row's reference log-probability (`shardax.train.post.preference_step`).

The reference log-probabilities of every row are computed once and kept in the run directory
(``reference_logps.json``, written atomically); a resumed run reads them back
(`read_reference`) and refuses a file made from other data.

Example::

    inputs = preference_inputs(run, run_dir)
    inputs.train.reference = reference            # [2N] float32, chosen rows first
    inputs_, labels, mask, ref = inputs.train.batch(0)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardax.data.chat import ChatTemplate
from shardax.data.lm_data import EpochOrder, check_same
from shardax.data.preference_data import PreferenceRows, encode_preferences, read_preferences
from shardax.distributed import batch_part
from shardax.errors import UsageError
from shardax.filecheck import read_json
from shardax.filewrite import write_text
from shardax.train.inputs import Inputs, checked_tokenizer
from shardax.train.resolve import Resolved
from shardax.train.rundir import RunDir

__all__ = ["REFERENCE_FILE", "PreferenceBatches", "preference_inputs", "read_reference",
           "write_reference"]

#: The reference log-probabilities' file in the run directory.
REFERENCE_FILE = "reference_logps.json"


class PreferenceBatches:
    """Deterministic, resumable batches of preference pairs; this process's rows of each
    (the rows its devices hold: ``process_index`` of ``process_count`` equal blocks of the
    ``2B`` rows). ``reference``: each row's reference log-probability (zeros until set).

    Example::

        data = PreferenceBatches(rows, batch_size=8, seed=0)
        inputs, labels, mask, reference = data.batch(3)       # each 16 rows
    """

    def __init__(self, rows: PreferenceRows, batch_size: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1):
        if (2 * batch_size) % process_count:
            raise ValueError(f"{2 * batch_size} rows are not divisible by {process_count} "
                             "processes")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.pairs = len(rows.inputs) // 2
        self.seq_len = rows.inputs.shape[1]
        self.reference = np.zeros(2 * self.pairs, np.float32)
        self.step = 0
        self._order = EpochOrder(self.pairs, seed)

    def local(self, index: np.ndarray) -> tuple[np.ndarray, ...]:
        """This process's block of the global rows ``index``: ``(inputs, labels, mask,
        reference)``."""
        size = len(index) // self.process_count
        mine = index[self.process_index * size:(self.process_index + 1) * size]
        r = self.rows
        return r.inputs[mine], r.labels[mine], r.completion_mask[mine], self.reference[mine]

    def batch(self, step: int) -> tuple[np.ndarray, ...]:
        """This process's ``(inputs, labels, completion_mask, reference)`` for ``step``."""
        n = self.pairs
        pairs = self._order(range(step * self.batch_size, (step + 1) * self.batch_size))
        return self.local(np.concatenate([pairs, pairs + n]))

    def chunks(self, rows: int) -> Iterator[tuple[tuple[np.ndarray, ...], int]]:
        """Every row in order, ``rows`` at a time (the last chunk padded with row 0): this
        process's ``(inputs, labels, mask)`` of each and how many of its rows are real."""
        total = 2 * self.pairs
        for start in range(0, total, rows):
            index = np.arange(start, start + rows)
            yield self.local(np.where(index < total, index, 0))[:3], min(rows, total - start)

    def fingerprint(self) -> str:
        """A hash of every row's tokens and completion mask (what the reference depends on)."""
        digest = hashlib.sha256()
        for a in (self.rows.inputs, self.rows.labels, self.rows.completion_mask):
            digest.update(np.ascontiguousarray(a).tobytes())
        return digest.hexdigest()

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: the next step, plus the settings it depends on."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_pairs": self.pairs}

    def restore(self, state: dict[str, Any]) -> PreferenceBatches:
        """Continues from ``state()``; the process count may differ from the saving run."""
        check_same(state, self.state(), ("seed", "seq_len", "batch_size", "num_pairs"))
        self.step = int(state["step"])
        return self


def write_reference(path: Path, data: PreferenceBatches, logps: np.ndarray) -> None:
    """Writes the reference log-probabilities of ``data``'s rows to ``path`` atomically (JSON:
    float32 values round-trip exactly)."""
    write_text(path, json.dumps({"pairs": data.pairs, "seq_len": data.seq_len,
                                 "data_sha256": data.fingerprint(),
                                 "logps": [float(x) for x in logps]}) + "\n")


def read_reference(path: Path, data: PreferenceBatches) -> np.ndarray:
    """The reference log-probabilities saved for ``data``; a missing, damaged or other data's
    file is a one-line `UsageError` naming it."""
    try:
        saved = read_json(path, limit=64 * 2**20 + 40 * 2 * data.pairs)
        logps = np.asarray(saved["logps"], np.float32)
        fits = (saved["pairs"] == data.pairs and saved["seq_len"] == data.seq_len
                and saved["data_sha256"] == data.fingerprint() and logps.shape == (2 * data.pairs,))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--resume: {path}: unreadable reference log-probabilities ({e}); "
                         "start the run again") from None
    if not fits:
        raise UsageError(f"--resume: {path} holds the reference log-probabilities of other "
                         f"data ({saved['pairs']} pairs, --seq-len {saved['seq_len']}) than "
                         "--data now gives; resume with the run's own --data and --seq-len")
    return logps


def preference_inputs(run: Resolved, run_dir: RunDir) -> Inputs:
    """The tokenizer and preference batches of a resolved run (nothing is written); bad data
    is a one-line `DataError` / `UsageError` naming the file and record."""
    config, mesh = run.config, run.mesh
    tokenizer = checked_tokenizer(config, run_dir, run.model_config.vocab_size)
    records = [r for path in config.data for r in read_preferences(path)]
    template = None
    if any(isinstance(r["prompt"], list) for r in records):
        directory = getattr(tokenizer, "directory", None)
        if directory is None:
            raise UsageError("--data: conversational preference records ('messages' lists) "
                             "are rendered with the tokenizer's chat template: pass "
                             "--tokenizer DIR (a Hugging Face tokenizer with a chat_template)")
        try:
            template = ChatTemplate(directory)
        except ValueError as e:
            raise UsageError(f"--tokenizer {config.tokenizer}: {e}") from None
    rows = encode_preferences(records, tokenizer, config.seq_len, template)
    if rows.inputs.max() >= tokenizer.vocab_size:
        raise UsageError(f"--data: token id {rows.inputs.max()} is outside the vocabulary of "
                         f"{tokenizer.vocab_size}")
    sharding = jax.sharding.NamedSharding(
        mesh.mesh, run.rules.spec_for(("batch", "length"), mesh.mesh))
    part, parts = batch_part(sharding, (2 * config.batch_size, config.seq_len))
    if jax.process_index() == 0:
        print(f"preference data: {len(records)} pairs from {' '.join(config.data)}; "
              f"{rows.truncated} sequences longer than --seq-len {config.seq_len} truncated "
              "(their end kept)")
    batches = PreferenceBatches(rows, config.batch_size, config.seed, part, parts)
    return Inputs(tokenizer, batches, [], sharding, 2 * config.batch_size)
