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
from _reference import TINY_TRAIN

from shardax.train.checkpoint import list_steps
from shardax.train.config import UsageError
from shardax.train.runlock import LOCK_FILE, RunLock

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = {**TINY_TRAIN, "steps": 6, "mesh": "fsdp=-1"}
BOUND_S = 300


def _flags(**overrides) -> list[str]:
    return [s for k, v in {**TINY, **overrides}.items()
            for s in (f"--{k.replace('_', '-')}", str(v))]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _cmd(out: Path, *extra: str, **overrides) -> list[str]:
    return [sys.executable, "-m", "shardax.cli", "train", *_flags(**overrides), *extra,
            "--out", str(out)]


def _run(out: Path, *extra: str, **overrides) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(out, *extra, **overrides), env=_env(), capture_output=True,
                          text=True, timeout=BOUND_S)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _committed(out: Path) -> list[int]:
    return list_steps(out / "checkpoints")[0]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shardax train: error:")]


def _wait_for(stream, pattern: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + BOUND_S
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            raise AssertionError(f"ended (rc {proc.poll()}) before {pattern!r}:\n"
                                 + "".join(seen)[-3000:])
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no {pattern!r} within {BOUND_S} s")


# ----------------------------------------------------------------------------- the lock


def test_a_second_trainer_on_the_same_out_is_refused_and_a_killed_ones_lock_is_stale(
        tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(_cmd(out, steps=400, ckpt_every=1000), env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first.stdout, r"^step\s+1\s", first)
        lock = json.loads((out / LOCK_FILE).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname(), lock
        second = _run(out, steps=2)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("\n") == 1 and _errors(second.stderr), second.stderr
        assert (f"--out {out} is in use by another shardax train (pid {first.pid} on "
                f"{socket.gethostname()}, started ") in second.stderr, second.stderr
        assert first.poll() is None  # the holder trains on, undisturbed
        steps = [r["step"] for r in _metrics(out)]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)  # one run's records
        first.send_signal(signal.SIGKILL)  # a lost host: no clean-up at all
        first.wait(timeout=BOUND_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / LOCK_FILE).exists()  # left behind, but no process holds it
    third = _run(out, steps=2)
    assert third.returncode == 0, third.stderr[-3000:]
    assert (f"shardax train: taking over the stale lock of pid {first.pid} on "
            f"{socket.gethostname()}") in third.stderr, third.stderr
    assert not (out / LOCK_FILE).exists()  # released at the end
    assert _committed(out) == [2]


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
