"""Helpers for tests that run the ``shardax`` command in subprocesses, as users meet it: the
environment, the command line, a run's metrics and committed checkpoints, the one-line error
contract, and waiting for a line of a running process's output."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
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
    """Runs ``shardax ARGS...`` to the end in a fresh process (`cli_env` unless ``env``);
    output captured. The process is forked from a fork server (`_FORK_SERVER`) that has
    imported what the commands import: no interpreter start-up and seconds of imports each."""
    argv = [str(a) for a in args]
    return _forked(["shardax", *argv], {"argv": argv}, env, timeout, cwd)


def run_python(*argv: object, env: dict[str, str] | None = None, timeout: float = 300,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``python ARGV...`` to the end, ``ARGV`` being ``-c CODE ARGS...`` or
    ``SCRIPT ARGS...``, in a fresh process forked like `run_cli`'s (`cli_env` unless ``env``);
    output captured: ``run_python("-c", code, "arg")``, ``run_python(script, "arg")``."""
    first, *rest = (str(a) for a in argv)
    if first == "-c":
        code, *args = rest
        return _forked([sys.executable, "-c", code, *args], {"code": code, "argv": args},
                       env, timeout, cwd)
    script = os.path.abspath(first)
    return _forked([sys.executable, script, *rest], {"script": script, "argv": rest}, env,
                   timeout, cwd)


def _forked(command: list[str], request: dict, env: dict[str, str] | None, timeout: float,
            cwd: str | Path | None) -> subprocess.CompletedProcess:
    env = cli_env() if env is None else env
    with _ForkServer.take(env) as server:
        code, out, err = server.run(request, env, os.fspath(cwd or os.getcwd()), timeout)
    return subprocess.CompletedProcess(command, code, out, err)


# The fork server: imports `shardax.cli` and the modules its commands import, without starting
# a JAX backend (forking a process with XLA's threads running is unsafe; JAX warns then), then
# forks one child per request (a JSON line on stdin) and answers with the child's pid, then its
# exit status. The child is what `python -m shardax.cli ARGV...` would be in that directory and
# environment (the server's environment is the same but PYTEST_CURRENT_TEST): stdin from
# /dev/null, file descriptors 1 and 2 to the given files, `shardax.cli.main` run and the
# interpreter left the ordinary way (atexit handlers run, buffered output flushed, an escaping
# exception printed with exit status 1).
_FORK_SERVER = r"""
import gc, importlib, json, os, runpy, sys, threading

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
import matplotlib
matplotlib.use("Agg")  # what `shardax train` does before its loss.png
import matplotlib.pyplot

# The preloaded modules' objects: a child's collections no longer walk them (nor write to
# their pages, which the child shares with this server until written).
gc.freeze()
from jax._src import xla_bridge
# jaxlib keeps one idle native thread from its import on; XLA's (and Python's) would be unsafe.
assert threading.active_count() == 1 and not xla_bridge._backends, "a backend or thread started"
os.write(1, b"ready\n")
pending = b""
while True:
    while b"\n" not in pending:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        if "code" in request:  # python -c CODE ARGV...
            sys.argv = ["-c", *argv]
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        elif "script" in request:  # python SCRIPT ARGV...
            sys.argv = [request["script"], *argv]
            sys.path[0] = os.path.dirname(os.path.realpath(request["script"]))
            runpy.run_path(request["script"], run_name="__main__")
        else:  # python -m shardax.cli ARGV...
            sys.argv = [sys.modules["shardax.cli"].__file__, *argv]
            sys.exit(sys.modules["shardax.cli"].main(argv))
        sys.exit(0)
    os.write(1, json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    os.write(1, json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
"""

# What `shardax`'s commands import after parsing their flags (a module left out here is
# imported by the child itself, as a fresh process would).
_PRELOAD = ["shardax.cli", "tyro", "shardax.train.config", "shardax.train.loop",
            "shardax.plan.command", "shardax.train.generate", "shardax.train.evaluate",
            "shardax.train.export"]


class _ForkServer:
    """A fork server (see `_FORK_SERVER`) for one environment; kept for this test process's
    life and used by one caller at a time (callers in parallel threads get one each)."""

    _idle: dict[tuple, list[_ForkServer]] = {}  # by environment, the last used last
    _lock = threading.Lock()
    KEEP = 4  # idle servers kept (~250 MB each); the least recently used is closed first

    @classmethod
    @contextlib.contextmanager
    def take(cls, env: dict[str, str]) -> Iterator[_ForkServer]:
        key = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
        with cls._lock:
            idle = cls._idle.setdefault(key, [])
            server = idle.pop() if idle else None
        server = server or cls(env)
        try:
            yield server
        except BaseException:
            server.close()  # e.g. a timeout: the next caller gets a new one
            raise
        with cls._lock:
            cls._idle[key] = [*cls._idle.pop(key, []), server]
            while sum(map(len, cls._idle.values())) > cls.KEEP:
                oldest = next(k for k, idle in cls._idle.items() if idle)
                cls._idle[oldest].pop(0).close()

    def __init__(self, env: dict[str, str]):
        self.files = tempfile.mkdtemp(prefix="shardax-fork-server-")
        self.log = open(os.path.join(self.files, "server.err"), "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, json.dumps(_PRELOAD)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        ready = self.proc.stdout.readline()
        self.log.seek(0)
        noise = self.log.read().decode()
        # A fresh `shardax` process would print what the imports print; the children would not.
        assert ready == b"ready\n" and not noise, (ready, noise[-3000:])
        atexit.register(self.close)

    def run(self, request: dict, env: dict[str, str], cwd: str, timeout: float
            ) -> tuple[int, str, str]:
        out, err = (os.path.join(self.files, name) for name in ("out", "err"))
        request = {**request, "env": env, "cwd": cwd, "out": out, "err": err}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        pid = json.loads(self._line(timeout))["pid"]
        try:
            code = json.loads(self._line(timeout))["code"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._line(timeout)
            raise
        return code, *(Path(p).read_text(errors="replace") for p in (out, err))

    def _line(self, timeout: float) -> bytes:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("shardax (forked)", timeout)
        line = self.proc.stdout.readline()
        assert line, f"the fork server ended (rc {self.proc.wait()})"
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.files, ignore_errors=True)


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
    """Runs ``shardax ARGV...`` for each of ``argvs``, in order, in ONE fresh process (forked
    as `run_cli`'s; the entry point's `shardax.cli.main` per case): one process for many cases
    that end early (bad input). Each result holds its exit code, stdout and stderr (everything
    written to file descriptors 1 and 2), and ``backend``: whether a JAX backend had been
    started by the end of that case (cases after one that started it share it)."""
    args = [[str(a) for a in argv] for argv in argvs]
    proc = run_python("-c", _BATCH_DRIVER, json.dumps(args), env=env, timeout=timeout, cwd=cwd)
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


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie does too, until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
