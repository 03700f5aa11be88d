"""``shardax generate``: sample text from a run's checkpoint, without its training data.

The run directory is only read: its ``config.json`` says which model to build, and the newest
good checkpoint (or ``step``) is opened read-only, so sampling from a run that is still
training never disturbs it (no clean-up of the trainer's in-flight save, nothing written). The
directory may have been moved or copied: paths are taken relative to the ``out`` given here,
never from ``config.json``. A damaged newest checkpoint is skipped with a note on stderr.

>>> print(generate("runs/a", prompt="def ", max_tokens=40))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from shardax import hf, layout
from shardax.mesh import MeshShardingHelper
from shardax.models import decode
from shardax.models.lora import merge_lora
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train import build
from shardax.train.checkpoint import Checkpointer, CorruptCheckpointError, restore_state
from shardax.train.config import GenerateConfig, UsageError, check_generate, hf_dir
from shardax.train.resolve import make_mesh, model_config, optimizer
from shardax.train.rundir import RunDir, check_run, pipelined
from shardax.train.tokenizer import (
    BYTES,
    Tokenizer,
    has_tokenizer,
    load_tokenizer,
    run_tokenizer,
)

__all__ = ["generate", "restore_model", "sample"]


def _note(message: str) -> None:
    print(f"shardax generate: {message}", file=sys.stderr, flush=True)


def restore_model(run_dir: RunDir, step: int | None = None, mesh_spec: str | None = None,
                  rules: Any = None, attention: str | None = None
                  ) -> tuple[Any, nnx.Module, MeshShardingHelper]:
    """``(model_config, model, mesh)`` of checkpoint ``step`` (default: the newest good one) of
    a checked run directory (`check_run`), read-only, without the run's parallelism flags.
    ``mesh_spec`` defaults to ``dp=<all devices>`` with the model replicated; with ``rules``
    (a preset list) the parameters are restored sharded by them instead. ``attention``
    replaces the run's ``--attention``."""
    config = run_dir.saved
    if attention is not None:
        config = dataclasses.replace(config, attention=attention)
    # A pipelined run saved its layers stacked, which the model keeps.
    init_dir = None if config.init_from is None else hf_dir(config.init_from, "--init-from")
    model = model_config(config, Policy.from_string(config.precision), init_dir,
                         pipelined=pipelined(config.mesh))
    mesh = make_mesh(mesh_spec or f"dp={jax.device_count()}")
    graphdef, state_shape = build.abstract(model, optimizer(config)[0], config.seed, mesh)
    if rules is None:
        shardings = jax.tree.map(
            lambda _: jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec()),
            state_shape)
    else:
        shardings = mesh.match_sharding_rule(LogicalAxisRules(rules), state_shape)

    def skipped(bad: int, why: str) -> None:
        _note(f"checkpoint step {bad} is unusable, trying the one before: {why}")

    try:
        with Checkpointer(run_dir.checkpoints, read_only=True) as reader:
            _, state = restore_state(reader, state_shape, shardings, step=step,
                                     fallback=step is None, on_skip=skipped)
    except CorruptCheckpointError as e:
        raise UsageError(f"--out {run_dir.out}: no usable checkpoint: {e}") from None
    return model, nnx.merge(graphdef, state.params, state.rest), mesh


def sample(config: GenerateConfig, run_dir: RunDir | None = None,
           stats: dict | None = None) -> list[str]:
    """``shardax generate`` for a checked config: each prompt (``--prompt``, then
    ``--prompts``) followed by ``--max-tokens`` sampled tokens. ``run_dir``: what `check_run`
    returned for ``--out`` (read here if not given). ``stats``, if given, receives
    ``tokens``, ``seconds`` and ``tokens_per_s``."""
    prompts = [config.prompt, *config.prompts]
    if config.source is not None:
        directory = hf_dir(config.source, "--from")
        mesh = MeshShardingHelper.from_string(f"dp={jax.device_count()}")
        try:  # the model first: a damaged directory is one error line, no note before it
            model = hf.load_model(directory, mesh, rules=LogicalAxisRules(layout.PRESETS["dp"]),
                                  attention=config.attention or "auto")
            found = has_tokenizer(directory)
            if not found:
                _note(f"note: {directory} has no tokenizer.json: prompts and output are raw "
                      "UTF-8 bytes (token id = byte value)")
            tokenizer = load_tokenizer(directory if found else BYTES)
        except ValueError as e:
            raise UsageError(f"--from {config.source}: {e}") from None
    else:
        run_dir = run_dir or check_run(config.out, config.step)
        try:
            tokenizer = run_tokenizer(run_dir.out, run_dir.saved.tokenizer)
        except ValueError as e:
            raise UsageError(f"--out {config.out}: {e}") from None
        _, model, _ = restore_model(run_dir, config.step, attention=config.attention)
        merge_lora(model)  # LoRA adapters folded in once, not per token
    return _sample(model, tokenizer, prompts, config.max_tokens, config.temperature,
                   config.seed, stats)


def generate(out: str | None, prompt: str | Sequence[str] = "", max_tokens: int = 200,
             temperature: float = 0.8, seed: int = 0, step: int | None = None, *,
             source: str | None = None, stats: dict | None = None,
             attention: str | None = None) -> str | list[str]:
    """The ``prompt`` followed by ``max_tokens`` tokens sampled from the newest good checkpoint
    in run directory ``out`` (or checkpoint ``step``), or from the Hugging Face model ``source``
    (``'hf:DIR'``); ``temperature`` 0 takes the likeliest token. Text goes through the run's
    tokenizer (bytes, or its copy of a Hugging Face tokenizer), or the ``tokenizer.json`` of
    ``source`` (bytes when it has none). ``attention``: the implementation to sample with
    (default: the run's). Several prompts (a list) are sampled as one batch with
    the KV cache and give a list of texts: `sample` of a `GenerateConfig`.

    >>> generate(None, ["def ", "class "], 32, source="hf:llama")  # doctest: +SKIP
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    config = check_generate(GenerateConfig(
        out=out, source=source, prompt=prompts[0] if prompts else "", prompts=prompts[1:],
        max_tokens=max_tokens, temperature=temperature, seed=seed, step=step,
        attention=attention))
    texts = sample(config, stats=stats)
    return texts[0] if isinstance(prompt, str) else texts
def _sample(model: nnx.Module, tokenizer: Tokenizer, prompts: list[str], max_tokens: int,
            temperature: float, seed: int, stats: dict | None) -> list[str]:
    """Sampling with the KV cache (``shardax.models.decode``): each prompt followed by its new
    tokens. An empty prompt conditions on a newline that is not part of the output."""
    ids, skips = [], []
    for text in prompts:
        encoded, skip = tokenizer.encode(text), 0
        if not encoded:
            encoded = tokenizer.encode("\n")
            skip = len(encoded)
        ids.append(encoded)
        skips.append(skip)
    vocab = model.config.vocab_size
    if any(t >= vocab for row in ids for t in row):
        raise UsageError(f"the prompt has token ids >= the model's vocab_size {vocab}; this "
                         "model needs its own tokenizer")
    out = decode.generate(model, ids, max_tokens, temperature=temperature, seed=seed)
    if stats is not None:
        n = sum(map(len, out.tokens))
        stats.update(tokens=n, seconds=out.prefill_s + out.decode_s,
                     tokens_per_s=out.tokens_per_s)
    return [tokenizer.decode([*row_ids, *new][skip:])
            for row_ids, new, skip in zip(ids, out.tokens, skips)]
