"""The plan search's compile server: compiles each candidate layout in its own process, forked
from this one (``shardax plan --search`` starts it once per search).

    python -m shardax.plan.worker

It imports the compiler without starting a JAX backend, prints ``ready``, then reads requests,
one JSON object a line on stdin: ``{"id": N, "fields": {...}, "out": PATH, "err": PATH,
"memory": BYTES}`` (``fields``: `TrainConfig` fields; ``memory``: one target device's memory,
`resolve`'s ``device_memory``, or null). Each request forks a child that compiles and writes the
`Compiled` result as JSON to ``out``, its stderr going to ``err``; the server answers
``{"id": N, "code": STATUS}`` when the child ends (0, 1 with ``shardax plan worker: ...`` on
stderr, or minus the signal that ended it: a compiler crash ends only its child). At the end of
stdin the server kills the children still running and exits.

Forking skips each compile's interpreter start-up and imports (seconds each); forking is safe
because no backend (and none of XLA's threads) runs in the server.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import select
import signal
import sys
import threading
import time
import traceback

from shardax.plan.estimate import compile_config, config_from_dict
from shardax.train.resolve import resolve


def compile_to(fields: dict, out: str, memory: float | None) -> int:
    """Compiles the configuration of ``fields`` for a device of ``memory`` bytes and writes the
    `Compiled` result as JSON to ``out``: 0, or 1 with the reason on stderr."""
    try:
        compiled = compile_config(resolve(config_from_dict(fields), memory, weights=False))
    except Exception as e:
        print(f"shardax plan worker: {type(e).__name__}: {str(e).splitlines()[0]}",
              file=sys.stderr)
        return 1
    with open(out, "w") as f:
        json.dump(dataclasses.asdict(compiled), f)
    return 0


def _child(request: dict) -> None:
    """In a forked child: the request's compile, then exit (never returns)."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        code = compile_to(request["fields"], request["out"], request["memory"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(message: dict) -> None:
    try:
        os.write(1, json.dumps(message).encode() + b"\n")
    except BrokenPipeError:  # the search has gone: the children are killed at end of stdin
        pass


def serve() -> None:
    """The server loop (see the module docstring)."""
    if threading.active_count() != 1:
        sys.exit("shardax plan worker: a thread started before forking")
    gc.freeze()  # the imports: not walked by the children's collections (nor copied on write)
    os.write(1, b"ready\n")
    children: dict[int, int] = {}  # pid -> request id
    pending, reading = b"", True
    while reading or children:
        if reading and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the search ended or stopped: nothing running is wanted
                reading = False
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
        elif not reading:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _answer({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
