"""What a training run reports: the progress bar, ``metrics.jsonl``, ``loss.png`` and the
``--log-to`` trackers (TensorBoard, W&B: `shardax.train.run.trackers`).

``metrics.jsonl`` holds one JSON object per logged step (``step``, ``loss``, ``grad_norm``,
``lr``, ``step_time_s``, ``tokens_per_s``, ``tflops_per_device``, ``mfu`` (null where the
device's peak is unknown, e.g. a CPU), ``memory_gib`` / ``memory_peak_gib`` where the backend
reports memory, and ``val_loss`` where evaluated). A resumed run keeps the records up to the
step it continues from. The plot needs matplotlib (an optional dependency);
without it the run says so and skips it.

>>> import tempfile
>>> log = MetricsLog(Path(tempfile.mkdtemp()) / "metrics.jsonl")
>>> records = log.read(up_to=200)      # skips (and reports) lines that are not JSON
>>> log.start(records); log.append({"step": 201, "loss": 1.3})
>>> log.read(up_to=300)
[{'step': 201, 'loss': 1.3}]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax

from shardax.errors import MissingExtra, UsageError
from shardax.filewrite import append_text, replacing, write_text
from shardax.phase import HEARTBEAT_S, Beat, phase, say
from shardax.train.run.mfu import mfu
from shardax.train.run.notes import note
from shardax.train.run.trackers import make_trackers

__all__ = ["MetricsLog", "Progress", "StepClock", "Trackers", "fit", "memory_in_use", "phase",
           "plot"]

def fit(parts: list[str], width: int, sep: str = " | ") -> list[str]:
    """``parts`` joined by ``sep`` into lines of at most ``width`` characters, broken only
    between parts (a part longer than ``width`` gets a line of its own).

    >>> fit(["step 5  loss 2.1", "900 tok/s", "12 ms/step"], 30)
    ['step 5  loss 2.1 | 900 tok/s', '  12 ms/step']
    """
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part if not lines else "  " + part)
    return lines


class Progress:
    """A rich progress bar with elapsed time, loss, tokens/s and step time; plain lines when
    not a TTY. Lines fit the terminal's width (broken between fields, never mid-word); a step
    that runs longer than ``every`` seconds says so (a heartbeat: the elapsed time moves)."""

    def __init__(self, total: int, start: int, every: float = HEARTBEAT_S):
        from rich.console import Console  # optional: rich (extra "train")
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=False)
        self.bar = Progress(TextColumn("train"), BarColumn(bar_width=20), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                            console=self.console, disable=not self.console.is_terminal)
        self.task = self.bar.add_task("train", total=total, completed=start,
                                      info="first step (it compiles) ...")
        self.total, self.step, self.first = total, start, True
        self.beat: Beat | None = None
        if not self.console.is_terminal and jax.process_index() == 0:
            self.beat = Beat(self._still, every)

    def _still(self, seconds: float) -> None:
        first = " (the first one compiles the step)" if self.first else ""
        say(f"step {self.step + 1}/{self.total} still running{first}: {seconds:.0f} s so far")

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.beat is not None:
            self.beat.stop()
        self.bar.__exit__(*exc)

    def update(self, step: int, record: dict | None = None) -> None:
        """Advances the bar; a metrics record also updates its text and prints a line."""
        self.step, self.first = step, False
        if self.beat is not None:
            self.beat.reset()
        if not record:
            self.bar.update(self.task, completed=step)
            return
        parts = [" ".join(f"{k} {record[k]:.4f}" for k in ("loss", "val_loss") if k in record)]
        if "tokens_per_s" in record:
            parts += [f"{record['tokens_per_s']:,.0f} tok/s",
                      f"{record['step_time_s'] * 1000:.0f} ms/step",
                      f"{record['tflops_per_device']:.3g} TFLOP/s/device",
                      "MFU " + ("n/a" if record["mfu"] is None else f"{record['mfu']:.1%}")]
        width = shutil.get_terminal_size().columns
        # the bar's own columns take about 45 characters; its text keeps the fields that fit
        self.bar.update(self.task, completed=step, info=fit(parts, max(width - 45, 10))[0])
        parts[0] = f"step {step:5d}  {parts[0]}"
        for line in fit(parts, width) if self.console.is_terminal else [" | ".join(parts)]:
            self.console.print(line, highlight=False, soft_wrap=True)


class StepClock:
    """Step time, tokens/s, model TFLOP/s per device and MFU between logged steps (reading the
    loss waits for the step). ``peak_flops`` None: MFU is None (a CPU, or an unknown device)."""

    def __init__(self, tokens_per_step: int, start: int, flops_per_token: float = 0.0,
                 peak_flops: float | None = None, devices: int = 1):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token, self.peak_flops, self.devices = flops_per_token, peak_flops, devices
        self.last_time, self.last_step = time.perf_counter(), start

    def measure(self, step: int, metrics: dict) -> dict[str, float | None]:
        """The logged numbers of ``step``: loss, gradient norm, step time, tokens/s,
        TFLOP/s per device and MFU."""
        loss = float(metrics["loss"])
        now = time.perf_counter()
        dt = (now - self.last_time) / max(step - self.last_step, 1)
        self.last_time, self.last_step = now, step
        tokens_per_s = self.tokens_per_step / dt
        model_flops = self.flops_per_token * tokens_per_s
        return {"loss": loss, "grad_norm": float(metrics["grad_norm"]), "step_time_s": dt,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": model_flops / self.devices / 1e12,
                "mfu": mfu(model_flops, self.peak_flops, self.devices)}


def memory_in_use() -> dict[str, float]:
    """GiB in use and its peak on the fullest local device, where the backend reports it
    (``Device.memory_stats()``; a CPU reports nothing, so ``{}``)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    used = [s["bytes_in_use"] for s in stats if "bytes_in_use" in s]
    peak = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    out = {}
    if used:
        out["memory_gib"] = max(used) / 2**30
    if peak:
        out["memory_peak_gib"] = max(peak) / 2**30
    return out


class Trackers:
    """The ``--log-to`` trackers besides JSONL (which `MetricsLog` writes): each logged record
    goes to TensorBoard / W&B under the run directory ``out``."""

    def __init__(self, log_to: str, out: Path, config: dict[str, Any]):
        try:
            self.trackers = make_trackers(log_to, out, config)
        except MissingExtra as e:  # `check` found it installed; it failed to import since
            raise UsageError(str(e)) from None

    def log(self, record: dict[str, Any]) -> None:
        """Sends one metrics record (its ``step`` is the tracker's step; list fields, e.g.
        ``moe/expert_tokens``, stay in ``metrics.jsonl``)."""
        for tracker in self.trackers:
            tracker.log(record["step"], {k: v for k, v in record.items()
                                         if k != "step" and not isinstance(v, list)})

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class MetricsLog:
    """``metrics.jsonl``: read back (tolerating damaged lines), restarted, appended to."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self, up_to: int, quiet: bool = False) -> list[dict]:
        """The records of steps ``<= up_to``. Lines that are not a JSON object with a
        ``step`` (e.g. the half-written last line of a killed run) are skipped, with one line
        on stderr saying how many (unless ``quiet``)."""
        try:
            lines = self.path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        records, bad = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ok = isinstance(record, dict) and isinstance(record.get("step"), int)
            except (ValueError, RecursionError):  # garbled, or nested without end
                ok = False
            if ok:
                records.append(record)
            else:
                bad.append(number)
        if bad and not quiet:
            note("train", f"note: {self.path}: skipped {len(bad)} unreadable line(s) (line "
                          f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})")
        return [r for r in records if r["step"] <= up_to]

    def start(self, records: list[dict]) -> None:
        """Rewrites the file with ``records`` (those of the steps a resumed run keeps),
        atomically (a symlink at its name is replaced, not written through)."""
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))

    def append(self, record: dict[str, Any]) -> None:
        """Adds one record (written and closed at once, so a kill loses at most it)."""
        append_text(self.path, json.dumps(record) + "\n")


def finished(run_dir: Any, records: list[dict]) -> None:
    """What process 0 does when a run ends: ``loss.png`` (`plot`) and one line naming what
    the run directory (a `shardax.train.rundir.RunDir`) now holds."""
    png = plot(run_dir.out, records)
    print(f"wrote {run_dir.metrics}{f', {png}' if png else ''} and checkpoints in "
          f"{run_dir.checkpoints}")


def plot(out: Path, records: list[dict]) -> Path | None:
    """Writes ``out/loss.png`` (train and validation loss against step) and returns its path;
    None, with a note on stderr, when matplotlib is not installed."""
    try:
        import matplotlib  # optional: matplotlib (extra "train"); without it, no loss.png
    except ImportError:
        print("shardax train: note: matplotlib is not installed, so no loss.png "
              "(pip install matplotlib); the numbers are in metrics.jsonl", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib, as above

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    if train or val:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "loss.png"
    with replacing(path) as tmp:  # a symlink at loss.png is replaced, not written through
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path
