"""``shardax train``: the training loop of a prepared run, with checkpoints and preemption.

The run directory (`shardax.train.rundir`) gets ``config.json``, ``metrics.jsonl``,
``loss.png``, ``plan.json`` (what the compiled step holds and moves per device: ``shardax plan``
predicts it), ``checkpoints/`` and the trackers' and profiler's folders. Everything that decides
the numbers (model, seed, data order, optimizer state, step) is in the checkpoint, so
``--resume`` continues bit for bit, on the same mesh or, resharded, on another one.

`prepare` checks and resolves a config once (`check`, `check_run_dir`, `resolve`, the
``--objective``'s inputs: `shardax.train.post.objective_steps`; a `UsageError` names the flag or
file, nothing is written); `train` runs the loop with the objective's step. SIGTERM or a
first Ctrl-C finishes the current step, saves it and raises `Stopped` (the CLI exits with
128 + the signal number); a second Ctrl-C aborts at once. A step whose loss is not finite is
handled by ``--on-nan`` (`shardax.train.run.nonfinite`): by default `NonFinite` is raised without
saving it (the CLI exits with 3).

>>> metrics = train(TrainConfig(steps=20, out="runs/demo"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardax import _compat
from shardax.data.chat_data import ChatBatches
from shardax.data.tokenizer import BYTES
from shardax.devices import device_spec
from shardax.distributed import RESTART_ENV
from shardax.errors import CorruptCheckpointError, UsageError
from shardax.filecheck import read_json
from shardax.filewrite import write_text
from shardax.rulecheck import rule_findings
from shardax.train import balance, build
from shardax.train.config import TrainConfig, check
from shardax.train.inputs import Inputs
from shardax.train.post import grpo_run
from shardax.train.post.objective_steps import objective_of
from shardax.train.resolve import Resolved, resolve, schedule_change
from shardax.train.run import report
from shardax.train.run.checkpoint import Checkpointer, Restored, flat, restore_state
from shardax.train.run.fingerprint import fingerprints
from shardax.train.run.mfu import flops_per_token
from shardax.train.run.nonfinite import NonFinite, NonFiniteWatch
from shardax.train.run.notes import note
from shardax.train.run.profiler import StepProfiler, parse_profile_steps
from shardax.train.run.runlock import RunLock
from shardax.train.run.stop import Stopped, StopRequests
from shardax.train.rundir import RunDir, check_run_dir, tidy_checkpoints, write_config
from shardax.train.step import TrainState, eval_loss
from shardax.train.task_evals import TaskEvals
from shardax.utils import tree_path_to_string

__all__ = ["NonFinite", "Prepared", "Stopped", "TrainConfig", "UsageError", "prepare", "train"]


@dataclass
class Prepared:
    """A run ready to train: the resolved config, its run directory and its inputs."""

    run: Resolved
    run_dir: RunDir
    inputs: Inputs
    #: ``--eval-tasks`` (`shardax.train.task_evals`); None without them
    tasks: TaskEvals | None = None


def prepare(config: TrainConfig, run_dir: RunDir | None = None) -> Prepared:
    """Checks and resolves ``config`` once and prepares its inputs; bad input is a UsageError,
    nothing is written. ``run_dir``: what `check_run_dir` returned for the already checked
    ``config`` (the CLI checks both before JAX starts)."""
    if run_dir is None:
        config = check(config)
        run_dir = check_run_dir(config)
    with report.phase("starting the backend and resolving the run"):
        run = resolve(config)
    saved = run_dir.saved
    if config.resume and saved is not None and run.config.batch_size != saved.batch_size:
        raise UsageError(f"--resume: {run.batch_why} differs from the run being resumed "
                         f"(--batch-size {saved.batch_size})")  # see check_resume
    with report.phase("preparing the data and tokenizer"):
        inputs = objective_of(config).inputs(run, run_dir)
    with report.phase("indexing the lm-eval tasks") if config.eval_tasks else nullcontext():
        return Prepared(run, run_dir, inputs, TaskEvals.start(run, inputs.tokenizer))


_note = partial(note, "train")  # also handed to the run lock, the NaN watch, the clean-up
#: What every step reports (`report.StepClock` logs them); an objective's other metrics are
#: logged as they are.
_STEP_METRICS = ("loss", "grad_norm", "finite")


def _check_extra(restored: Restored) -> None:
    data = restored.extra.get("data")
    if not isinstance(data, dict) or "step" not in data:
        raise CorruptCheckpointError(
            f"checkpoint step {restored.step}: its extra metadata has no data position "
            f"(keys {sorted(restored.extra)}); it was not written by shardax train")


def _resume(p: Prepared, state_shape: Any, shardings: Any) -> tuple[int, TrainState, int]:
    """Restores the newest good checkpoint, skipping damaged ones with a note (or exactly
    ``--resume-step``): ``(step, state, updates skipped by --on-nan skip so far)``."""
    config = p.run.config

    def skipped(step: int, why: str) -> None:
        _note(f"checkpoint step {step} is unusable, trying the one before: {why}")

    try:
        with Checkpointer(p.run_dir.checkpoints, read_only=True) as reader:
            restored, state = restore_state(reader, state_shape, shardings,
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
        p.inputs.train.restore(restored.extra["data"])
    except ValueError as e:
        raise UsageError(f"--resume: checkpoint step {start}: {e}") from None
    if os.environ.get(RESTART_ENV, "0") not in ("", "0"):  # `shardax launch --elastic` says
        _note(f"elastic restart: resumed from checkpoint step {start} (the steps after it "
              "are trained again)")
    return start, state, int(restored.extra.get("skipped_steps", 0))


def _initial_state(p: Prepared, state_shape: Any, shardings: Any
                   ) -> tuple[int, TrainState | None, int]:
    """``(start step, state, skipped updates)``: resumed, read from ``--init-from``, or fresh
    (sharded at creation); the state is None when a resumed run is already at ``--steps``."""
    run = p.run
    if run.config.resume:
        start, state, skipped = _resume(p, state_shape, shardings)
        if jax.process_index() == 0:
            print(f"shardax train: resumed from step {start} (checkpoint "
                  f"{p.run_dir.checkpoints / str(start)})", flush=True)
            stretched = schedule_change(p.run_dir.saved, run.config, start)
            if stretched:
                print(f"shardax train: {stretched}", flush=True)
        if start == run.config.steps:
            return start, None, skipped
        if jax.process_index() == 0:
            tidy_checkpoints(p.run_dir, start, _note)
        _compat.sync_processes("shardax-tidy-checkpoints")
        return start, state, skipped
    return 0, build.initial_state(run), 0


def train(config: TrainConfig, prepared: Prepared | None = None, *,
          run_dir: RunDir | None = None) -> list[dict]:
    """Runs (or resumes) training; returns the metric records written to ``metrics.jsonl``.

    Raises `UsageError` for bad input (before writing anything) and `Stopped` after saving
    the step at which SIGTERM or Ctrl-C stopped it. ``prepared`` / ``run_dir``: what
    `prepare` / `check_run_dir` already returned for ``config``. The run directory is
    locked (`shardax.train.run.runlock`) while it trains: a second trainer on it is refused."""
    with _lock(Path(config.out)), StopRequests() as stop:
        if config.objective == "grpo" and prepared is None:
            return grpo_run.train_grpo_run(config, run_dir, stop)
        prepared = prepared or prepare(config, run_dir)
        return _train(prepared, stop)


def _lock(out: Path) -> RunLock:
    """The taken lock of ``out`` (process 0 takes it; every process raises the same
    `UsageError` when it is held by another job)."""
    is_main = jax.process_index() == 0
    lock, error = RunLock(out, main=is_main, note=_note), None
    if is_main:
        try:
            lock.acquire()
        except UsageError as e:
            error = e
    if jax.process_count() > 1:
        refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            error = UsageError(f"--out {out} is in use by another shardax train (process 0 "
                               "names it)")
    if error is not None:
        raise error
    return lock


def _banner(p: Prepared, state_shape: Any, plan: Any, per_token: float, peak: float | None
            ) -> None:
    """What process 0 prints before the first step: model, mesh, FSDP/pipeline, parameters'
    layout and the FLOPs that MFU counts."""
    run, config = p.run, p.run.config
    n_params = sum(x.size for x in jax.tree.leaves(state_shape.params))
    print(f"shardax train: {_model_name(run)} ({n_params / 1e6:.2f}M params, "
          f"{run.policy.params.name} weights) on {jax.device_count()} devices, mesh "
          f"{run.mesh.shape}, rules {config.rules!r}, precision {run.policy}")
    if run.mesh_why:
        print(f"mesh: {run.mesh_why}")
    if run.batch_why:
        print(f"batch: {run.batch_why}")
    print(_tokenizer_summary(p))
    print(run.optimizer_summary())
    lora = run.model_config.lora
    if lora is not None:
        frozen = sum(x.size for x in jax.tree.leaves(state_shape.rest))
        print(f"lora: rank {lora.rank}, alpha {lora.alpha:g} on --lora-targets "
              f"{lora.targets!r}: {n_params:,} trainable parameters; {frozen:,} frozen (no "
              "gradient, no optimizer state)")
    print(run.attention_summary(chat=isinstance(p.inputs.train, ChatBatches)))
    if run.mesh.shape.get("fsdp", 1) > 1:
        print(run.fsdp_summary())
    if run.mesh.shape.get("pp", 1) > 1:
        print(run.pipeline_summary())
    print(plan.where(lambda row: row.kind == "input" and "/params/" in f"/{row.path}/"))
    print(f"model FLOPs per token {per_token:.3g} (6N + 12·L·d·T); peak "
          + (f"{peak / 1e12:.0f} TFLOP/s per device: MFU reported" if peak else
             "FLOP/s unknown: MFU n/a (pass --peak-tflops to report it)"))
    for line in axis_findings(p.run, state_shape.params):
        print(f"warning: {line}")


def axis_findings(run: Resolved, params: Any) -> list[str]:
    """The findings ``shardax plan`` / ``verify`` make about this run's mesh and rules, one line
    each: mesh axes that divide no work (`Resolved.idle_axes`) and what the rules
    leave replicated (`shardax.rulecheck.rule_findings`; one line per message, naming its
    leaves)."""
    leaves = {}
    found = jax.tree_util.tree_flatten_with_path(params)[0]
    for finding in rule_findings(run.rules, params, run.mesh.mesh):
        if finding.absent_axes:  # presets name the axes of every mesh: not a finding here
            continue
        leaves.setdefault(finding.message, []).append(
            "params/" + tree_path_to_string(found[finding.leaf][0], sep="/"))
    lines = run.idle_axes()
    for message, paths in leaves.items():
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        lines.append(f"{', '.join(paths[:3])}{more}: {message}")
    return lines


def _model_name(run: Resolved) -> str:
    """``--model``, or the family and source of an ``--init-from`` model (``llama from
    hf:DIR``)."""
    if run.init_dir is None:
        return run.config.model
    try:
        family = read_json(run.init_dir / "config.json").get("model_type")
    except (ValueError, AttributeError):
        family = None
    return f"{family or type(run.model_config).__name__} from {run.config.init_from}"


def _tokenizer_summary(p: Prepared) -> str:
    """One line for the banner: the tokenizer the data and the run directory use."""
    tok, config = p.inputs.tokenizer, p.run.config
    if config.tokenizer == BYTES:
        return "tokenizer: bytes (UTF-8 bytes are the tokens, NUL ends a document)"
    source = (" (the --init-from model's own)" if config.init_from is not None
              and Path(config.tokenizer).resolve() == p.run.init_dir.resolve() else "")
    return (f"tokenizer: {config.tokenizer}{source}: vocabulary {tok.vocab_size}, "
            f"end-of-text id {tok.eos_id}")


class _Steps:
    """What happens after each train step: its metrics record (logged, evaluated, tracked),
    the non-finite loss policy, checkpoints, and stopping on SIGTERM / Ctrl-C."""

    def __init__(self, p: Prepared, start: int, records: list[dict], evaluate: Any,
                 metrics_log: report.MetricsLog, clock: report.StepClock, skipped: int = 0,
                 graphdef: Any = None):
        self.run, self.inputs, self.config = p.run, p.inputs, p.run.config
        self.tasks, self.graphdef = p.tasks, graphdef
        self.start, self.records, self.evaluate = start, records, evaluate
        self.metrics_log, self.clock = metrics_log, clock
        self.is_main = jax.process_index() == 0
        self.trackers = (report.Trackers(self.config.log_to, p.run_dir.out,
                                         self.config.to_json()) if self.is_main else None)
        self.ckpt = Checkpointer(p.run_dir.checkpoints, max_to_keep=3)
        linked = self.ckpt.linked_steps()
        if linked:
            _note("note: checkpoint step(s) " + ", ".join(f"{s} (a symlink to {t})" for s, t in
                                                          linked.items())
                  + " kept as they are: old steps are rotated out, never deleted through a "
                  "link; remove the link yourself when it is no longer needed")
        self.watch = NonFiniteWatch(self.config.on_nan, start, _note, self.ckpt.pin, skipped)

    def ran(self, done: int, metrics: dict) -> None:
        """Step ``done`` was dispatched: the flags of the steps before it are read now (one
        step stays in flight) and ``--on-nan`` applied."""
        self.watch.add(done, metrics)
        self.watch.settle(upto=done - 1)

    def record(self, step: int, state: TrainState, metrics: dict, batch: Any) -> dict:
        """The metrics record of 0-based ``step`` (empty when nothing is due), written out;
        ``data_hash`` fingerprints the step's global input tokens (the same on any mesh and
        process count: the token stream of two runs compares step by step)."""
        config, done = self.config, step + 1
        record: dict[str, Any] = {}
        if done % config.log_every == 0 or done in (config.steps, self.start + 1):
            self.watch.settle()
            record = {"step": done, **self.clock.measure(done, metrics),
                      **{k: float(v) for k, v in metrics.items()  # the objective's own
                         if k not in _STEP_METRICS and not k.startswith("moe/")},
                      "lr": float(self.run.schedule(step)), **self.watch.record(),
                      "data_hash": fingerprints({"inputs": batch[0]})["inputs"],
                      **balance.load_record(metrics), **report.memory_in_use()}
        if self.inputs.val and config.eval_every and (done % config.eval_every == 0
                                                      or done == config.steps):
            val = [float(self.evaluate(state, b)) for b in self.inputs.val_batches()]
            record = {"step": done, **record, **_val_record(val, self.inputs.val_sources)}
        if self.tasks is not None and self.tasks.due(done):
            record = {"step": done, **record, **self.tasks.scores(self.graphdef, state)}
        if record:
            record.update(self.inputs.data_metrics(done))  # data/tokens/<source> of a mixture
            self.records.append(record)
            if self.is_main:
                self.metrics_log.append(record)
                self.trackers.log(record)
        return record

    def save(self, done: int, state: TrainState, stop: StopRequests) -> None:
        """Saves a checkpoint when one is due; on a stop request saves (if not yet) and
        raises `Stopped` once it is committed. A state is saved only once every step up to it
        passed ``--on-nan``."""
        config = self.config
        due = done % config.ckpt_every == 0 or done == config.steps
        stopping = done < config.steps and stop.reached(done)
        if due or stopping:
            self.watch.settle()
            self._save(done, state)
        if stopping:
            self.ckpt.wait()  # synchronous: committed before the process exits
            raise Stopped(done, stop.signum)

    def _save(self, done: int, state: TrainState) -> None:
        position = self.inputs.position(done)
        # settled (`watch.settle`) up to ``done``: a resumed run counts on from it
        self.ckpt.save(done, flat(state), extra={"data": position,
                                                 "config": self.config.to_json(),
                                                 "skipped_steps": self.watch.skipped},
                       force=True)
        self.watch.saved_step(done)

    def close(self) -> None:
        """Finishes (or abandons) the in-flight save and closes the trackers."""
        self.ckpt.close()
        if self.trackers is not None:
            self.trackers.close()


def _val_record(losses: list[float], sources: list[str] | None) -> dict[str, float]:
    """``val_loss``, the mean loss over every validation token (each batch holds as many),
    and with several ``--val-data`` sources ``val_loss/<source>`` over each one's tokens.

    >>> _val_record([1.0, 2.0, 4.0], ["a", "a", "b"])
    {'val_loss': 2.3333333333333335, 'val_loss/a': 1.5, 'val_loss/b': 4.0}
    """
    record = {"val_loss": float(np.mean(losses))}
    for name in dict.fromkeys(sources or []):
        record[f"val_loss/{name}"] = float(np.mean([x for x, s in zip(losses, sources)
                                                    if s == name]))
    return record


def _train(p: Prepared, stop: StopRequests) -> list[dict]:
    run, run_dir, inputs = p.run, p.run_dir, p.inputs
    config, mesh = run.config, run.mesh
    is_main = jax.process_index() == 0
    graphdef, state_shape = build.abstract(run.model_config, run.tx, config.seed, mesh)
    metrics_log = report.MetricsLog(run_dir.metrics)
    with report.phase("restoring the checkpoint" if config.resume else
                      f"loading {config.init_from}" if config.init_from is not None else
                      "initialising the model"):
        start, state, skipped = _initial_state(p, state_shape, run.shardings(state_shape))
    records = metrics_log.read(up_to=start, quiet=not is_main) if config.resume else []
    if state is None:
        _note(f"the run is already at step {start} = --steps; nothing to do (pass a larger "
              "--steps to train on)")
        return records
    # Every check passed: from here on the run directory is written.
    write_config(run_dir, config, inputs.tokenizer, main=is_main)
    if is_main:
        metrics_log.start(records)

    objective = objective_of(config)
    objective.setup(run, run_dir, inputs, graphdef, state, start)
    end_id = inputs.tokenizer.eos_id if config.pack == "documents" else None
    step_fn = objective.step(run, graphdef, end_id=end_id)
    evaluate = mesh.sjit(partial(eval_loss, graphdef=graphdef, policy=run.policy, end_id=end_id,
                                 layout=run.layout),
                         in_shardings=(run.state_rules, inputs.sharding.spec))
    first = inputs.batch(start)
    with report.phase("compiling the train step"):
        plan = step_fn.plan(state, first)
    per_token, peak = flops_per_token(run.model_config, config.seq_len), _peak_flops(config)
    if is_main:  # what the compiled step holds and moves per device (`shardax plan` predicts it)
        write_text(run_dir.plan, plan.to_json() + "\n")
        _banner(p, state_shape, plan, per_token, peak)
    clock = report.StepClock(inputs.rows * config.seq_len, start, per_token, peak,
                             jax.device_count())
    steps = _Steps(p, start, records, evaluate, metrics_log, clock, skipped, graphdef)
    profiler = StepProfiler(parse_profile_steps(config.profile_steps), run_dir.profile)
    try:
        with report.Progress(config.steps, start) as progress:
            for step in range(start, config.steps):
                batch = first if step == start else inputs.batch(step)
                profiler.before(step + 1)
                state, metrics = step_fn(state, batch)
                steps.ran(step + 1, metrics)
                profiler.after(step + 1, (state, metrics))
                record = steps.record(step, state, metrics, batch)
                progress.update(step + 1, record if is_main else None)
                steps.save(step + 1, state, stop)
    finally:  # an interrupted run still finishes (or abandons) its in-flight save
        profiler.stop()
        steps.close()
    if is_main:
        report.finished(run_dir, records)
    return records


def _peak_flops(config: TrainConfig) -> float | None:
    """Peak FLOP/s of one device: ``--peak-tflops``, else the device table's entry (None on a
    CPU or an unknown device: MFU is then n/a)."""
    if config.peak_tflops:
        return config.peak_tflops * 1e12
    device = jax.devices()[0]
    spec = device_spec(device.device_kind)
    return spec.peak_flops if spec and device.platform != "cpu" else None
