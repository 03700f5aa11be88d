"""lm-evaluation-harness tasks on a sharded shardax model (``shardax eval --tasks``).

`ShardaxLM` is lm-eval's ``LM`` over a restored model, its tokenizer and a mesh, built as
lm-eval's ``TemplateLM`` (what its ``HFLM`` is built on): a (context, continuation) pair is
encoded whole and split where the context's tokens end, an empty context is the
``prefix_token_id`` (the tokenizer's BOS, else its end-of-text id), and contexts longer than
``max_length`` lose their oldest tokens. The three request types run on the mesh:

- ``loglikelihood``: the sum of the continuation's token log-probabilities (float32
  log-softmax of the plain forward's logits, jitted with the parameters sharded) and whether
  greedy decoding would give the continuation; rows are right-padded to a power-of-two width
  and the batch to ``batch_size`` rows, so few shapes compile;
- ``loglikelihood_rolling``: the same over lm-eval's disjoint rolling windows
  (``get_rolling_token_windows`` with ``context_len=1``), added up per text;
- ``generate_until``: greedy decoding with the KV cache (`shardax.models.decode`), ending at
  the end-of-text id or ``max_gen_toks`` and cut at the first ``until`` string; each batch is
  ``batch_size - 1`` requests and filler rows, one of them a power-of-two wide, so the prompt
  shapes are few (the filler rows run to ``max_gen_toks``, as rows that end at an ``until``
  string, which the decoder does not know, do anyway).

`run_tasks` runs ``--tasks`` (lm-eval names, or tasks from ``--include-path`` YAML files)
through ``lm_eval.simple_evaluate``. This module imports lm-eval (the optional extra
``shardax[eval]``); nothing in the core imports it.

Example::

    lm = ShardaxLM(*load_model(check_eval(EvalConfig(out="runs/a", tasks=["arc_easy"]))))
    results = lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], limit=50)
"""

from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import lm_eval
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window
from lm_eval.utils import make_table as _make_table

from shardax import layout
from shardax.data.tokenizer import Tokenizer
from shardax.errors import UsageError
from shardax.filewrite import write_text
from shardax.mesh import MeshShardingHelper
from shardax.models import decode
from shardax.rules import LogicalAxisRules
from shardax.train.config import EvalConfig
from shardax.train.evaluate import load_model
from shardax.train.post.objectives import sequence_logps
from shardax.train.rundir import RunDir

__all__ = ["ShardaxLM", "evaluate_tasks", "make_table", "run_tasks", "task_manager"]

_MIN_WIDTH = 16  # narrowest padded row: short requests share one compiled shape


def _scores(graphdef, lay, state, tokens, targets, mask):
    """Per row: the summed log-probability of the masked ``targets`` and whether each of them
    is the model's likeliest token."""
    logits = layout.forward.logits(nnx.merge(graphdef, state), lay, tokens)
    logps, _ = sequence_logps(logits, targets, mask)
    greedy = (jnp.argmax(logits, axis=-1) == targets) | (mask == 0)
    return logps, greedy.all(axis=-1)


class ShardaxLM(TemplateLM):
    """lm-eval's ``LM`` for a shardax model (module docstring): ``model`` sharded on ``mesh``
    by ``rules`` (a preset rule list), run with ``lay``; ``batch_size`` requests per forward
    pass (rounded up to a multiple of the mesh axes the batch is split over); ``max_length``
    tokens at most per row (default: the model's ``max_seq_len``); ``max_gen_toks``: new tokens
    of a generation that does not say.

    Example::

        lm = ShardaxLM(model, tokenizer, mesh, rules, batch_size=16)
        lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)
    """

    def __init__(self, model: nnx.Module, tokenizer: Tokenizer, mesh: MeshShardingHelper,
                 rules: list, lay: layout.Layout | None = None, batch_size: int = 8,
                 max_length: int | None = None, max_gen_toks: int = 256):
        super().__init__()
        self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
        self.rules = LogicalAxisRules(rules)
        self.layout = lay or layout.Layout()
        self.max_length = max_length or model.config.max_seq_len
        self.max_gen_toks = max_gen_toks
        spec = self.rules.spec_for(("batch", "length"), mesh.mesh)
        self._rows_sharding = jax.sharding.NamedSharding(mesh.mesh, spec)
        split = math.prod(mesh.mesh.shape[a] for a in jax.tree.leaves(tuple(spec)[:1]))
        self.batch_size = -(-batch_size // split) * split
        self._graphdef, self._state = nnx.split(model)
        self._step = mesh.sjit(partial(_scores, self._graphdef, self.layout),
                               in_shardings=(self.rules, spec, spec, spec),
                               out_shardings=None)  # under the rules, as `evaluate` runs

    def use(self, model: nnx.Module) -> ShardaxLM:
        """Scores ``model`` from now on: the same architecture with its parameters sharded
        alike (e.g. the train state of a later step, merged without copying); the compiled
        forward is reused."""
        self.model = model
        self._state = nnx.split(model)[1]
        return self

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.prefix[0] if self.tokenizer.prefix else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string``; its BOS (the tokenizer's prefix) only when
        ``add_special_tokens`` is True (``HFLM``'s default for causal models leaves it out)."""
        ids = self.tokenizer.encode_pieces([string])[0].tolist()
        return [*self.tokenizer.prefix, *ids] if add_special_tokens else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` of each ``(key, context_ids, continuation_ids)``."""
        rows = []
        for _, context, continuation in requests:
            whole = [*context, *continuation][-(self.max_length + 1):]
            if max(whole) >= self.model.config.vocab_size:
                raise UsageError(f"token id {max(whole)} is outside the model's vocabulary of "
                                 f"{self.model.config.vocab_size}")
            rows.append((whole, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # like widths together
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for first in range(0, len(order), self.batch_size):
            batch = order[first:first + self.batch_size]
            width = min(max(_MIN_WIDTH, 1 << (len(rows[batch[0]][0]) - 2).bit_length()),
                        self.max_length)
            tokens = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), np.float32)
            for r, i in enumerate(batch):
                whole, n = rows[i]
                tokens[r, :len(whole) - 1] = whole[:-1]
                targets[r, :len(whole) - 1] = whole[1:]
                mask[r, len(whole) - 1 - n:len(whole) - 1] = 1.0
            put = partial(jax.device_put, device=self._rows_sharding)
            logps, greedy = self._step(self._state, put(tokens), put(targets), put(mask))
            logps, greedy = np.asarray(logps), np.asarray(greedy)
            for r, i in enumerate(batch):
                out[i] = (float(logps[r]), bool(greedy[r]))
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, after the prefix token, over lm-eval's
        disjoint rolling windows of ``max_length`` tokens."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, 1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled when a request's ``do_sample`` is true), each up to
        its ``max_gen_toks`` tokens, ending at end-of-text and cut before its first ``until``
        string."""
        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        out = [""] * len(requests)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            keep = max(self.max_length - new, 1)  # HFLM's left truncation of the context
            prompts = {n: self.tok_encode(requests[n].args[0])[-keep:] or [self.prefix_token_id]
                       for n in indices}
            indices = sorted(indices, key=lambda n: -len(prompts[n]))
            rows = max(self.batch_size - 1, 1)
            for first in range(0, len(indices), rows):
                batch = indices[first:first + rows]
                ids = [prompts[n] for n in batch]
                if self.batch_size > 1:  # filler rows, one a power-of-two wide: few shapes
                    width = min(max(_MIN_WIDTH, 1 << (len(ids[0]) - 1).bit_length()), keep)
                    ids += [[self.prefix_token_id] * width] * (self.batch_size - len(ids))
                got = decode.generate(self.model, ids, new,
                                      temperature=temperature, stop_ids=[self.eot_token_id],
                                      mesh=self.mesh, rules=self.rules,
                                      attention=self.layout.attention)
                for n, new_ids, stopped in zip(batch, got.tokens, got.stopped):
                    text = self.tok_decode(new_ids[:-1] if stopped else new_ids)
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return out


def make_table(results: dict) -> str:
    """lm-eval's metric table(s) of ``results`` (per task, then per group if any)."""
    table = _make_table(results)
    return table + ("\n" + _make_table(results, "groups") if results.get("groups") else "")


def _task_manager(config: EvalConfig) -> TaskManager:
    """lm-eval's task index: ``--include-path``'s tasks alone when they are all ``--tasks``
    names (indexing lm-eval's own ~15,000 tasks takes about 40 s), else lm-eval's too."""
    if config.include_path is not None:
        local = TaskManager(include_path=config.include_path, include_defaults=False)
        if all(local.match_tasks([task]) for task in config.tasks):
            return local
    return TaskManager(include_path=config.include_path)


def task_manager(config: EvalConfig, name: str = "--tasks") -> TaskManager:
    """lm-eval's task index for ``config.tasks``, each name checked to be in it (a
    `UsageError` naming the flag ``name`` and the task if not)."""
    manager = _task_manager(config)
    for task in config.tasks:
        if not manager.match_tasks([task]):
            where = (f"in lm-eval or {config.include_path}" if config.include_path else
                     "in lm-eval (local task YAMLs need --include-path DIR)")
            raise UsageError(f"{name} {task}: no such task {where}")
    return manager


def evaluate_tasks(lm: ShardaxLM, config: EvalConfig, manager: TaskManager) -> dict:
    """lm-eval's results (``simple_evaluate``) of ``config.tasks`` on ``lm``, with the
    config's ``num_fewshot`` and ``limit`` (from 1 up: a count of examples)."""
    limit = config.limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    return lm_eval.simple_evaluate(model=lm, tasks=list(config.tasks),
                                   num_fewshot=config.num_fewshot, limit=limit,
                                   batch_size=config.batch_size, task_manager=manager,
                                   log_samples=False)


def run_tasks(config: EvalConfig, run_dir: RunDir | None = None) -> dict:
    """lm-eval's results (``simple_evaluate``) of ``--tasks`` for a checked config, written
    as JSON to ``--output-path`` when given (atomically, that file only, by process 0)."""
    manager = task_manager(config)
    lm = ShardaxLM(*load_model(config, run_dir), batch_size=config.batch_size)
    results = evaluate_tasks(lm, config, manager)
    if config.output_path is not None and jax.process_index() == 0:
        write_text(config.output_path, json.dumps(results, indent=2, ensure_ascii=False,
                                                  default=handle_non_serializable) + "\n")
    return results
