"""Multi-process set-up on JAX's own runtime: ``jax.distributed`` plus clear, bounded failures.

`initialize` is a thin layer over ``jax.distributed.initialize``. With no arguments it takes the
coordinator, process count and process id from the ``SHARDAX_*`` environment variables that
``shardax launch`` sets (or that you set, e.g. in a Kubernetes pod spec), and otherwise lets JAX
detect the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes). On CPU, cross-process collectives
use gloo. Every process must call it, before anything else touches JAX devices.

Failures are bounded by ``timeout_s``: an unreachable coordinator raises `DistributedError`;
processes that do not all join (one never started, or they disagree on the process count) end
with a message naming the coordinator, the process id and the count. JAX's runtime cannot
recover from a failed connect (it aborts the process), so that last case prints the message and
exits the process with status 1 rather than raising.

Example::

    import shardax.distributed
    shardax.distributed.initialize()          # under `shardax launch`, srun, a TPU pod, ...
    print(jax.process_index(), jax.process_count(), jax.device_count())
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = [
    "COORDINATOR_ENV",
    "DEVICES_ENV",
    "DistributedError",
    "ELASTIC_NPROC_ENV",
    "MODE_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "RESTART_ENV",
    "TIMEOUT_ENV",
    "batch_part",
    "initialize",
    "requested",
]

#: ``host:port`` of process 0's coordinator service.
COORDINATOR_ENV = "SHARDAX_COORDINATOR"
#: Number of processes in the job.
NUM_PROCESSES_ENV = "SHARDAX_NUM_PROCESSES"
#: This process's id, in ``[0, SHARDAX_NUM_PROCESSES)``.
PROCESS_ID_ENV = "SHARDAX_PROCESS_ID"
#: Emulated CPU devices per process (ignored by GPU and TPU backends).
DEVICES_ENV = "SHARDAX_DEVICES_PER_PROCESS"
#: Seconds allowed for all processes to join (default 300, as in JAX).
TIMEOUT_ENV = "SHARDAX_INIT_TIMEOUT"
#: ``auto``: let JAX detect the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes).
MODE_ENV = "SHARDAX_DISTRIBUTED"
#: Set by ``shardax launch --elastic``: the attempt (0 first, then each restart), which makes
#: ``shardax train`` resume from the newest checkpoint when there is one.
RESTART_ENV = "SHARDAX_RESTART"
#: Set by ``shardax launch --elastic``: the process count of the first attempt, from which
#: ``shardax train`` fits its layout to the processes left (`shardax.train.elastic`).
ELASTIC_NPROC_ENV = "SHARDAX_ELASTIC_NPROC"

_DEFAULT_TIMEOUT_S = 300
# JAX's own connect deadline is set past ours so that our message, not its abort, comes first.
_JAX_TIMEOUT_MARGIN_S = 30
_TOO_LATE = ("shardax.distributed.initialize() must run before anything uses JAX devices "
             "(jax.devices(), arrays, jit calls): call it first thing in the program")


class DistributedError(RuntimeError):
    """The processes of a multi-process job could not be connected."""


def requested() -> bool:
    """Whether the environment asks for a multi-process run.

    True when ``SHARDAX_COORDINATOR``, ``SHARDAX_NUM_PROCESSES`` or ``SHARDAX_PROCESS_ID`` is
    set (``shardax launch`` sets all three), or ``SHARDAX_DISTRIBUTED=auto``.

    Example::

        if shardax.distributed.requested():
            shardax.distributed.initialize()
    """
    explicit = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
    return any(os.environ.get(k) for k in explicit) or os.environ.get(MODE_ENV) == "auto"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(address: str, process_id: int, num_processes: int,
                          timeout_s: float) -> None:
    """Blocks until something listens at ``address``; DistributedError after ``timeout_s``."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:  # refused, unresolvable, unreachable: process 0 may be starting
            last = e
            time.sleep(0.25)
    raise DistributedError(
        f"process {process_id} of {num_processes}: cannot reach the coordinator at {address} "
        f"within {timeout_s:g} s ({last}). Is process 0 running, and is {address} its address "
        f"and a port it can open? (set by {COORDINATOR_ENV} or coordinator_address)"
    )


def _watchdog(seconds: float, message: str) -> threading.Event:
    """Prints ``message`` and ends the process unless the returned event is set in time."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(f"shardax.distributed: error: {message}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watch, name="shardax-distributed-watchdog", daemon=True).start()
    return done


def _check_agreement(num_processes: int | None, process_id: int | None, address: str) -> None:
    """Every process learns what every other was told; all raise the same error on mismatch."""
    told = np.array([-1 if num_processes is None else num_processes,
                     jax.process_index() if process_id is None else process_id], np.int32)
    seen = np.asarray(multihost_utils.process_allgather(told))  # [process_count, 2]
    counts = sorted({int(c) for c in seen[:, 0] if c >= 0})
    actual = jax.process_count()
    if counts and counts != [actual]:
        told_by = ", ".join(f"process {i}: {int(c)}" for i, (c, _) in enumerate(seen) if c >= 0)
        raise DistributedError(
            f"processes disagree on the process count: {actual} joined the coordinator at "
            f"{address}, but they were told {told_by} ({NUM_PROCESSES_ENV} or num_processes)"
        )
    ids = sorted(int(i) for i in seen[:, 1])
    if ids != list(range(actual)):
        raise DistributedError(f"process ids must be 0..{actual - 1} once each, got {ids}")


def _exit_on_uncaught_exception() -> None:
    """Makes a process that dies of an exception leave at once (status 1, 130 on Ctrl-C).

    Otherwise JAX's exit handler waits at a barrier for every other process (up to its
    shutdown timeout, 5 minutes) while they wait in a collective for this one: the job hangs
    instead of failing, and launchers that stop a job when one process exits never see it.
    """
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: int = 100,
    cluster_detection_method: str | None = None,
) -> None:
    """Connects this process to the others (``jax.distributed.initialize``); idempotent.

    Arguments left as None come from ``SHARDAX_COORDINATOR``, ``SHARDAX_NUM_PROCESSES``,
    ``SHARDAX_PROCESS_ID``, ``SHARDAX_DEVICES_PER_PROCESS`` and ``SHARDAX_INIT_TIMEOUT``, then
    from JAX's cluster detection (SLURM, Open MPI, Cloud TPU, Kubernetes; or name one with
    ``cluster_detection_method``). ``local_device_count`` sets the number of emulated CPU
    devices of this process. Returns once every process has joined and a test collective has
    run; a second call is a no-op (ValueError if it asks for a different set-up). From then
    on an uncaught exception ends the process at once rather than waiting for the others.

    Example::

        initialize("10.0.0.1:1234", num_processes=2, process_id=0)    # on host 0
        initialize("10.0.0.1:1234", num_processes=2, process_id=1)    # on host 1
    """
    address = coordinator_address or os.environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    local_device_count = (local_device_count if local_device_count is not None
                          else _env_int(DEVICES_ENV))
    timeout_s = timeout_s if timeout_s is not None else (_env_int(TIMEOUT_ENV)
                                                         or _DEFAULT_TIMEOUT_S)

    if jax.distributed.is_initialized():
        have = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
        want = {"num_processes": num_processes, "process_id": process_id}
        differ = {k: v for k, v in want.items() if v is not None and v != have[k]}
        if differ:
            raise ValueError(f"jax.distributed is already initialized with {have}; "
                             f"initialize() was called again with {differ}")
        return

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not (
            0 <= process_id < num_processes):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if local_device_count is not None and local_device_count < 1:
        raise ValueError(f"local_device_count must be >= 1, got {local_device_count}")
    if address is not None:
        _split_address(address)
    explicit = None not in (address, num_processes, process_id)

    try:
        if local_device_count is not None:
            jax.config.update("jax_num_cpu_devices", local_device_count)
    except RuntimeError as e:  # the backends already started
        raise DistributedError(_TOO_LATE) from e
    # Only the CPU backend reads it; older JAX defaulted to no cross-process CPU collectives.
    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    start = time.monotonic()
    if explicit and process_id != 0:
        _wait_for_coordinator(address, process_id, num_processes, timeout_s)
    who = (f"process {process_id if process_id is not None else '?'} of "
           f"{num_processes if num_processes is not None else '?'} "
           f"(coordinator {address or 'auto-detected'})")
    remaining = max(timeout_s - (time.monotonic() - start), 1.0)
    done = _watchdog(remaining, (
        f"{who}: not all processes joined within {timeout_s:g} s. Check that every process "
        f"was started, with the same process count ({NUM_PROCESSES_ENV}) and a distinct "
        f"process id in [0, count) ({PROCESS_ID_ENV}), and that all reach the coordinator."
    ))
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num_processes,
            process_id=process_id,
            cluster_detection_method=cluster_detection_method,
            initialization_timeout=int(timeout_s) + _JAX_TIMEOUT_MARGIN_S,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
        # Starting the backends exchanges the device topology: a second place to wait on peers.
        _check_agreement(num_processes, process_id, address or "auto-detected")
        _exit_on_uncaught_exception()
    except ValueError as e:
        if "must be defined" not in str(e) and "should be defined" not in str(e):
            raise
        raise ValueError(
            "no multi-process set-up found: pass coordinator_address, num_processes and "
            f"process_id, set {COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}, or "
            "run under SLURM (srun), Open MPI (mpirun), Kubernetes or a Cloud TPU pod "
            f"(JAX: {e})"
        ) from None
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise DistributedError(_TOO_LATE) from e
        raise
    finally:
        done.set()



def batch_part(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[int, int]:
    """Which rows of a global batch this process supplies: part ``index`` of ``count``.

    ``jax.make_array_from_process_local_data(sharding, rows, shape)`` needs from each process
    exactly the rows its devices hold. When the batch is split over the processes in device
    order this is ``(jax.process_index(), jax.process_count())``; when a model axis spans the
    processes (e.g. mesh ``tp=2,fsdp=4`` on 2 hosts) they hold the same rows and get the same
    part. Raises ValueError when this process's rows are not one contiguous block.

    Example::

        index, count = batch_part(NamedSharding(mesh, P("fsdp")), (32, 128))
        rows = global_batch[index * 32 // count:(index + 1) * 32 // count]
    """
    size = shape[0]
    blocks = sorted({index[0].indices(size)[:2] if index else (0, size)
                     for index in sharding.addressable_devices_indices_map(tuple(shape)).values()})
    lo, hi = blocks[0][0], max(stop for _, stop in blocks)
    reach = lo
    for start, stop in blocks:
        if start > reach:
            break
        reach = max(reach, stop)
    rows = hi - lo
    if reach < hi or size % rows or lo % rows:
        raise ValueError(
            f"process {jax.process_index()} holds rows {blocks} of a batch of {size} sharded "
            f"as {sharding}: not one contiguous block of size dividing {size}; order the mesh "
            "so that each process's devices hold consecutive rows"
        )
    return lo // rows, size // rows
