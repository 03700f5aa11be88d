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

With ``--elastic`` a failed job is started again on the processes left (a lost worker is not
replaced): ``shardax launch --nproc 4 --elastic --min-nproc 2 --max-restarts 3 -- shardax
train ...``. The workers that failed are dropped, the others stopped, and the command runs
again on ``N - lost`` processes with ``SHARDAX_RESTART`` and ``SHARDAX_ELASTIC_NPROC`` set:
``shardax train`` resumes from the newest intact checkpoint and fits its layout to the devices
left, keeping the global batch and the data order (`shardax.train.elastic`).

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
    ELASTIC_NPROC_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    RESTART_ENV,
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
    elastic: bool = False,
    min_nproc: int = 1,
    max_restarts: int | None = None,
) -> int:
    """Runs ``command`` as ``nproc`` local processes of one job; returns the exit status.

    0 when all succeed; otherwise the status of the first process that failed (128 + N for
    signal N), after stopping the rest. ``devices_per_proc`` sets each process's emulated CPU
    device count; ``timeout_s`` how long processes wait for each other to join (default 60);
    ``port`` the coordinator port (default: a free one). A command starting with a ``.py``
    file runs with this Python. A signal to the launcher is forwarded (see the module doc);
    ``stop_grace_s`` bounds the wait for the processes to save and exit.

    ``elastic``: when processes fail, the job is started again on the processes left (down
    to ``min_nproc``, at most ``max_restarts`` times, default 3; 0 restarts is the plain
    behaviour). Each attempt's processes get ``SHARDAX_RESTART`` (the attempt, 0 first) and
    ``SHARDAX_ELASTIC_NPROC`` (the first attempt's count): ``shardax train`` then resumes
    from the newest checkpoint and fits its layout to the devices left
    (`shardax.train.elastic`).

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
    if not 1 <= min_nproc <= nproc:
        raise ValueError(f"launch: --min-nproc must be in [1, --nproc {nproc}], got {min_nproc}")
    if max_restarts is not None and max_restarts < 0:
        raise ValueError(f"launch: --max-restarts must be >= 0, got {max_restarts}")
    if (min_nproc != 1 or max_restarts not in (None, 0)) and not elastic:
        raise ValueError("launch: --min-nproc and --max-restarts need --elastic")
    restarts = (3 if max_restarts is None else max_restarts) if elastic else 0
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    out = out or sys.stdout
    base = dict(os.environ if env is None else env)
    if timeout_s is not None:
        base[TIMEOUT_ENV] = str(math.ceil(timeout_s))
    base.setdefault(TIMEOUT_ENV, str(_DEFAULT_TIMEOUT_S))
    base["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
    if devices_per_proc is not None:
        base[DEVICES_ENV] = str(devices_per_proc)

    previous = {}

    def on_signal(signum, _frame):
        raise _Interrupted(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    status = 0
    try:
        current, attempt = nproc, 0
        while True:
            if elastic:
                base.update({RESTART_ENV: str(attempt), ELASTIC_NPROC_ENV: str(nproc)})
            status, lost, why = _attempt(command, current, base, port or free_port(), out,
                                         grace_s, stop_grace_s)
            if status == 0 or lost == 0 or attempt >= restarts:
                break
            left = current - lost
            if left < min_nproc:
                _say(f"{why}; {left} processes would be left, fewer than --min-nproc "
                     f"{min_nproc}: not restarting")
                break
            attempt += 1
            _say(f"elastic restart {attempt} of at most {restarts}: {why}; restarting on the "
                 f"{left} processes left (was {current})")
            current = left
    except _Interrupted as e:  # between two attempts: nothing runs
        status = 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status:
        _say(f"exit status {status}")
    return status


def _say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def _attempt(command: list[str], nproc: int, base: dict[str, str], port: int, out: IO[str],
             grace_s: float, stop_grace_s: float) -> tuple[int, int, str]:
    """One run of the job: ``(status, processes lost, why)``. Lost: those found dead when the
    job failed, killed by a signal if any was (the others usually only noticed them), else
    those that exited with an error; 0 when it succeeded or the launcher was signalled."""
    preexec = _die_with_parent_fn()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    status, lost, why = 0, 0, ""
    try:
        for i in range(nproc):
            child_env = {**base, COORDINATOR_ENV: f"127.0.0.1:{port}",
                         NUM_PROCESSES_ENV: str(nproc), PROCESS_ID_ENV: str(i)}
            try:
                procs.append(subprocess.Popen(
                    command, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec))
            except OSError as e:
                _say(f"cannot start {command[0]!r}: {e}")
                return 127, 0, ""
        # Readers start after every fork: preexec_fn is only safe while no other thread runs.
        pumps += [threading.Thread(target=_pump, args=(i, p.stdout, out, lock), daemon=True)
                  for i, p in enumerate(procs)]
        for t in pumps:
            t.start()
        _say(f"{nproc} processes on coordinator 127.0.0.1:{port}, pids "
             + " ".join(f"{i}:{p.pid}" for i, p in enumerate(procs)))
        while True:
            codes = [p.poll() for p in procs]
            failed = _failures(codes)
            if failed:
                i, code = failed[0]
                _say(f"process {i} (pid {procs[i].pid}) {_describe(code)}; stopping the others")
                for j, other in failed[1:]:
                    _say(f"process {j} (pid {procs[j].pid}) {_describe(other)} too")
                status = 128 - code if code < 0 else code
                killed = [j for j, c in failed if c < 0]
                gone = killed or [j for j, _ in failed]
                lost = len(gone)
                why = ("processes " if lost > 1 else "process ") + ", ".join(
                    f"{j} {_describe(dict(failed)[j])}" for j in gone)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(_POLL_S)
    except _Interrupted as e:
        status, lost = 128 + e.signum, 0
        _say(f"received {signal.Signals(e.signum).name}; passing SIGTERM on to every process "
             "(Ctrl-C again kills them)")
        _forward(procs, stop_grace_s)
    finally:
        _stop(procs, grace_s)
    for t in pumps:
        t.join(timeout=grace_s)
    return status, lost, why
