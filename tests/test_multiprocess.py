"""Multi-process runs on one machine: `shardax launch` + `jax.distributed` with gloo on CPU.

Real processes, as on a cluster: `shardax launch --nproc 2 --devices-per-proc 4 -- python -m
shardax.cli train ...` (2 processes x 4 emulated CPU devices = the 8 devices of the
single-process runs, which run in this pytest process). What is checked:

- the global batch assembled from the processes' rows equals the single-process batch,
  on meshes where the processes split the batch and where they share it (``tp=2,fsdp=4``);
- 2 processes give the single-process per-step losses and gradient norms (SGD, rtol 1e-6:
  float32 reduction order differs between gloo and in-process all-reduces; seen 1e-7);
- a checkpoint written by 2 processes resumes in 1 process x 8 devices on another mesh, and in
  2 processes on another mesh (same rtol);
- (a killed worker: test_elastic.py kills one of a real run's workers, the launcher stops the
  others and the job resumes from the last committed checkpoint; the launcher's stop without
  --elastic and its exit status are checked below with small scripts);
- an unreachable coordinator, a process that never joins, and processes that disagree on the
  process count fail with a clear message within a bounded time;
- the launcher prefixes lines, propagates the failing status, and SIGKILLs what ignores SIGTERM.

Runs are tiny (llama-tiny, 8 x 32 tokens, 6 steps, checkpoints at 3 and 6); the
single-process ones run in this pytest process.
"""

import io
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _cli import alive, cli_command, committed_steps, multiprocess_env, read_metrics
from _reference import TINY_TRAIN

from shardax.launch import free_port, launch
from shardax.train.loop import TrainConfig, train

pytestmark = pytest.mark.multiprocess

TINY = {**TINY_TRAIN, "steps": 6, "ckpt_every": 3, "eval_every": 100}  # val_loss: last step
REL = 1e-6  # 1 vs 2 processes, or another mesh: float32 reduction order (seen 1.1e-7)
BOUND_S = 300  # no subprocess may outlive this; a hang fails the test instead of CI


def _flags(**overrides) -> list[str]:
    return [s for k, v in {**TINY, **overrides}.items()
            for s in ((f"--{k.replace('_', '-')}",) if v is True else
                      (f"--{k.replace('_', '-')}", str(v)))]


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """Environment of every subprocess (`_processes.multiprocess_env`)."""
    return multiprocess_env()


def _launch_train(env, out: Path, *flags: str, nproc: int = 2) -> list[str]:
    return cli_command("launch", "--nproc", str(nproc), "--devices-per-proc", str(8 // nproc), "--",
                *cli_command("train", *_flags(), *flags, "--out", str(out)))


def _run(cmd: list[str], env, timeout: float = BOUND_S) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (f"exit status {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def _series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def _resume_copy(run: Path, dest: Path, keep: int) -> Path:
    """A copy of a finished run as it was right after checkpoint ``keep`` committed."""
    shutil.copytree(run, dest)
    for d in (dest / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > keep:
            shutil.rmtree(d)
    assert committed_steps(dest) == [keep]
    return dest


def _assert_close(got: dict[int, float], want: dict[int, float], rtol: float = REL) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    steps = sorted(want)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=rtol,
                               atol=0, err_msg=f"steps {steps}")


# ----------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: 1 process x 8 devices, ``--mesh fsdp=-1``, in this pytest process."""
    out = tmp_path_factory.mktemp("one_process") / "run"
    train(TrainConfig(out=str(out), mesh="fsdp=-1", **TINY))
    return out


@pytest.fixture(scope="module")
def two_processes(env, tmp_path_factory):
    """`shardax launch --nproc 2 --devices-per-proc 4 -- ... train --mesh fsdp=-1`."""
    out = tmp_path_factory.mktemp("two_processes") / "run"
    stdout = _ok(_run(_launch_train(env, out, "--mesh", "fsdp=-1"), env))
    return out, stdout


# ----------------------------------------------------------------------------- data


BATCH_CHECK = """
import sys
import numpy as np
from shardax import distributed
distributed.initialize()
distributed.initialize()  # a second call is a no-op
try:
    distributed.initialize(num_processes=3)
    raise SystemExit("a conflicting second initialize() was accepted")
except ValueError as e:
    assert "already initialized with {'num_processes': 2" in str(e), e
import jax
from jax.experimental import multihost_utils
from shardax.data import lm_data as data_lib
from shardax.train.loop import TrainConfig, prepare

tokens = data_lib.load_bytes(data_lib.default_corpus("train"))
for mesh in sys.argv[1:]:
    run = prepare(TrainConfig(mesh=mesh, batch_size=8, seq_len=32, out=sys.argv[0] + ".none"))
    local = run.inputs.train.batch(5)
    for field, want in zip(run.inputs.batch(5),
                           data_lib.TokenBatches(tokens, 32, 8, seed=0).batch(5)):
        got = np.asarray(multihost_utils.process_allgather(field, tiled=True))
        assert np.array_equal(got, want), (mesh, jax.process_index())
    print(f"process {jax.process_index()}: {mesh}: {len(local[0])} local rows, global batch ok")

# a weighted mixture of two files: the same global batch as one process computes
from shardax.data.mixture_data import MixtureBatches
files = [str(p) for p in data_lib.default_corpus("train")[:2]]
run = prepare(TrainConfig(mesh="fsdp=-1", batch_size=8, seq_len=32, eval_every=0,
                          data=[f"{files[0]}:0.7,{files[1]}:0.3"], out=sys.argv[0] + ".mix"))
want = MixtureBatches([(f, data_lib.load_bytes([f])) for f in files], [0.7, 0.3], 32, 8,
                      seed=0).batch(5)
for field, w in zip(run.inputs.batch(5), want):
    got = np.asarray(multihost_utils.process_allgather(field, tiled=True))
    assert np.array_equal(got, w), ("mixture", jax.process_index())
print(f"process {jax.process_index()}: mixture: global batch ok")
"""


def test_global_batch_equals_the_single_process_batch(env, tmp_path):
    script = tmp_path / "batch_check.py"
    script.write_text(BATCH_CHECK)
    meshes = ["fsdp=-1", "dp=2,fsdp=2,tp=2", "tp=2,fsdp=4"]
    stdout = _ok(_run(cli_command("launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                           str(script), *meshes), env))
    for p in (0, 1):
        # Split over the processes: 4 rows each; tp spanning the processes: all 8 rows each.
        for mesh, rows in zip(meshes, (4, 4, 8)):
            assert f"[{p}] process {p}: {mesh}: {rows} local rows, global batch ok" in stdout
        assert f"[{p}] process {p}: mixture: global batch ok" in stdout


# ----------------------------------------------------------------------------- training


def test_two_processes_train_like_one_process(one_process, two_processes):
    out, stdout = two_processes
    ref, got = read_metrics(one_process), read_metrics(out)
    for key in ("loss", "grad_norm", "val_loss"):
        _assert_close(_series(got, key), _series(ref, key))
    assert "[0] shardax train: llama-tiny" in stdout and "on 8 devices" in stdout
    assert "[1] shardax train" not in stdout  # only process 0 reports
    assert committed_steps(out) == [3, 6]


def test_two_process_checkpoint_resumes_in_one_process_on_another_mesh(two_processes,
                                                                        tmp_path):
    straight = read_metrics(two_processes[0])
    out = _resume_copy(two_processes[0], tmp_path / "run", keep=3)
    records = train(TrainConfig(out=str(out), mesh="dp=2,fsdp=4", resume=True, **TINY))
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ("loss", "grad_norm", "val_loss"):
        _assert_close(_series(records, key), _series(straight, key))


def test_two_process_checkpoint_resumes_in_two_processes_on_another_mesh(env, two_processes,
                                                                          tmp_path):
    straight = read_metrics(two_processes[0])
    out = _resume_copy(two_processes[0], tmp_path / "run", keep=3)
    # tp spans the two processes: each one feeds the whole batch.
    _ok(_run(_launch_train(env, out, "--mesh", "tp=2,fsdp=4", "--resume"), env))
    for key in ("loss", "grad_norm", "val_loss"):
        _assert_close(_series(read_metrics(out), key), _series(straight, key))


# ----------------------------------------------------------------------------- faults


def test_sigterm_to_the_launcher_saves_one_step_in_every_process(env, two_processes,
                                                                  tmp_path):
    """A scheduler preempts the job: SIGTERM to `shardax launch` reaches every worker; they
    agree on a step, save it together, and the launcher exits with 143."""
    out = tmp_path / "run"
    cmd = cli_command("launch", "--nproc", "2", "--devices-per-proc", "4", "--",
               *cli_command("train", *_flags(steps=40, ckpt_every=100), "--mesh", "fsdp=-1",
                     "--out", str(out)))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + BOUND_S
        for line in iter(proc.stdout.readline, ""):
            if re.match(r"\[0\] step\s+2\s", line):
                break
            assert time.monotonic() < deadline, "no step 2 in time"
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "received SIGTERM; passing SIGTERM on to every process" in err
    stopped = re.findall(r"\[(\d)\] shardax train: stopped at step (\d+), saved; continue "
                         r"with --resume", rest)
    assert len(stopped) == 1 and stopped[0][0] == "0", rest[-3000:]  # process 0 says so
    assert "Traceback" not in rest
    step = int(stopped[0][1])
    assert committed_steps(out) == [step] and 2 <= step < TINY["steps"]
    state = out / "checkpoints" / str(step) / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    straight = read_metrics(two_processes[0])
    for key in ("loss", "grad_norm"):  # the steps before the stop: exactly the straight run
        assert _series(read_metrics(out), key) == {s: v for s, v in _series(straight, key).items()
                                              if s <= step}
    # (Resuming a two-process checkpoint, bit for bit: test_killed_worker_... below.)


def test_unreachable_coordinator_is_a_clear_error(env, tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = _run(cli_command("train", *_flags(), "--out", str(tmp_path / "run")),
                {**env, "SHARDAX_COORDINATOR": address, "SHARDAX_NUM_PROCESSES": "2",
                 "SHARDAX_PROCESS_ID": "1", "SHARDAX_INIT_TIMEOUT": "3"}, timeout=120)
    assert proc.returncode == 1
    assert (f"shardax train: error: process 1 of 2: cannot reach the coordinator at {address} "
            "within 3 s") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_process_that_never_joins_is_a_clear_error(env, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = _run(cli_command("train", *_flags(), "--out", str(tmp_path / "run")),
                {**env, "SHARDAX_COORDINATOR": address, "SHARDAX_NUM_PROCESSES": "2",
                 "SHARDAX_PROCESS_ID": "0", "SHARDAX_INIT_TIMEOUT": "3"}, timeout=120)
    assert proc.returncode == 1
    assert (f"process 0 of 2 (coordinator {address}): not all processes joined within 3 s"
            in proc.stderr)


def test_processes_that_disagree_on_the_count_fail_clearly(env, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        cli_command("train", *_flags(), "--out", str(tmp_path / "run")),
        env={**env, "SHARDAX_COORDINATOR": address, "SHARDAX_NUM_PROCESSES": count,
             "SHARDAX_PROCESS_ID": str(i), "SHARDAX_INIT_TIMEOUT": "60"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, count in enumerate(("2", "3"))]
    try:
        results = [p.communicate(timeout=BOUND_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 1, err[-3000:]
        assert (f"error: processes disagree on the process count: 2 joined the coordinator at "
                f"{address}, but they were told process 0: 2, process 1: 3") in err


def test_initialize_without_a_set_up_is_a_clear_error(env):
    clean = {k: v for k, v in env.items()
             if not k.startswith(("SHARDAX_", "SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR"))
             and k != "KUBERNETES_SERVICE_HOST"}
    proc = _run([sys.executable, "-c", "from shardax import distributed\n"
                 "try:\n    distributed.initialize()\n"
                 "except ValueError as e:\n    print(e)"], clean, timeout=120)
    assert _ok(proc).startswith("no multi-process set-up found: pass coordinator_address, ")
    assert "SHARDAX_COORDINATOR" in proc.stdout


# ----------------------------------------------------------------------------- launcher


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# launch() forks from this process, where JAX runs threads; the children exec at once.
_fork_ok = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


@_fork_ok
def test_launch_sets_the_environment_and_prefixes_lines():
    out = io.StringIO()
    code = ("import os; e = os.environ; print(e['SHARDAX_PROCESS_ID'], e['SHARDAX_NUM_PROCESSES'],"
            " e['SHARDAX_COORDINATOR'], e['SHARDAX_DEVICES_PER_PROCESS']); print('bye')")
    assert launch(_py(code), 3, devices_per_proc=2, port=12345, out=out) == 0
    lines = out.getvalue().splitlines()
    for i in range(3):
        assert f"[{i}] {i} 3 127.0.0.1:12345 2" in lines
        assert f"[{i}] bye" in lines
    assert len(lines) == 6


@_fork_ok
def test_launch_stops_everything_when_one_process_fails(capsys, tmp_path):
    out = io.StringIO()
    ready = tmp_path / "ready"
    # Process 0 ignores SIGTERM (as a process stuck in C code would): it must get SIGKILL.
    # Process 1 fails once process 0 is set up.
    code = ("import os, signal, sys, time; print(os.getpid(), flush=True)\n"
            "if os.environ['SHARDAX_PROCESS_ID'] == '1':\n"
            f"    while not os.path.exists({str(ready)!r}): time.sleep(0.01)\n"
            "    sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({str(ready)!r}, 'w').close(); time.sleep(600)")
    assert launch(_py(code), 2, grace_s=1.0, out=out) == 3
    pids = [int(line.split()[1]) for line in out.getvalue().splitlines()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert "process 1 (pid" in capsys.readouterr().err


@_fork_ok
def test_launch_reports_the_likeliest_cause_first(tmp_path, capsys):
    """When a killed worker and a peer that exited because of it are both dead, the kill is
    reported first and decides the exit status (128 + SIGKILL), not the peer's error."""
    marker = tmp_path / "killed"
    script = (
        "import os, signal, sys, time\n"
        f"marker = {str(marker)!r}\n"
        "if os.environ['SHARDAX_PROCESS_ID'] == '1':\n"
        "    open(marker, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "while not os.path.exists(marker):\n"
        "    time.sleep(0.01)\n"
        # the peer is dead by now (it killed itself right after writing the marker); exiting
        # within one of the launcher's polls of it, both failures are usually seen together
        "time.sleep(0.01)\n"
        "sys.exit(1)\n")
    log = io.StringIO()
    status = launch([sys.executable, "-c", script], 2, out=log, grace_s=10)
    assert status == 128 + signal.SIGKILL, log.getvalue()
    said = capsys.readouterr().err  # the launcher's own lines
    reports = [line for line in said.splitlines() if "(pid" in line]
    assert "process 1" in reports[0] and "killed by SIGKILL" in reports[0], said


@_fork_ok
def test_launch_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no command"):
        launch([], 2)
    with pytest.raises(ValueError, match="--nproc must be >= 1, got 0"):
        launch(["true"], 0)
    assert launch([str(tmp_path / "missing")], 1, out=io.StringIO()) == 127
