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
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from shardax import hf, layout
from shardax.data.chat import ChatTemplate, chat_messages, chat_records
from shardax.data.tokenizer import (
    BYTES,
    Tokenizer,
    has_tokenizer,
    load_tokenizer,
    run_tokenizer,
)
from shardax.errors import CorruptCheckpointError, UsageError
from shardax.filecheck import read_json
from shardax.mesh import MeshShardingHelper
from shardax.models import decode
from shardax.models.lora import merge_lora
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train import build
from shardax.train.config import GenerateConfig, check_generate, hf_dir
from shardax.train.resolve import make_mesh, model_config, optimizer
from shardax.train.run.checkpoint import Checkpointer, restore_state
from shardax.train.run.notes import note
from shardax.train.rundir import RunDir, check_run

__all__ = ["Chat", "Sampler", "generate", "load_hf", "load_sampler", "restore_model", "sample"]


_note = partial(note, "generate")


def restore_model(run_dir: RunDir, step: int | None = None, mesh_spec: str | None = None,
                  rules: Any = None) -> tuple[Any, nnx.Module, MeshShardingHelper]:
    """``(model_config, model, mesh)`` of checkpoint ``step`` (default: the newest good one) of
    a checked run directory (`check_run`), read-only, without the run's parallelism flags
    (nor its ``--remat`` / ``--attention``: they are how it ran, not what it is).
    ``mesh_spec`` defaults to ``dp=<all devices>`` with the model replicated; with ``rules``
    (a preset list) the parameters are restored sharded by them instead."""
    config = run_dir.saved
    init_dir = None if config.init_from is None else hf_dir(config.init_from, "--init-from")
    model = model_config(config, Policy.from_string(config.precision), init_dir)
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


def load_hf(source: str, mesh: MeshShardingHelper | None = None, rules: Any = None
            ) -> tuple[nnx.Module, Tokenizer, Path]:
    """``(model, tokenizer, directory)`` of ``--from hf:DIR`` (or ``hf:ORG/NAME``, resolved
    once), sharded on ``mesh`` (default ``dp=<all devices>``) by ``rules`` (a preset list;
    default: replicated); the tokenizer is bytes when the directory has no ``tokenizer.json``
    (with a note)."""
    directory = hf_dir(source, "--from")
    mesh = mesh or MeshShardingHelper.from_string(f"dp={jax.device_count()}")
    try:  # the model first: a damaged directory is one error line, no note before it
        rules = LogicalAxisRules(rules or layout.PRESETS["dp"])
        model = hf.load_model(directory, mesh, rules=rules)
        found = has_tokenizer(directory)
        if not found:
            _note(f"note: {directory} has no tokenizer.json: prompts and output are raw "
                  "UTF-8 bytes (token id = byte value)")
        return model, load_tokenizer(directory if found else BYTES), directory
    except ValueError as e:
        raise UsageError(f"--from {source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Sampler:
    """What sampling needs, loaded once: the model, its tokenizer, the token ids that end a
    text (id -> what it is: ``'eos'``, ``'end of turn'``, ...), with ``--chat`` the chat
    template, and the attention implementation to sample with."""

    model: nnx.Module
    tokenizer: Tokenizer
    stops: dict[int, str]
    template: ChatTemplate | None
    attention: str = "auto"


def load_sampler(config: GenerateConfig, run_dir: RunDir | None = None) -> Sampler:
    """The `Sampler` of a checked config: the model of ``--from`` or of ``--out``'s newest good
    checkpoint (``--step``), its tokenizer, and its stop ids: the model's eos ids
    (``generation_config.json``'s ``eos_token_id``, the tokenizer's ``eos_token``) and, with
    ``--chat``, the template's end-of-turn tokens; the attention implementation is
    ``--attention`` (default: the run's ``--attention``; 'auto' with ``--from``). ``run_dir``:
    what `check_run` returned for ``--out`` (read here if not given)."""
    attention = config.attention or "auto"
    if config.source is not None:
        model, tokenizer, directory = load_hf(config.source)
    else:
        run_dir = run_dir or check_run(config.out, config.step)
        flag = f"--out {config.out}"
        try:
            tokenizer = run_tokenizer(run_dir.out, run_dir.saved.tokenizer)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
        init = run_dir.saved.init_from
        directory = None if init is None else hf_dir(init, "--init-from")
        _, model, _ = restore_model(run_dir, config.step)
        merge_lora(model)  # LoRA adapters folded in once, not per token
        attention = config.attention or run_dir.saved.attention
    stops = {tokenizer.eos_id: "end of text", **dict.fromkeys(_eos_ids(directory), "eos")}
    template = None
    if config.chat:
        template = _chat_template(tokenizer)
        stops.update(dict.fromkeys(template.end_of_turn(), "end of turn"))
    return Sampler(model, tokenizer, stops, template, attention)


def sample(config: GenerateConfig, run_dir: RunDir | None = None,
           stats: dict | None = None) -> list[str]:
    """``shardax generate`` for a checked config: each prompt (``--prompt``, then
    ``--prompts``) followed by up to ``--max-tokens`` sampled tokens, or with ``--chat`` /
    ``--messages`` the reply to each conversation. A text ends early at a stop id of
    `load_sampler`. ``stats``, if given, receives ``tokens``, ``seconds``, ``tokens_per_s``,
    and per prompt ``prompt_tokens``, ``counts`` (new tokens) and ``ends`` (the stop token's
    text, or None)."""
    sampler = load_sampler(config, run_dir)
    if sampler.template is not None:
        ids = [sampler.template.prompt(m) for m in _conversations(config)]
    else:
        ids = [sampler.tokenizer.encode(text) for text in [config.prompt, *config.prompts]]
    skip = not config.show_special_tokens
    return [sampler.tokenizer.decode(row, skip_special_tokens=skip)
            for row in _sample(sampler, ids, config, stats)]


class Chat:
    """``shardax generate --interactive``: a conversation with a model loaded once
    (`load_sampler`). Each `say` renders the whole conversation so far (``--system`` first)
    plus the new user message with the chat template, samples the reply (ending at
    end-of-turn or eos, as ``--chat``) and keeps it as the assistant turn.

    >>> chat = Chat(check_generate(GenerateConfig(source="hf:llama", interactive=True)))
    ... # doctest: +SKIP
    >>> chat.say("Count to three."), chat.say("And back?")  # doctest: +SKIP
    """

    def __init__(self, config: GenerateConfig, run_dir: RunDir | None = None):
        self.config = dataclasses.replace(config, chat=True)
        self.sampler = load_sampler(self.config, run_dir)
        self.reset()

    def reset(self) -> None:
        """Forgets the conversation (the system message stays)."""
        system = self.config.system
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.turns = 0

    def say(self, text: str, stats: dict | None = None) -> str:
        """The reply to user message ``text`` after the conversation so far (printable:
        special tokens as ``--show-special-tokens`` says); ``stats`` as `sample`'s."""
        messages = [*self.messages, {"role": "user", "content": text}]
        # each turn its own seed: the same seed would draw the same random numbers each turn
        config = dataclasses.replace(self.config, seed=(self.config.seed + self.turns) % 2**32)
        [new] = _sample(self.sampler, [self.sampler.template.prompt(messages)], config, stats)
        decode = self.sampler.tokenizer.decode
        self.messages = [*messages, {"role": "assistant",
                                     "content": decode(new, skip_special_tokens=True)}]
        self.turns += 1
        return decode(new, skip_special_tokens=not config.show_special_tokens)


def generate(out: str | None, prompt: str | Sequence[str] = "", max_tokens: int = 200,
             temperature: float = 0.8, seed: int = 0, step: int | None = None, *,
             source: str | None = None, stats: dict | None = None,
             attention: str | None = None, top_k: int = 0, top_p: float = 1.0,
             chat: bool = False) -> str | list[str]:
    """The ``prompt`` followed by ``max_tokens`` tokens sampled from the newest good checkpoint
    in run directory ``out`` (or checkpoint ``step``), or from the Hugging Face model ``source``
    (``'hf:DIR'``); ``temperature`` 0 takes the likeliest token. Text goes through the run's
    tokenizer (bytes, or its copy of a Hugging Face tokenizer), or the ``tokenizer.json`` of
    ``source`` (bytes when it has none). ``attention``: the implementation to sample with
    (default: the run's). ``top_k`` / ``top_p`` limit sampling to the likeliest tokens;
    ``chat`` sends each prompt as a user message through the tokenizer's chat template and
    returns the replies. Several prompts (a list) are sampled as one batch with the KV cache
    and give a list of texts: `sample` of a `GenerateConfig`.

    >>> generate(None, ["def ", "class "], 32, source="hf:llama")  # doctest: +SKIP
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    config = check_generate(GenerateConfig(
        out=out, source=source, prompt=prompts[0] if prompts else "", prompts=prompts[1:],
        max_tokens=max_tokens, temperature=temperature, seed=seed, step=step,
        attention=attention, top_k=top_k, top_p=top_p, chat=chat))
    texts = sample(config, stats=stats)
    return texts[0] if isinstance(prompt, str) else texts


def _sample(sampler: Sampler, ids: list[list[int]], config: GenerateConfig,
            stats: dict | None) -> list[list[int]]:
    """Sampling with the KV cache (``shardax.models.decode``): the token ids of each prompt
    followed by its new tokens (with ``--chat``, the new tokens only). An empty prompt
    conditions on a newline that is not part of the output."""
    model, tokenizer, stops = sampler.model, sampler.tokenizer, sampler.stops
    skips = []
    for r, row in enumerate(ids):
        skips.append(len(row) if config.chat else 0)
        if not row:
            ids[r] = tokenizer.encode("\n")
            skips[r] = len(ids[r])
    vocab = model.config.vocab_size
    if any(t >= vocab for row in ids for t in row):
        raise UsageError(f"the prompt has token ids >= the model's vocab_size {vocab}; this "
                         "model needs its own tokenizer")
    out = decode.generate(model, ids, config.max_tokens, temperature=config.temperature,
                          top_k=config.top_k, top_p=config.top_p, seed=config.seed,
                          stop_ids=[i for i in stops if i < vocab],
                          attention=sampler.attention)
    if stats is not None:
        stats.update(tokens=sum(map(len, out.tokens)), seconds=out.prefill_s + out.decode_s,
                     tokens_per_s=out.tokens_per_s, prompt_tokens=list(map(len, ids)),
                     counts=[len(t) for t in out.tokens],
                     ends=[_stop_name(tokenizer, new[-1], stops) if stopped else None
                           for new, stopped in zip(out.tokens, out.stopped)])
    return [[*row_ids, *new][cut:] for row_ids, new, cut in zip(ids, out.tokens, skips)]


def _stop_name(tokenizer: Tokenizer, token: int, stops: dict[int, str]) -> str:
    """``'end of turn <|eot_id|>'``: what a stop token is, and its text."""
    return f"{stops[token]} {tokenizer.decode([token], skip_special_tokens=False)!r}"


def _eos_ids(directory: Path | None) -> list[int]:
    """The ``eos_token_id`` (an int or a list) of ``generation_config.json`` in a Hugging Face
    model directory, as transformers' ``generate`` stops at them; [] without one."""
    path = None if directory is None else directory / "generation_config.json"
    if path is None or not os.path.lexists(path):
        return []
    try:
        eos = read_json(path)
    except ValueError as e:
        raise UsageError(str(e)) from None
    eos = eos.get("eos_token_id") if isinstance(eos, dict) else None
    eos = [eos] if isinstance(eos, int) else eos if eos is not None else []
    if not (isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                          and i >= 0 for i in eos)):
        raise UsageError(f"{path}: eos_token_id must be a token id or a list of them")
    return eos


def _chat_template(tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template of ``tokenizer``'s Hugging Face directory (a UsageError naming the
    flag when it has none)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        raise UsageError("--chat: the model's tokenizer is bytes, which has no chat template "
                         "(sample from a model with a Hugging Face tokenizer and template)")
    try:
        return ChatTemplate(directory)
    except ValueError as e:
        raise UsageError(f"--chat: {e}") from None


def _conversations(config: GenerateConfig) -> list[list[dict]]:
    """The conversations to reply to: ``--messages``' (a .json object or list, or a .jsonl
    file of them), else each prompt as a user message; ``--system`` goes first in each
    (replacing a system message there)."""
    path = config.messages
    try:
        if path is None:
            chats = [[{"role": "user", "content": text}]
                     for text in [config.prompt, *config.prompts]]
        elif not Path(path).is_file():
            raise UsageError(f"--messages {path}: no such file (or not a regular file)")
        elif path.endswith(".jsonl"):
            chats = [messages for _, messages in chat_records(path, "--messages")]
            if not chats:
                raise UsageError(f"--messages {path}: no conversation in the file")
        else:
            record = read_json(path)
            record = {"messages": record} if isinstance(record, list) else record
            chats = [chat_messages(record, f"--messages {path}")]
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e) if str(e).startswith("--messages") else
                         f"--messages {e}") from None
    if config.system is not None:
        system = {"role": "system", "content": config.system}
        chats = [[system, *(c[1:] if c[0].get("role") == "system" else c)] for c in chats]
    return chats
