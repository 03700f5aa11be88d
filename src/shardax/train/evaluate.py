"""``shardax eval``: loss, perplexity and bits per byte of a model on held-out files.

Each ``--data`` entry (a file or directory, any format ``train --data`` takes; of a Hugging
Face ``datasets`` folder, the ``--data-split`` split, ``validation`` by default) is tokenized
with the run's tokenizer (or the ``--from`` model's) and packed as training packs it; its
tokens are scored in windows of ``seq_len + 1`` that start ``seq_len`` apart, so every token
but the first is predicted once, from up to ``seq_len`` tokens before it (the last, partial
window is padded and masked). The sums of the next-token negative log-likelihoods (float32
log-softmax of the model's plain forward logits, `sequence_logps`) are computed on the mesh
with one compiled program and added up per entry in float64 on the host:

- ``loss``: mean NLL in nats per token; ``perplexity``: ``exp(loss)``;
- ``bits_per_byte``: total NLL / ln 2 / UTF-8 bytes of the entry's text (None for token
  files, whose text is unknown), comparable across tokenizers.

>>> evaluate("runs/a", ["held_out.txt"], seq_len=128)  # doctest: +SKIP
[{'data': 'held_out.txt', 'tokens': 4095, 'loss': 1.52, 'perplexity': 4.57, ...}]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import jax
import numpy as np
from flax import nnx

from shardax import layout
from shardax.data.lm_data import TokenStream, open_data
from shardax.data.readers import list_data_files, read_pieces
from shardax.data.tokenizer import Tokenizer, run_tokenizer
from shardax.errors import UsageError
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.config import EvalConfig, check_eval
from shardax.train.generate import load_hf, restore_model
from shardax.train.post.objectives import sequence_logps
from shardax.train.resolve import make_mesh
from shardax.train.rundir import RunDir, check_run

__all__ = ["evaluate", "evaluate_files", "load_model", "windows"]


def windows(tokens: TokenStream | np.ndarray, seq_len: int, first: int = 0,
            count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, mask)``: int32 ``[count, seq_len + 1]`` windows ``first`` onwards of
    ``tokens``, window ``i`` starting at token ``i * seq_len`` (zero-padded past the end), and
    the float32 ``[count, seq_len]`` mask of the targets ``rows[:, 1:]`` that are real tokens.
    All the windows (``count`` None) hold every token but the first once as a target.

    >>> rows, mask = windows(np.arange(6), 3)
    >>> rows.tolist(), mask.tolist()
    ([[0, 1, 2, 3], [3, 4, 5, 0]], [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    """
    stream = tokens if isinstance(tokens, TokenStream) else TokenStream([np.asarray(tokens)])
    n = len(stream)
    total = _window_count(n, seq_len)
    count = total - first if count is None else count
    rows = np.zeros((count, seq_len + 1), np.int32)
    mask = np.zeros((count, seq_len), np.float32)
    for i in range(min(count, total - first)):
        start = (first + i) * seq_len
        length = min(seq_len + 1, n - start)
        rows[i, :length] = stream.rows(np.array([start]), length)[0]
        mask[i, :length - 1] = 1.0
    return rows, mask


def _window_count(tokens: int, seq_len: int) -> int:
    """How many windows of `windows` cover ``tokens`` tokens (each token but the first a
    target once)."""
    return max(math.ceil((tokens - 1) / seq_len), 0)


def _text_bytes(path: str, text_field: str, token_dtype: str | None,
                split: str = "train") -> int | None:
    """UTF-8 bytes of the text of a ``--data`` entry (of a datasets folder, its ``split``);
    None when it holds token files."""
    total = 0
    for file in list_data_files([path], token_dtype, split):
        if file.kind == "tokens":
            return None
        for piece in read_pieces(file, text_field):
            text = piece.text
            total += len(text.encode("utf-8") if isinstance(text, str) else text)
    return total


def _nll(graphdef, lay, state, rows, mask):
    """Summed next-token NLL and token count of a batch of windows, the model run under
    the `Layout` ``lay`` (its attention implementation)."""
    model = nnx.merge(graphdef, state)
    logits = layout.forward.logits(model, lay, rows[:, :-1])
    logps, counts = sequence_logps(logits, rows[:, 1:], mask)
    return -logps.sum(), counts.sum()


def load_model(config: EvalConfig, run_dir: RunDir | None = None
               ) -> tuple[nnx.Module, Tokenizer, MeshShardingHelper, list, layout.Layout]:
    """``(model, tokenizer, mesh, rules, layout)`` of a checked config: the ``--from`` model or
    ``--out``'s checkpoint (``--step``) sharded on ``--mesh`` by the fsdp_tp preset's rules,
    and the `Layout` to run it with (the run's attention implementation)."""
    mesh = make_mesh(config.mesh or f"dp={jax.device_count()}")
    rules = layout.presets.resolve(layout.PRESETS["fsdp_tp"], dict(mesh.mesh.shape))
    lay = layout.Layout()
    if config.source is not None:
        model, tokenizer, _ = load_hf(config.source, mesh, rules)
    else:
        run_dir = run_dir or check_run(config.out, config.step)
        tokenizer = run_tokenizer(run_dir.out, run_dir.saved.tokenizer)
        _, model, _ = restore_model(run_dir, config.step, config.mesh, rules)
        lay = layout.Layout(attention=run_dir.saved.attention)  # as the run trained
    return model, tokenizer, mesh, rules, lay


def evaluate_files(config: EvalConfig, run_dir: RunDir | None = None) -> list[dict]:
    """``shardax eval --data`` for a checked config: one dict per ``--data`` entry with ``data``,
    ``tokens`` (scored), ``nll`` (summed, nats), ``loss``, ``perplexity``, ``bytes`` and
    ``bits_per_byte`` (module docstring). ``run_dir``: what `check_run` returned for
    ``--out`` (read here if not given)."""
    model, tokenizer, mesh, rules, lay = load_model(config, run_dir)
    vocab = model.config.vocab_size
    graphdef, state = nnx.split(model)
    batch_spec = LogicalAxisRules(rules).spec_for(("batch", "length"), mesh.mesh)
    rows_sharding = jax.sharding.NamedSharding(mesh.mesh, batch_spec)
    # under the rules, as training runs: the model's activation constraints apply (plain
    # jax.jit left the activations' layout to the partitioner, ~1.8x slower on fsdp=8)
    step = mesh.sjit(partial(_nll, graphdef, lay),
                     in_shardings=(LogicalAxisRules(rules), batch_spec, batch_spec),
                     out_shardings=None)
    split = math.prod(mesh.mesh.shape[a] for a in jax.tree.leaves(tuple(batch_spec)[:1]))
    batch = -(-config.batch_size // split) * split  # rows divide over the batch axes
    results = []
    for path in config.data:
        stream = open_data([path], tokenizer, config.text_field, config.token_dtype,
                           split=config.data_split)
        sums = []
        # batches read one at a time: host memory stays flat in the file's size
        for first in range(0, _window_count(len(stream), config.seq_len), batch):
            rows, mask = windows(stream, config.seq_len, first, batch)
            if rows.max() >= vocab:
                raise UsageError(f"--data {path}: token id {rows.max()} is outside the model's "
                                 f"vocabulary of {vocab}; this model needs its own tokenizer")
            sums.append(step(state, jax.device_put(rows, rows_sharding),
                             jax.device_put(mask, rows_sharding)))
        # added up in float64 on the host, after the last batch is dispatched
        nll = float(np.sum([float(t) for t, _ in sums], dtype=np.float64))
        tokens = sum(int(c) for _, c in sums)
        size = _text_bytes(path, config.text_field, config.token_dtype, config.data_split)
        loss = nll / tokens if tokens else float("nan")
        results.append({"data": path, "tokens": tokens, "nll": nll, "loss": loss,
                        "perplexity": math.exp(loss) if tokens else float("nan"),
                        "bytes": size,
                        "bits_per_byte": nll / math.log(2) / size if size else None})
    return results


def evaluate(out: str | None = None, data: Sequence[str] = (), *, source: str | None = None,
             seq_len: int = 128, batch_size: int = 8, mesh: str | None = None,
             step: int | None = None, text_field: str = "text",
             data_split: str = "validation") -> list[dict]:
    """Loss, perplexity and bits per byte of each of ``data`` (files or directories) under the
    newest good checkpoint of run directory ``out`` (or checkpoint ``step``), or the Hugging
    Face model ``source`` (``'hf:DIR'``), on ``mesh`` (default ``dp=<all devices>``); of a
    ``datasets`` folder, its ``data_split``: `evaluate_files` of an `EvalConfig`.

    Example::

        [r] = evaluate("runs/a", ["held_out.txt"], mesh="fsdp=4,tp=2")
        print(r["loss"], r["perplexity"], r["bits_per_byte"])
    """
    config = check_eval(EvalConfig(data=list(data), out=out, source=source, seq_len=seq_len,
                                   batch_size=batch_size, mesh=mesh, step=step,
                                   text_field=text_field, data_split=data_split))
    return evaluate_files(config)
