"""A run directory: every path in it, and every check of it against a command's config.

A run directory (``--out``) holds ``config.json`` (the effective config), ``metrics.jsonl``,
``loss.png``, ``plan.json``, ``checkpoints/`` (and ``checkpoints-set-aside/`` for committed
steps a resumed run moved out of its way), with ``--log-to`` a ``tensorboard/`` or ``wandb/``
folder, with ``--profile-steps`` a ``profile/`` trace and, with a Hugging Face ``--tokenizer``,
a copy of it in ``tokenizer/``. `RunDir` names those paths; `check_run_dir` (``shardax train``)
and `check_run` (``shardax generate`` / ``export``) check a directory using the file system
only, so bad input is a `UsageError` before JAX starts; `check_resume` is the resume policy.

>>> run_dir = RunDir(Path("runs/a"))
>>> run_dir.checkpoints
PosixPath('runs/a/checkpoints')
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardax.data.mixture import weighted_entries
from shardax.data.tokenizer import TOKENIZER_DIR, Tokenizer
from shardax.errors import UsageError
from shardax.filecheck import read_json
from shardax.filewrite import check_target_dir, remove_tree, write_text
from shardax.train.config import TrainConfig, flag, with_defaults
from shardax.train.configfile import from_dict
from shardax.train.run.checkpoint import list_steps

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "FIXED_ON_RESUME", "PROFILE_DIR", "SET_ASIDE_DIR",
           "RunDir", "check_resume", "check_run", "check_run_dir", "load_run_config",
           "tidy_checkpoints", "write_config"]

#: The effective config of a run.
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
#: Where ``--resume`` moves committed steps newer than the one it continues from (damaged
#: ones, or those past ``--resume-step``), so that the run can save those steps again.
SET_ASIDE_DIR = "checkpoints-set-aside"
PROFILE_DIR = "profile"
# The folders a run writes into (the trackers' too: `shardax.train.run.trackers`).
_WRITTEN_DIRS = (CHECKPOINT_DIR, SET_ASIDE_DIR, PROFILE_DIR, TOKENIZER_DIR, "tensorboard",
                 "wandb")
#: Settings a resumed run must share with the run it continues (the mesh and the split of
#: the global batch into ``grad_accum`` microbatches may change, and ``steps`` may grow).
# The learning-rate schedule (--lr, --steps, --warmup-steps, --min-lr-ratio) may change: a
# lower --lr after a divergence, more --steps; the resumed run says what its lr becomes
# (`resolve.schedule_change`).
FIXED_ON_RESUME = ("model", "init_from", "seed", "batch_size", "seq_len", "data", "optimizer",
                   "precision", "tokenizer", "text_field", "data_split", "token_dtype",
                   "pack", "loss_on", "lora_rank", "lora_alpha", "lora_targets",
                   "objective", "group_size", "num_iterations")


@dataclass
class RunDir:
    """A run directory and, once checked, its saved config and checkpoint steps."""

    out: Path
    saved: TrainConfig | None = None
    committed: list[int] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)

    @property
    def config_file(self) -> Path:
        return self.out / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.out / CHECKPOINT_DIR

    @property
    def set_aside(self) -> Path:
        return self.out / SET_ASIDE_DIR

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def plan(self) -> Path:
        return self.out / "plan.json"

    @property
    def profile(self) -> Path:
        return self.out / PROFILE_DIR

    @property
    def tokenizer(self) -> Path:
        return self.out / TOKENIZER_DIR


def _os_reason(e: OSError) -> str:
    return getattr(e, "strerror", None) or str(e)


def load_run_config(out: str | Path, flag_name: str = "--out") -> TrainConfig:
    """The `TrainConfig` saved in run directory ``out`` (its ``config.json``); a missing,
    unreadable or garbled file is a UsageError naming it."""
    out = Path(out)
    path = out / CONFIG_FILE
    if not out.is_dir():
        raise UsageError(f"{flag_name} {out}: no such run directory")
    if not (path.exists() or path.is_symlink()):
        raise UsageError(f"{flag_name} {out}: no {CONFIG_FILE}; it is not a shardax run "
                         "directory")
    try:  # bounded size and nesting, strict UTF-8: see shardax.filecheck
        values = read_json(path)
    except ValueError as e:
        raise UsageError(f"{e}; restore it from a copy, or copy 'config' from a checkpoint's "
                         "extra/metadata") from None
    if isinstance(values, dict):
        # A run from before --pack trained its rows as one stream: it keeps doing so.
        values.setdefault("pack", "concat")
        # A run from before --scan-layers existed looped over its layers: it keeps doing so.
        values.setdefault("scan_layers", False)
    # A run from before `check` filled in the optimizer's defaults saved them as null.
    return with_defaults(from_dict(TrainConfig, values, where=f"{path}: "))


def check_resume(saved: TrainConfig, config: TrainConfig) -> None:
    """Whether ``config`` may continue the run that ``saved`` started (UsageError if not):
    the settings in `FIXED_ON_RESUME` must match. The mesh may change, a 'pp' axis included:
    a checkpoint holds identical layers stacked whatever ran them (one written as a list by an
    older version is stacked on restore: `shardax.train.run.checkpoint.listed_layers`)."""
    # --per-device-batch-size gives the global batch once the mesh is known: `resolve` then
    # checks it against the run's (`check_batch`).
    changed = [k for k in FIXED_ON_RESUME if _fixed(saved, k) != _fixed(config, k)
               and not (k == "batch_size" and config.per_device_batch_size is not None)]
    if changed:
        raise UsageError("--resume: these settings differ from the run being resumed: " +
                         ", ".join(f"{flag(k)} {getattr(config, k)!r} (was {getattr(saved, k)!r})"
                                   for k in changed)
                         + ("; a mixture's weights may change, its sources not"
                            if "data" in changed and isinstance(_fixed(saved, "data"), tuple)
                            else ""))


def _fixed(config: TrainConfig, key: str) -> object:
    """What of setting ``key`` a resume keeps: of a weighted ``--data``, its paths (the weights
    may change: `shardax.data.mixture_data`)."""
    if key != "data":
        return getattr(config, key)
    entries = weighted_entries(config.data)
    return config.data if entries is None else ("weighted", [p for p, _ in entries])


def _check_out(out: Path) -> None:
    """``--out`` is, or can become, a writable directory (nothing is left behind here), and
    neither it nor a folder the run writes into is a symlink: a run writes only inside
    ``--out``."""
    try:
        check_target_dir(out, "--out")
    except ValueError as e:
        raise UsageError(str(e)) from None
    for name in _WRITTEN_DIRS:
        if (out / name).is_symlink():
            raise UsageError(f"--out {out}: {name} is a symlink to {os.readlink(out / name)}; "
                             "a run writes only inside --out: make it a real directory (move "
                             "what it leads to into it) or choose another --out")
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


def _steps(run_dir: RunDir) -> tuple[list[int], list[int]]:
    try:
        return list_steps(run_dir.checkpoints)
    except OSError as e:
        raise UsageError(f"--out {run_dir.out}: cannot read {run_dir.checkpoints} "
                         f"({_os_reason(e)})") from None


def check_run_dir(config: TrainConfig) -> RunDir:
    """Checks ``--out`` against ``--resume`` using the file system only (no JAX, no writes):
    a fresh run never reuses a directory with checkpoints; a resumed one needs a committed
    checkpoint, a readable ``config.json`` and the same fixed settings."""
    run_dir = RunDir(Path(config.out))
    out, ckpt_dir = run_dir.out, run_dir.checkpoints
    _check_out(out)
    committed, uncommitted = _steps(run_dir)
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
    if not run_dir.config_file.exists():
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


def check_run(out: str | Path, step: int | None = None) -> RunDir:
    """Run directory ``out`` for reading (``shardax generate`` / ``export``): its saved config
    and committed checkpoints, with ``step`` (if given) among them; UsageError otherwise.
    Reads the file system only (no JAX backend, no writes)."""
    run_dir = RunDir(Path(out), load_run_config(out))
    committed, uncommitted = _steps(run_dir)
    if not committed:
        half = f" (steps {uncommitted} were never committed)" if uncommitted else ""
        raise UsageError(f"--out {out}: no checkpoint in {run_dir.checkpoints}{half}; "
                         "train first")
    if step is not None and step not in committed:
        raise UsageError(f"--step {step}: not a committed checkpoint in {run_dir.checkpoints} "
                         f"(committed steps: {committed})")
    return RunDir(run_dir.out, run_dir.saved, committed, uncommitted)


def tidy_checkpoints(run_dir: RunDir, start: int, note: Callable[[str], None] | None) -> None:
    """Before the first save of a resumed run: committed steps newer than ``start`` (damaged,
    or past ``--resume-step``) move to ``checkpoints-set-aside/``; half-written step folders
    (never loadable) are deleted. Call it on one process (``note`` reports what moved)."""
    ckpt_dir = run_dir.checkpoints
    committed, uncommitted = list_steps(ckpt_dir)
    newer = [s for s in committed if s > start]
    note = note or (lambda _message: None)
    if newer:
        aside = run_dir.set_aside
        aside.mkdir(exist_ok=True)
        for s in newer:
            dest = aside / str(s)
            n = 1
            while dest.exists():
                dest, n = aside / f"{s}.{n}", n + 1
            (ckpt_dir / str(s)).rename(dest)
        note(f"moved checkpoint steps {newer} (newer than step {start}, which this run "
             f"continues from) to {aside}; delete them when you no longer need them")
    for s in uncommitted:
        remove_tree(ckpt_dir / str(s))  # a symlink: only the link
    if uncommitted:
        note(f"removed half-written checkpoint steps {uncommitted} (never committed)")


def write_config(run_dir: RunDir, config: TrainConfig, tokenizer: Tokenizer, *,
                 main: bool = True) -> None:
    """Creates the directory and, on the ``main`` process, writes ``config.json`` (replaced
    atomically) and the tokenizer copy: the first write of a run."""
    try:
        run_dir.out.mkdir(parents=True, exist_ok=True)
        if not main:
            return
        # never a half-written config.json, never one written through a symlink
        write_text(run_dir.config_file, json.dumps(config.to_json(), indent=2) + "\n")
        tokenizer.save(run_dir.tokenizer)
    except OSError as e:
        raise UsageError(f"--out {run_dir.out}: cannot write there ({_os_reason(e)})") from None
