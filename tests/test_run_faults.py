"""Runs that meet trouble: two trainers on one ``--out``, a loss that becomes NaN, a full disk.

Each case is met as a user meets it: ``python -m shardax.cli train`` in a subprocess, its exit
status and stderr checked, then the run directory (lock file, metrics, checkpoints). Runs are
tiny (llama-tiny, 8 x 32 tokens, SGD).
"""

import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli import (
    cli_command,
    cli_env,
    committed_steps,
    multiprocess_env,
    read_metrics,
    run_cli,
    wait_for_line,
)
from _reference import TINY_TRAIN

from shardax.errors import UsageError
from shardax.train.run.runlock import LOCK_FILE, RunLock

TINY = {**TINY_TRAIN, "steps": 6, "mesh": "fsdp=-1"}
BOUND_S = 300


def _flags(**overrides) -> list[str]:
    return [s for k, v in {**TINY, **overrides}.items()
            for s in (f"--{k.replace('_', '-')}", str(v))]


def _cmd(out: Path, *extra: str, **overrides) -> list[str]:
    return cli_command("train", *_flags(**overrides), *extra, "--out", out)


def _run(out: Path, *extra: str, **overrides) -> subprocess.CompletedProcess:
    return run_cli("train", *_flags(**overrides), *extra, "--out", out,
                   env=cli_env(PYTHONUNBUFFERED="1"), timeout=BOUND_S)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shardax train: error:")]


def _wait_for(stream, pattern: str, proc: subprocess.Popen) -> str:
    return wait_for_line(stream, pattern, proc, BOUND_S)


# ----------------------------------------------------------------------------- the lock


def test_a_second_trainer_on_the_same_out_is_refused_and_a_killed_ones_lock_is_stale(
        tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(_cmd(out, steps=400, ckpt_every=2), env=cli_env(PYTHONUNBUFFERED="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first.stdout, r"^step\s+3\s", first)
        deadline = time.monotonic() + BOUND_S
        while not committed_steps(out):
            assert time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.02)
        lock = json.loads((out / LOCK_FILE).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname(), lock
        # Without --resume the directory "holds checkpoints of another run" too: the lock is
        # what the user hears of first.
        for flags in ([], ["--resume"]):
            second = _run(out, *flags, steps=2)
            assert second.returncode == 2, second.stderr[-3000:]
            assert second.stderr.count("\n") == 1 and _errors(second.stderr), second.stderr
            assert (f"--out {out} is in use by another shardax train (pid {first.pid} on "
                    f"{socket.gethostname()}, started ") in second.stderr, second.stderr
        assert first.poll() is None  # the holder trains on, undisturbed
        steps = [r["step"] for r in read_metrics(out)]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)  # one run's records
        first.send_signal(signal.SIGKILL)  # a lost host: no clean-up at all
        first.wait(timeout=BOUND_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / LOCK_FILE).exists()  # left behind, but no process holds it
    newest = committed_steps(out)[-1]
    third = _run(out, "--resume", steps=newest + 1)
    assert third.returncode == 0, third.stderr[-3000:]
    assert (f"shardax train: taking over the stale lock of pid {first.pid} on "
            f"{socket.gethostname()}") in third.stderr, third.stderr
    assert not (out / LOCK_FILE).exists()  # released at the end
    assert committed_steps(out)[-1] == newest + 1


def test_the_lock_is_released_on_errors_and_leaves_no_empty_directory(tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError), RunLock(out):
        assert (out / LOCK_FILE).exists()
        with pytest.raises(UsageError, match=r"is in use by another shardax train \(pid "
                           rf"{os.getpid()} on "):
            RunLock(out).acquire()
        raise RuntimeError("the run failed")
    assert not out.exists()  # created by the lock, nothing trained into it: removed
    out.mkdir(parents=True)
    with RunLock(out):
        pass
    assert out.is_dir() and not any(out.iterdir())


def test_without_flock_a_lock_is_judged_by_its_pid(tmp_path, monkeypatch, capsys):
    """Some network file systems refuse flock: a lock of this host whose pid is gone is
    stale; one of another host is respected."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = {"pid": int(dead.stdout), "host": socket.gethostname(), "started": "then"}
    (out / LOCK_FILE).write_text(json.dumps(stale))
    with RunLock(out):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {stale['pid']}" in capsys.readouterr().err
    elsewhere = {"pid": 1, "host": "another-host", "started": "then", "command": "shardax x"}
    (out / LOCK_FILE).write_text(json.dumps(elsewhere))
    with pytest.raises(UsageError, match=r"\(pid 1 on another-host, started then: shardax x\)"
                       r".*if that job is gone, delete "):
        RunLock(out).acquire()
    assert json.loads((out / LOCK_FILE).read_text()) == elsewhere  # untouched


# ----------------------------------------------------------------------------- NaN

# SGD at lr 1e20: step 1 (from the initial weights) is finite, its update overflows the
# activations of step 2 (float32), whose loss is NaN (any lr from about 1e17 up does so).
NAN_AT = 2
EXPLODING = {"lr": 1e20, "ckpt_every": 1}


def _finite_weights(out: Path, step: int) -> bool:
    import jax
    import numpy as np

    from shardax.train import Checkpointer

    with Checkpointer(out / "checkpoints", read_only=True) as ckpt:
        state = ckpt.restore(step=step).state
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def test_a_nan_loss_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, **EXPLODING)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0] == (
        f"shardax train: error: the loss is not finite at step {NAN_AT} (loss nan; --on-nan "
        f"stop): stopped without saving it; the newest checkpoint, step {NAN_AT - 1}, has "
        "finite weights: continue from it with --resume (e.g. with a lower --lr), or pass "
        "--on-nan skip")
    assert committed_steps(out) == [NAN_AT - 1] and _finite_weights(out, NAN_AT - 1)
    assert not (out / LOCK_FILE).exists()


@pytest.mark.multiprocess
def test_two_processes_stop_together_at_the_nan_step(tmp_path):
    """Every process reads the same flag and stops at the same step; process 0 says so once,
    the launcher exits with 3."""
    out = tmp_path / "run"
    env = {**multiprocess_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cli_command("launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                    *_cmd(out, **EXPLODING)), env=env, capture_output=True, text=True,
        timeout=BOUND_S)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = re.findall(r"^\[(\d)\] shardax train: error: the loss is not finite at step (\d+)",
                      proc.stdout, re.MULTILINE)
    assert said == [("0", str(NAN_AT))], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    assert committed_steps(out) == [NAN_AT - 1] and not (out / LOCK_FILE).exists()


def test_on_nan_continue_trains_on_and_pins_the_last_finite_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, "--on-nan", "continue", **EXPLODING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"shardax train: the loss is not finite at step {NAN_AT} (loss nan); training on "
            f"(--on-nan continue); checkpoint step {NAN_AT - 1}, the last with finite weights, "
            "is kept") in proc.stderr, proc.stderr[-3000:]
    # 3 newest kept (4, 5, 6: NaN weights) and, whatever --keep says, the last good one.
    assert committed_steps(out) == [NAN_AT - 1, 4, 5, 6]
    assert _finite_weights(out, NAN_AT - 1) and not _finite_weights(out, 6)


def test_on_nan_skip_skips_and_counts_the_non_finite_updates(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, "--on-nan", "skip", **EXPLODING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = re.findall(r"the loss is not finite at step (\d+) \(loss nan\); its update was "
                       r"skipped \(--on-nan skip; (\d+) skipped so far\)", proc.stderr)
    # Steps 2..6 all meet step 1's overflowed weights (kept, as every update is skipped);
    # noted: the first three, then at powers of two.
    assert notes == [("2", "1"), ("3", "2"), ("4", "3"), ("5", "4")], proc.stderr[-3000:]
    records = {r["step"]: r for r in read_metrics(out)}
    assert [records[s].get("skipped_steps", 0) for s in range(1, 7)] == [0, 1, 2, 3, 4, 5]
    assert committed_steps(out) == [4, 5, 6] and _finite_weights(out, 6)
    # Resumed, the count goes on from the checkpoint's (it used to restart at 0).
    proc = _run(out, "--on-nan", "skip", "--resume", **{**EXPLODING, "steps": 8})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["step"]: r for r in read_metrics(out)}
    assert [records[s].get("skipped_steps", 0) for s in (7, 8)] == [6, 7]


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: a file system that really fills up (mounting it needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """Fills ``disk`` up to ``leave`` bytes free (another job's files, say)."""
    filler = disk / "filler"
    # Unbuffered: a buffered file keeps the bytes a full disk refused and raises ENOSPC again
    # when it is closed.
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    os.truncate(filler, filler.stat().st_size - leave)
    return filler


def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_restores(
        small_disk):
    out = small_disk / "run"
    assert _run(out, steps=2).returncode == 0
    # Room for config.json and the metrics, not for a checkpoint (about 1 MiB).
    filler = _fill(small_disk, leave=200_000)
    proc = _run(out, "--resume", steps=4)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"shardax train: error: cannot write checkpoint step 4 in {out / 'checkpoints'} (No "
        "space left on device); the newest committed checkpoint, step 2, is intact: continue "
        "from it with --resume once the cause is fixed"], proc.stderr[-3000:]
    assert committed_steps(out) == [2] and not (out / LOCK_FILE).exists()
    filler.unlink()  # the operator frees space and resumes
    proc = _run(out, "--resume", steps=4)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert committed_steps(out) == [2, 4]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_a_checkpointer_leaves_the_process_alone(tmp_path):
    """Building a Checkpointer installs no hook and no logger filter: dropping orbax's reports
    is the ``shardax`` command's choice (`shardax.train.run.orbax_logs.drop_orbax_errors`)."""
    import logging

    from shardax.train import Checkpointer

    hook = sys.unraisablehook
    filters = {name: list(logging.getLogger(name).filters) for name in ("absl", "asyncio")}
    with Checkpointer(tmp_path / "checkpoints"):
        pass
    assert sys.unraisablehook is hook
    assert {name: list(logging.getLogger(name).filters) for name in filters} == filters


def test_orbax_late_reports_are_dropped_and_others_are_not(monkeypatch, capsys):
    """What orbax and TensorStore report after a failed read, outside any call (an
    "Exception ignored in" of a closed event loop), is dropped; anything else still shows."""
    from types import SimpleNamespace

    from shardax.train.run.orbax_logs import drop_orbax_errors

    shown = []
    monkeypatch.setattr(sys, "unraisablehook", shown.append)
    drop_orbax_errors()

    def report(exc, obj):
        sys.unraisablehook(SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                           exc_traceback=None, err_msg=None, object=obj))

    report(RuntimeError("Event loop is closed"), None)
    report(ValueError("a read failed"), "<coroutine orbax.checkpoint._src.read>")
    report(ValueError("mine"), "<function my_callback>")
    assert [str(u.exc_value) for u in shown] == ["mine"]
