"""Helpers for tests that run the ``shardax`` command in subprocesses, as users meet it: the
environment, the command line, a run's metrics and committed checkpoints, the one-line error
contract, and waiting for a line of a running process's output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shardax.train.run.checkpoint import list_steps

SRC = Path(__file__).resolve().parents[1] / "src"


def cli_env(**extra: str) -> dict[str, str]:
    """Environment of a ``shardax`` subprocess: this source tree first on the path, CPU
    devices; ``extra`` variables added."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", **extra}


def cli_command(*args: object) -> list[str]:
    """The command line ``shardax ARGS...`` (this interpreter, ``-m shardax.cli``)."""
    return [sys.executable, "-m", "shardax.cli", *map(str, args)]


def run_cli(*args: object, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``shardax ARGS...`` to the end (`cli_env` unless ``env``); output captured."""
    return subprocess.run(cli_command(*args), env=cli_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


# Runs each argv of a JSON list through `shardax.cli.main` (what the `shardax` script runs) in
# this one process. File descriptors 1 and 2 are pointed at a file per case, so whatever a case
# writes there (Python, or C code such as XLA's logging) is that case's output.
_BATCH_DRIVER = r"""
import json, os, sys, tempfile
from shardax.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile("w+b") for fd in (1, 2)}
    try:
        for fd, f in files.items():
            os.dup2(f.fileno(), fd)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
    out, err = (files[fd].seek(0) or files[fd].read().decode() for fd in (1, 2))
    from jax._src import xla_bridge
    results.append({"code": code, "out": out, "err": err, "backend": bool(xla_bridge._backends)})
print(json.dumps(results))
"""


def run_cli_batch(argvs: list[list[object]], env: dict[str, str] | None = None,
                  timeout: float = 300, cwd: str | Path | None = None
                  ) -> list[subprocess.CompletedProcess]:
    """Runs ``shardax ARGV...`` for each of ``argvs``, in order, in ONE fresh process (the
    entry point's `shardax.cli.main` per case): one interpreter start-up for many cases that
    end early (bad input). Each result holds its exit code, stdout and stderr (everything
    written to file descriptors 1 and 2), and ``backend``: whether a JAX backend had been
    started by the end of that case (cases after one that started it share it)."""
    args = [[str(a) for a in argv] for argv in argvs]
    proc = subprocess.run([sys.executable, "-c", _BATCH_DRIVER, json.dumps(args)],
                          env=cli_env() if env is None else env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = []
    for argv, r in zip(args, json.loads(proc.stdout.strip().splitlines()[-1])):
        done = subprocess.CompletedProcess(["shardax", *argv], r["code"], r["out"], r["err"])
        done.backend = r["backend"]
        results.append(done)
    return results


def read_metrics(out: Path) -> list[dict]:
    """The records of a run directory's ``metrics.jsonl``."""
    text = (Path(out) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def committed_steps(out: Path) -> list[int]:
    """A run directory's committed checkpoint steps, read from the file system (a
    Checkpointer would clean up)."""
    return list_steps(Path(out) / "checkpoints")[0]


def stopped_at(run: Path, dest: Path, step: int) -> Path:
    """A copy of a finished run directory as if it had stopped right after checkpoint
    ``step`` (the later checkpoints removed)."""
    shutil.copytree(run, dest)
    for step_dir in (dest / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > step:
            shutil.rmtree(step_dir)
    return dest


def compile_flags() -> str:
    """The suite's XLA flags (conftest.py) without the emulated device count, for a process
    that sets its own devices (a multi-process run, an example)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def multiprocess_env() -> dict[str, str]:
    """Environment of every process of a multi-process run: this source tree, CPU, no forced
    device count.

    No persistent compilation cache: on CPU only process 0 can hit it (process 1's keys
    differ and it may not write), so process 0 would race ahead and gloo's 30 s rendezvous
    at the first collective would fail on a busy machine.
    """
    env = cli_env(XLA_FLAGS=compile_flags())
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def wait_for_line(stream, pattern: str, proc: subprocess.Popen, seconds: float) -> str:
    """The first line of ``stream`` (a running ``proc``'s output) matching ``pattern``; an
    AssertionError with what was read if the process ends first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            raise AssertionError(f"ended (rc {proc.poll()}) before {pattern!r}:\n"
                                 + "".join(seen)[-3000:])
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no {pattern!r} within {seconds} s")


def assert_one_line_error(proc: subprocess.CompletedProcess, command: str, *needles: str) -> str:
    """The CLI's contract for bad input: exit status 2 and one line on stderr,
    ``shardax COMMAND: error: ...``, naming each of ``needles``; returns the line."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"shardax {command}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
