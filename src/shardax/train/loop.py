"""``shardax train``: the training loop, with checkpoints, resume and preemption.

A run directory holds ``config.json`` (the effective config), ``metrics.jsonl`` (one JSON
object per logged step), ``loss.png``, ``plan.json`` (what the compiled step holds and moves
per device: ``shardax plan`` predicts it), ``checkpoints/``, with ``--log-to`` a
``tensorboard/`` or ``wandb/`` folder, with ``--profile-steps`` a ``profile/`` trace and, with
a Hugging Face ``--tokenizer``, a copy of it in ``tokenizer/`` (what ``generate`` decodes
with). Everything that decides the numbers (model, seed, data order, optimizer state, step) is
in the checkpoint, so ``--resume`` continues bit for bit, on the same mesh or, resharded, on
another one.

``prepare`` checks everything it can before anything is written (a `UsageError` names the
flag or file); ``train`` runs the loop. SIGTERM or a first Ctrl-C finishes the current step,
saves it and raises `Stopped` (the CLI exits with 128 + the signal number); a second Ctrl-C
aborts at once.

>>> metrics = train(TrainConfig(steps=20, out="runs/demo"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardax.distributed import batch_part
from shardax.mesh import MeshShardingHelper
from shardax.train import build, report
from shardax.train import data as data_lib
from shardax.train.checkpoint import Checkpointer, CorruptCheckpointError, Restored, list_steps
from shardax.train.config import (
    CONFIG_FILE,
    TrainConfig,
    UsageError,
    check_resume,
    load_run_config,
)
from shardax.train.generate import generate
from shardax.train.mfu import device_spec, flops_per_token
from shardax.train.profiler import StepProfiler, parse_profile_steps
from shardax.train.step import eval_loss, make_schedule
from shardax.train.stop import Stopped, StopRequests
from shardax.train.tokenizer import TOKENIZER_DIR, Tokenizer, load_tokenizer, run_tokenizer

__all__ = ["CHECKPOINT_DIR", "Stopped", "TrainConfig", "UsageError", "check_run_dir",
           "generate", "prepare", "train"]

CHECKPOINT_DIR = "checkpoints"
PROFILE_DIR = "profile"
#: Where ``--resume`` moves committed steps newer than the one it continues from (damaged
#: ones, or those past ``--resume-step``), so that the run can save those steps again.
SET_ASIDE_DIR = "checkpoints-set-aside"


def _os_reason(e: OSError) -> str:
    return e.strerror or str(e)


def _check_out(out: Path) -> None:
    """``--out`` is, or can become, a writable directory (nothing is left behind here)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--out {out}: {existing} is a file, not a directory")
    try:  # an unnamed temporary file: what may be written here, nothing left behind
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write in {existing} ({_os_reason(e)})") from None


@dataclass
class RunDir:
    """What ``check_run_dir`` found in ``--out``: the saved config and the checkpoints."""

    out: Path
    saved: TrainConfig | None
    committed: list[int]
    uncommitted: list[int]

    @property
    def checkpoints(self) -> Path:
        return self.out / CHECKPOINT_DIR


def check_run_dir(config: TrainConfig) -> RunDir:
    """Checks ``--out`` against ``--resume`` using the file system only (no JAX, no writes):
    a fresh run never reuses a directory with checkpoints; a resumed one needs a committed
    checkpoint, a readable ``config.json`` and the same fixed settings."""
    out = Path(config.out)
    _check_out(out)
    try:
        committed, uncommitted = list_steps(out / CHECKPOINT_DIR)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot read {out / CHECKPOINT_DIR} "
                         f"({_os_reason(e)})") from None
    ckpt_dir = out / CHECKPOINT_DIR
    if not config.resume:
        if committed or uncommitted:
            raise UsageError(f"{out} already holds checkpoints of another run (steps "
                             f"{sorted(committed + uncommitted)}); pass --resume to continue "
                             "it or choose another --out")
        return RunDir(out, None, committed, uncommitted)
    if not committed:
        half = (f" (steps {uncommitted} were never committed: a save was interrupted)"
                if uncommitted else "")
        raise UsageError(f"--resume: no checkpoint in {ckpt_dir}{half}; start a new run "
                         "without --resume and another --out")
    if not (out / CONFIG_FILE).exists():
        raise UsageError(f"--resume: {out} has checkpoints but no {CONFIG_FILE}; it is not a "
                         "shardax run")
    saved = load_run_config(out)
    check_resume(saved, config)
    if config.resume_step is not None and config.resume_step not in committed:
        raise UsageError(f"--resume-step {config.resume_step}: not a committed checkpoint in "
                         f"{ckpt_dir} (committed steps: {committed})")
    usable = [s for s in committed if s <= (config.resume_step or math.inf)]
    if min(usable) > config.steps:
        raise UsageError(f"--steps {config.steps}: the run is already at step {max(usable)}; "
                         f"pass --steps {max(usable)} or more to continue it")
    return RunDir(out, saved, committed, uncommitted)


@dataclass
class _Run(build.Resolved):
    """What ``prepare`` resolved from a config: the pieces the loop needs."""

    tokenizer: Tokenizer
    train_data: data_lib.TokenBatches
    val_data: list
    out: Path
    run_dir: RunDir | None = None


def _load_tokens(config: TrainConfig, tokenizer: Tokenizer):
    """The (train, val) token streams of ``--data``, tokenized ahead of training (into the
    token cache, once) and checked to hold a window and a validation batch."""
    log = print if jax.process_index() == 0 else None
    try:
        train, val = data_lib.load_splits(config.data, tokenizer, config.text_field,
                                          config.token_dtype, log=log)
        data_lib.check_splits(len(train), len(val), config.seq_len, config.batch_size,
                              data=config.data)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.strerror:  # name the file (or the flag's paths)
            raise UsageError(f"--data {e.filename or ' '.join(config.data)}: "
                             f"{e.strerror}") from None
        raise UsageError(str(e)) from None  # DataError: already names --data and the file
    return train, val


def _tokenizer(config: TrainConfig, model_vocab: int) -> Tokenizer:
    """``--tokenizer`` (resuming: the run's copy of it, if any), checked to fit the model: the
    model's vocabulary (its preset's ``vocab_size``) must hold every id of the tokenizer."""
    from shardax import models

    try:
        tokenizer = (run_tokenizer(config.out, config.tokenizer) if config.resume
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


def prepare(config: TrainConfig) -> _Run:
    """Checks the config against the machine and builds the run; bad input is a UsageError.
    Nothing is written."""
    run_dir = check_run_dir(config)
    resolved = build.resolve(config)
    mesh, rules = resolved.mesh, resolved.rules
    tokenizer = _tokenizer(config, resolved.model_config.vocab_size)

    train_tokens, val_tokens = _load_tokens(config, tokenizer)
    try:
        # Each process reads only the rows its devices hold (all of them if a model axis spans
        # the processes); with one process that is the whole batch.
        part, parts = batch_part(
            jax.sharding.NamedSharding(mesh.mesh, rules.spec_for(("batch", "length"), mesh.mesh)),
            (config.batch_size, config.seq_len))
        batches = data_lib.TokenBatches(
            train_tokens, config.seq_len, config.batch_size, seed=config.seed,
            process_index=part, process_count=parts, vocab_size=tokenizer.vocab_size)
        num_val = min(4, data_lib.count_batches(len(val_tokens), config.seq_len,
                                                config.batch_size))
        val = data_lib.val_batches(
            val_tokens, config.seq_len, config.batch_size, num_batches=num_val,
            process_index=part, process_count=parts)
    except ValueError as e:
        raise UsageError(f"data: {e}") from None
    return _Run(**vars(resolved), tokenizer=tokenizer, train_data=batches, val_data=val,
                out=run_dir.out, run_dir=run_dir)


def _note(message: str) -> None:
    if jax.process_index() == 0:
        print(f"shardax train: {message}", file=sys.stderr, flush=True)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _check_extra(restored: Restored) -> None:
    data = restored.extra.get("data")
    if not isinstance(data, dict) or "step" not in data:
        raise CorruptCheckpointError(
            f"checkpoint step {restored.step}: its extra metadata has no data position "
            f"(keys {sorted(restored.extra)}); it was not written by shardax train")


def _resume(run: _Run, state_shape: Any, shardings: Any) -> tuple[int, Any]:
    """Restores the newest good checkpoint, skipping damaged ones with a note (or exactly
    ``--resume-step``)."""
    config, ckpt_dir = run.config, run.out / CHECKPOINT_DIR

    def skipped(step: int, why: str) -> None:
        _note(f"checkpoint step {step} is unusable, trying the one before: {why}")

    try:
        with Checkpointer(ckpt_dir, read_only=True) as reader:
            restored, state = build.restore(reader, state_shape, shardings,
                                            step=config.resume_step,
                                            fallback=config.resume_step is None,
                                            check=_check_extra, on_skip=skipped)
    except CorruptCheckpointError as e:
        which = (f"--resume-step {config.resume_step}" if config.resume_step is not None
                 else "--resume: no usable checkpoint; the oldest one")
        raise UsageError(f"{which} failed its checks: {e}") from None
    start = restored.step
    if start > config.steps:
        raise UsageError(f"--steps {config.steps}: the run is already at step {start}; pass "
                         f"--steps {start} or more to continue it")
    try:
        run.train_data.restore(restored.extra["data"])
    except ValueError as e:
        raise UsageError(f"--resume: checkpoint step {start}: {e}") from None
    return start, state


def _tidy_checkpoints(run: _Run, start: int) -> None:
    """Before the first save of a resumed run: committed steps newer than ``start`` (damaged,
    or past ``--resume-step``) move to ``checkpoints-set-aside/``; half-written step folders
    (never loadable) are deleted. Process 0 does it; all wait for it."""
    ckpt_dir = run.out / CHECKPOINT_DIR
    committed, uncommitted = list_steps(ckpt_dir)
    newer = [s for s in committed if s > start]
    if jax.process_index() == 0:
        if newer:
            aside = run.out / SET_ASIDE_DIR
            aside.mkdir(exist_ok=True)
            for s in newer:
                dest = aside / str(s)
                n = 1
                while dest.exists():
                    dest, n = aside / f"{s}.{n}", n + 1
                (ckpt_dir / str(s)).rename(dest)
            _note(f"moved checkpoint steps {newer} (newer than step {start}, which this run "
                  f"continues from) to {aside}; delete them when you no longer need them")
        for s in uncommitted:
            shutil.rmtree(ckpt_dir / str(s), ignore_errors=True)
        if uncommitted:
            _note(f"removed half-written checkpoint steps {uncommitted} (never committed)")
    _sync("shardax-tidy-checkpoints")


def _write_config(run: _Run) -> None:
    """Creates ``--out`` and writes ``config.json`` (process 0): the first write of a run."""
    try:
        run.out.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            text = json.dumps(run.config.to_json(), indent=2) + "\n"
            tmp = run.out / f".{CONFIG_FILE}.tmp"
            tmp.write_text(text)
            tmp.replace(run.out / CONFIG_FILE)  # never a half-written config.json
            run.tokenizer.save(run.out / TOKENIZER_DIR)
    except OSError as e:
        raise UsageError(f"--out {run.out}: cannot write there ({_os_reason(e)})") from None


def train(config: TrainConfig, run: _Run | None = None) -> list[dict]:
    """Runs (or resumes) training; returns the metric records written to ``metrics.jsonl``.

    Raises `UsageError` for bad input (before writing anything) and `Stopped` after saving
    the step at which SIGTERM or Ctrl-C stopped it."""
    run = run or prepare(config)
    with StopRequests() as stop:
        return _train(run, stop)


def _train(run: _Run, stop: StopRequests) -> list[dict]:
    config, mesh, rules = run.config, run.mesh, run.rules
    is_main = jax.process_index() == 0
    graphdef, state_shape = build.abstract(run.model_config, run.tx, config.seed, mesh)
    shardings = mesh.match_sharding_rule(rules, state_shape)
    metrics_log = report.MetricsLog(run.out / "metrics.jsonl")
    if config.resume:
        start, state = _resume(run, state_shape, shardings)
        records = metrics_log.read(up_to=start, quiet=not is_main)
        if start == config.steps:
            _note(f"the run is already at step {start} = --steps; nothing to do (pass a larger "
                  "--steps to train on)")
            return records
        _tidy_checkpoints(run, start)
    elif config.init_from is not None:
        state = build.create_from_hf(config, run.model_config, run.tx, mesh, rules)
        start, records = 0, []
    else:
        init = mesh.sjit(lambda: build.create(run.model_config, run.tx, config.seed)[1],
                         out_shardings=rules)
        state, start, records = init(), 0, []
    # Every check passed: from here on the run directory is written.
    _write_config(run)
    if is_main:
        metrics_log.start(records)

    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    step_fn = build.step_function(run, graphdef)
    eval_fn = mesh.sjit(partial(eval_loss, graphdef=graphdef, policy=run.policy),
                        in_shardings=(rules, batch_spec))

    def to_global(batch):
        return _global_batch(mesh, batch, batch_spec, config.batch_size)

    first = to_global(run.train_data.batch(start))
    plan = step_fn.plan(state, first)
    if is_main:  # what the compiled step holds and moves per device (`shardax plan` predicts it)
        (run.out / "plan.json").write_text(plan.to_json() + "\n")
    n_params = sum(x.size for x in jax.tree.leaves(state_shape["params"]))
    if is_main:
        print(f"shardax train: {config.model} ({n_params / 1e6:.2f}M params) on "
              f"{jax.device_count()} devices, mesh {mesh.shape}, rules {config.rules!r}, "
              f"precision {run.policy}")
        if mesh.shape.get("fsdp", 1) > 1:
            print(build.fsdp_summary(run.fsdp_mode, config))
        if mesh.shape.get("pp", 1) > 1:
            print(build.pipeline_summary(run.model_config, mesh.shape["pp"]))
        print(plan.where(lambda row: row.kind == "input" and "/params/" in f"/{row.path}/"))

    ckpt = Checkpointer(run.out / CHECKPOINT_DIR, max_to_keep=3)

    def save(step: int) -> None:
        position = {**run.train_data.state(), "step": step}
        ckpt.save(step, build.flat(state), extra={"data": position, "config": config.to_json()},
                  force=True)

    per_token = flops_per_token(run.model_config, config.seq_len)
    peak = _peak_flops(config)
    if is_main:
        print(f"model FLOPs per token {per_token:.3g} (6N + 12·L·d·T); peak "
              + (f"{peak / 1e12:.0f} TFLOP/s per device: MFU reported" if peak else
                 "FLOP/s unknown: MFU n/a (pass --peak-tflops to report it)"))
    trackers = report.Trackers(config.log_to, run.out, config.to_json()) if is_main else None
    schedule = make_schedule(config.optimizer, config.lr, config.steps, warmup=config.steps // 20)
    clock = report.StepClock(config.batch_size * config.seq_len, start, per_token, peak,
                             jax.device_count())
    profiler = StepProfiler(parse_profile_steps(config.profile_steps), run.out / PROFILE_DIR)
    try:
        with report.Progress(config.steps, start) as progress:
            for step in range(start, config.steps):
                batch = first if step == start else to_global(run.train_data.batch(step))
                done = step + 1
                profiler.before(done)
                state, metrics = step_fn(state, batch)
                profiler.after(done, (state, metrics))
                record: dict[str, Any] = {}
                if done % config.log_every == 0 or done in (config.steps, start + 1):
                    record = {"step": done, **clock.measure(done, metrics),
                              "lr": float(schedule(step)), **report.memory_in_use()}
                if done % config.eval_every == 0 or done == config.steps:
                    val = [float(eval_fn(state, to_global(b))) for b in run.val_data]
                    record = {"step": done, **record, "val_loss": float(np.mean(val))}
                if record:
                    records.append(record)
                    if is_main:
                        metrics_log.append(record)
                        trackers.log(record)
                progress.update(done, record if is_main else None)
                saved = done % config.ckpt_every == 0 or done == config.steps
                if saved:
                    save(done)
                if done < config.steps and stop.reached(done):
                    if not saved:
                        save(done)
                    ckpt.wait()  # synchronous: committed before the process exits
                    raise Stopped(done, stop.signum)
    finally:  # an interrupted run still finishes (or abandons) its in-flight save
        profiler.stop()
        ckpt.close()
        if trackers is not None:
            trackers.close()
    if is_main:
        png = report.plot(run.out, records)
        print(f"wrote {metrics_log.path}{f', {png}' if png else ''} and checkpoints in "
              f"{run.out / CHECKPOINT_DIR}")
    return records


def _peak_flops(config: TrainConfig) -> float | None:
    """Peak FLOP/s of one device: ``--peak-tflops``, else the device table's entry (None on a
    CPU or an unknown device: MFU is then n/a)."""
    if config.peak_tflops:
        return config.peak_tflops * 1e12
    device = jax.devices()[0]
    spec = device_spec(device.device_kind)
    return spec.peak_flops if spec and device.platform != "cpu" else None


def _global_batch(mesh: MeshShardingHelper, batch: tuple, spec: Any, rows: int) -> tuple:
    """Each process's rows -> one global array of ``rows`` rows per batch field, sharded like
    ``spec``."""
    sharding = jax.sharding.NamedSharding(mesh.mesh, spec)
    return tuple(
        jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:])) for x in batch
    )
