"""``shardax launch``: run N local processes of one command as one JAX job (gloo on CPU).

The local analogue of ``torchrun --standalone``: process ``i`` gets ``SHARDAX_COORDINATOR``
(``127.0.0.1:PORT``), ``SHARDAX_NUM_PROCESSES`` and ``SHARDAX_PROCESS_ID=i`` in its environment,
which `shardax.distributed.initialize` (and so ``shardax train``) reads. Every output line is
prefixed with ``[i]``. When a process fails or is killed, the others get SIGTERM, then SIGKILL
after ``grace_s``, and the launcher exits with the failed process's status; each process is its
own process group, so nothing it started is left behind.

SIGTERM, SIGINT or SIGHUP sent to the launcher (a scheduler preempting the job, Ctrl-C) is passed
on to every process as SIGTERM, and the launcher waits up to ``stop_grace_s`` for them to finish:
``shardax train`` processes then agree on a step, save it together and exit. A second SIGINT
kills them at once. The launcher exits with 128 + the signal number it received.

    shardax launch --nproc 2 --devices-per-proc 4 -- shardax train --mesh fsdp=-1 --steps 50

Example::

    status = launch(["python", "train.py"], nproc=2, devices_per_proc=4)
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from shardax.distributed import (
    COORDINATOR_ENV,
    DEVICES_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    TIMEOUT_ENV,
)

__all__ = ["free_port", "launch"]

_POLL_S = 0.05
_DEFAULT_TIMEOUT_S = 60  # local processes start together: a minute to join is plenty


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it).

    Example::

        port = free_port()      # e.g. 41237
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent_fn():
    """A function for ``preexec_fn`` that has the kernel SIGKILL the child if the launcher
    dies, or None off Linux. Looked up here so the child, between fork and exec, only calls."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigkill = 1, int(signal.SIGKILL)
    return lambda: prctl(pr_set_pdeathsig, sigkill)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _pump(index: int, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"[{index}] {line}\n")
            out.flush()
    stream.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process group, SIGKILL what is left after ``grace_s``, reap all."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # also reaches anything a process started
    for p in procs:
        p.wait()


def _forward(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every process group, then wait up to ``grace_s`` for all to exit (they may
    be saving a checkpoint); a further SIGINT to the launcher ends the wait at once."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        try:
            time.sleep(_POLL_S)
        except _Interrupted as e:
            if e.signum == signal.SIGINT:
                return  # Ctrl-C again: the caller's _stop kills what is left


def _failures(codes: list[int | None]) -> list[tuple[int, int]]:
    """``(index, exit code)`` of the processes that failed, likeliest cause first: one killed
    by a signal (OOM killer, a scheduler, a user) before one that exited with an error, which
    is often just a peer noticing that the other died (a broken collective)."""
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    return sorted(failed, key=lambda f: (f[1] > 0, f[0]))


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    stop_grace_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    out: IO[str] | None = None,
) -> int:
    """Runs ``command`` as ``nproc`` local processes of one job; returns the exit status.

    0 when all succeed; otherwise the status of the first process that failed (128 + N for
    signal N), after stopping the rest. ``devices_per_proc`` sets each process's emulated CPU
    device count; ``timeout_s`` how long processes wait for each other to join (default 60);
    ``port`` the coordinator port (default: a free one). A command starting with a ``.py``
    file runs with this Python. A signal to the launcher is forwarded (see the module doc);
    ``stop_grace_s`` bounds the wait for the processes to save and exit.

    Example::

        launch([sys.executable, "-m", "shardax.cli", "train", "--steps", "10"], nproc=2,
               devices_per_proc=4)
    """
    command = list(command)
    if not command:
        raise ValueError("launch: no command given (usage: shardax launch --nproc N -- CMD...)")
    if nproc < 1:
        raise ValueError(f"launch: --nproc must be >= 1, got {nproc}")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"launch: --devices-per-proc must be >= 1, got {devices_per_proc}")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"launch: --port must be in [1, 65535], got {port}")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 1):
        raise ValueError(f"launch: --timeout must be a number of seconds >= 1, got {timeout_s}")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    out = out or sys.stdout
    port = port or free_port()
    base = dict(os.environ if env is None else env)
    if timeout_s is not None:
        base[TIMEOUT_ENV] = str(math.ceil(timeout_s))
    base.setdefault(TIMEOUT_ENV, str(_DEFAULT_TIMEOUT_S))
    base["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
    if devices_per_proc is not None:
        base[DEVICES_ENV] = str(devices_per_proc)

    def say(message: str) -> None:
        print(f"[launch] {message}", file=sys.stderr, flush=True)

    preexec = _die_with_parent_fn()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    previous = {}

    def on_signal(signum, _frame):
        raise _Interrupted(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    status = 0
    try:
        for i in range(nproc):
            child_env = {**base, COORDINATOR_ENV: f"127.0.0.1:{port}",
                         NUM_PROCESSES_ENV: str(nproc), PROCESS_ID_ENV: str(i)}
            try:
                procs.append(subprocess.Popen(
                    command, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec))
            except OSError as e:
                say(f"cannot start {command[0]!r}: {e}")
                status = 127
                return status
        # Readers start after every fork: preexec_fn is only safe while no other thread runs.
        pumps += [threading.Thread(target=_pump, args=(i, p.stdout, out, lock), daemon=True)
                  for i, p in enumerate(procs)]
        for t in pumps:
            t.start()
        say(f"{nproc} processes on coordinator 127.0.0.1:{port}, pids "
            + " ".join(f"{i}:{p.pid}" for i, p in enumerate(procs)))
        while True:
            codes = [p.poll() for p in procs]
            failed = _failures(codes)
            if failed:
                i, code = failed[0]
                say(f"process {i} (pid {procs[i].pid}) {_describe(code)}; stopping the others")
                for j, other in failed[1:]:
                    say(f"process {j} (pid {procs[j].pid}) {_describe(other)} too")
                status = 128 - code if code < 0 else code
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(_POLL_S)
    except _Interrupted as e:
        status = 128 + e.signum
        say(f"received {signal.Signals(e.signum).name}; passing SIGTERM on to every process "
            "(Ctrl-C again kills them)")
        _forward(procs, stop_grace_s)
    finally:
        _stop(procs, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=grace_s)
    if status:
        say(f"exit status {status}")
    return status
