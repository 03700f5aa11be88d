"""``shardax train --objective grpo``: a GRPO run of `shardax.train.post.grpo` with checkpoints.

The prompts are the records of ``--data PROMPTS.jsonl``: a ``prompt`` string, or chat
``messages`` rendered by the tokenizer's chat template with the generation prompt (as TRL's
``apply_chat_template(..., add_generation_prompt=True)``); every other column goes to the
``--reward`` functions, as TRL passes a dataset's. The model is ``--model`` or
``--init-from hf:DIR``, LoRA or full, on any ``--mesh`` the train step supports; each step
samples ``--batch-size`` completions (``--batch-size / --group-size`` prompts) and takes
``--num-iterations`` optimizer steps (`shardax.train.post.grpo.train_grpo`). ``metrics.jsonl`` and
the trackers get TRL's metric names; checkpoints hold the same `TrainState` as any fine-tune
(so ``shardax export`` and ``generate`` read them) and the data position, and the prompt
order and sampling keys are functions of ``(--seed, step)``: ``--resume`` continues bit for
bit.

>>> records = train_grpo_run(TrainConfig(objective="grpo", reward=["r.py:f"],  # doctest: +SKIP
...                                      data=["prompts.jsonl"], out="runs/grpo"))
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import jax

from shardax import _compat
from shardax.data.chat import ChatTemplate, chat_messages
from shardax.data.tokenizer import BYTES, load_tokenizer
from shardax.errors import CorruptCheckpointError, UsageError
from shardax.filecheck import parse_json
from shardax.train import build
from shardax.train.config import TrainConfig, check
from shardax.train.inputs import checked_tokenizer
from shardax.train.post.grpo import GRPOConfig, reference_params, train_grpo
from shardax.train.post.rewards import RewardSet
from shardax.train.resolve import resolve
from shardax.train.run import report
from shardax.train.run.checkpoint import Checkpointer, Restored, flat, restore_state
from shardax.train.run.notes import note
from shardax.train.run.stop import Stopped, StopRequests
from shardax.train.rundir import RunDir, check_run_dir, tidy_checkpoints, write_config

__all__ = ["check_inputs", "grpo_settings", "read_prompts", "train_grpo_run"]


def grpo_settings(config: TrainConfig) -> GRPOConfig:
    """The `GRPOConfig` of a checked config: ``--batch-size`` counts completions, ``--beta``
    unset is GRPOConfig's (TRL's) 0.0.

    >>> grpo_settings(TrainConfig(batch_size=16, group_size=4)).prompts_per_step
    4
    """
    beta = GRPOConfig.beta if config.beta is None else config.beta
    return GRPOConfig(group_size=config.group_size,
                      prompts_per_step=config.batch_size // config.group_size,
                      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                      top_p=config.top_p, epsilon=config.epsilon, beta=beta,
                      num_iterations=config.num_iterations, seed=config.seed)


def read_prompts(path: str, tokenizer: str | None) -> list[dict]:
    """The records of a prompts ``.jsonl`` file, each with its prompt text under
    ``"prompt"``: a string as it is; chat ``messages`` (or TRL's conversational ``prompt``, a
    list of messages) rendered with the chat template of the ``tokenizer`` directory and the
    generation prompt. A one-line `UsageError` naming ``--data FILE:LINE`` otherwise."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror or e})") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--data {path}:{n}"
        record = parse_json(line, where)
        if not isinstance(record, dict):
            raise UsageError(f"{where}: not a JSON object")
        messages = record.get("prompt", record.get("messages"))
        if isinstance(messages, list):
            record = {**record, "prompt": _render(messages, tokenizer, where)}
        if not isinstance(record.get("prompt"), str):
            raise UsageError(f"{where}: a GRPO prompt record needs a 'prompt' string or chat "
                             f"'messages' (keys {sorted(record)})")
        records.append(record)
    if not records:
        raise UsageError(f"--data {path}: no prompt records")
    return records


def _render(messages: list, tokenizer: str | None, where: str) -> str:
    """A conversation as the prompt text of its next assistant turn."""
    if tokenizer in (None, BYTES):
        raise UsageError(f"{where}: chat messages need a chat template: pass --tokenizer DIR "
                         "(or --init-from hf:DIR) with one")
    try:
        messages = chat_messages({"messages": messages}, where)
        text = ChatTemplate(tokenizer).render(messages, add_generation_prompt=True)
        tok = load_tokenizer(tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # Tokenizer.encode puts its prefix (BOS) first: drop the template's, so the ids are
    # apply_chat_template's, with one BOS.
    lead = tok.decode(list(tok.prefix), skip_special_tokens=False) if tok.prefix else ""
    return text[len(lead):] if lead and text.startswith(lead) else text


def check_inputs(config: TrainConfig) -> tuple[list[dict], RewardSet]:
    """``(prompt records, rewards)`` of a checked grpo config, read before a backend starts:
    bad prompts or a reward that does not load is a one-line `UsageError`."""
    records = read_prompts(config.data[0], config.tokenizer)
    return records, RewardSet(config.reward, config.reward_weights or None)


_note = partial(note, "train")


def _check_extra(restored: Restored) -> None:
    data = restored.extra.get("data")
    if not isinstance(data, dict) or data.get("step") != restored.step:
        raise CorruptCheckpointError(
            f"checkpoint step {restored.step}: its extra metadata has no GRPO data position "
            f"(keys {sorted(restored.extra)}); it was not written by shardax train")


def _restore(config: TrainConfig, run_dir: RunDir, state_shape: Any, shardings: Any
             ) -> tuple[int, Any]:
    """``(GRPO step, state)`` of the newest good checkpoint (or ``--resume-step``)."""
    try:
        with Checkpointer(run_dir.checkpoints, read_only=True) as reader:
            restored, state = restore_state(
                reader, state_shape, shardings, step=config.resume_step,
                fallback=config.resume_step is None, check=_check_extra,
                on_skip=lambda s, why: _note(f"checkpoint step {s} is unusable, trying the "
                                             f"one before: {why}"))
    except CorruptCheckpointError as e:
        raise UsageError(f"--resume failed its checks: {e}") from None
    return restored.step, state


def train_grpo_run(config: TrainConfig, run_dir: RunDir | None, stop: StopRequests
                   ) -> list[dict]:
    """Runs (or resumes) ``--objective grpo``; returns the records of ``metrics.jsonl`` (one
    per GRPO step: ``step`` counts from 1, TRL's names, ``lr``). Called by
    `shardax.train.loop.train`, which holds the run lock and ``stop``."""
    if run_dir is None:
        config = check(config)
        run_dir = check_run_dir(config)
    records, rewards = check_inputs(config)
    settings = grpo_settings(config)
    is_main = jax.process_index() == 0
    with report.phase("starting the backend and resolving the run"):
        # the schedule counts optimizer steps: --num-iterations per GRPO step
        run = resolve(dataclasses.replace(config, steps=config.steps * settings.num_iterations))
    tokenizer = checked_tokenizer(config, run_dir, run.model_config.vocab_size)
    longest = max(len(tokenizer.encode(r["prompt"])) for r in records)
    limit = run.model_config.max_seq_len
    if longest + settings.max_new_tokens > limit:
        raise UsageError(f"--max-new-tokens {settings.max_new_tokens}: with the longest prompt "
                         f"of --data ({longest} tokens) it exceeds the model's max_seq_len "
                         f"{limit}")
    graphdef, state_shape = build.abstract(run.model_config, run.tx, config.seed, run.mesh)
    lora = run.model_config.lora is not None
    ref_params, start = None, 0
    metrics_log = report.MetricsLog(run_dir.metrics)
    if config.resume:
        start, state = _restore(config, run_dir, state_shape, run.shardings(state_shape))
        kept = metrics_log.read(up_to=start, quiet=not is_main)
        if is_main:
            print(f"shardax train: resumed from step {start} (checkpoint "
                  f"{run_dir.checkpoints / str(start)})", flush=True)
        if start >= config.steps:
            _note(f"the run is already at step {start} = --steps; nothing to do")
            return kept
        if is_main:
            tidy_checkpoints(run_dir, start, _note)
        _compat.sync_processes("shardax-tidy-checkpoints")
        if settings.beta != 0.0 and not lora:  # the KL reference is the initial policy
            ref_params = reference_params(build.initial_state(run).params, lora=False)
    else:
        with report.phase(f"loading {config.init_from}" if config.init_from is not None
                          else "initialising the model"):
            state, kept = build.initial_state(run), []
    write_config(run_dir, config, tokenizer, main=is_main)
    if is_main:
        metrics_log.start(kept)
        n_params = sum(x.size for x in jax.tree.leaves(state_shape.params))
        print(f"shardax train: GRPO of {config.init_from or config.model} ({n_params:,} "
              f"trainable parameters{', LoRA' if lora else ''}) on mesh {run.mesh.shape}: "
              f"{settings.prompts_per_step} of {len(records)} prompts x {settings.group_size} "
              f"completions of <= {settings.max_new_tokens} tokens per step, "
              f"{settings.num_iterations} update(s) each, beta {settings.beta:g}", flush=True)
    out = list(kept)
    trackers = report.Trackers(config.log_to, run_dir.out, config.to_json()) if is_main else None
    ckpt = Checkpointer(run_dir.checkpoints, max_to_keep=3)

    def on_step(step: int, state: Any, metrics: dict) -> None:
        done = step + 1
        record = {**metrics, "step": done,
                  "lr": float(run.schedule(done * settings.num_iterations - 1))}
        out.append(record)
        if is_main:
            metrics_log.append(record)
            trackers.log(record)
            print(f"shardax train: step {done}/{config.steps}  reward {record['reward']:.4g}  "
                  f"loss {record['loss']:.4g}", flush=True)
        stopping = done < config.steps and stop.reached(done)
        if done % config.ckpt_every == 0 or done == config.steps or stopping:
            ckpt.save(done, flat(state), extra={"data": {"step": done},
                                                "config": config.to_json()}, force=True)
        if stopping:
            ckpt.wait()
            raise Stopped(done, stop.signum)

    try:
        train_grpo(graphdef, state, tokenizer, records, rewards, tx=run.tx,
                   steps=config.steps - start, settings=settings, mesh=run.mesh,
                   rules=run.rules, layout=run.layout, policy=run.policy, lora=lora,
                   ref_params=ref_params, on_step=on_step)
    finally:
        ckpt.close()
        if trackers is not None:
            trackers.close()
    if is_main:
        report.finished(run_dir, out)
    return out
