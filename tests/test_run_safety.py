"""Runs you can trust: damaged checkpoints are skipped (resume and generate fall back to the
newest good step), half-written steps never block a save, readers never write, `--steps 1`
works, and SIGTERM / Ctrl-C save the current step, whole (it restores through the checkpoint
API; that a resume is bit-identical is proved once, in test_train.py, and here after damage).

One straight reference run (6 SGD steps, checkpoints at 2, 4, 6) is shared by every test;
runs are tiny (llama-tiny, 8 x 32 tokens). Signals go to real ``python -m shardax.cli train``
subprocesses, as a scheduler or a user would send them.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from _cli import cli_command, cli_env, committed_steps, read_metrics, run_cli, wait_for_line
from _reference import TINY_TRAIN

from shardax.cli import main
from shardax.errors import UsageError
from shardax.train import Checkpointer
from shardax.train.config import TrainConfig
from shardax.train.generate import generate
from shardax.train.loop import train
from shardax.train.optimizers import make_optimizer
from shardax.train.run import report
from shardax.train.rundir import SET_ASIDE_DIR

TINY = {**TINY_TRAIN, "steps": 6, "mesh": "fsdp=-1", "eval_every": 100}  # val_loss: last step
BOUND_S = 300


def _config(out, **overrides) -> TrainConfig:
    return TrainConfig(out=str(out), **{**TINY, **overrides})


def _flags(**overrides) -> list[str]:
    """The flags of `_config` (a setting overridden with None is left out)."""
    return [s for k, v in {**TINY, **overrides}.items() if v is not None
            for s in (f"--{k.replace('_', '-')}", str(v))]


def _series(records: list[dict], key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                            if p.is_file() else "dir", p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def _damage(out: Path, step: int, how: str) -> None:
    """Damages committed checkpoint ``step`` the way a disk, a copy or a person would."""
    state = out / "checkpoints" / str(step) / "state"
    data = state / "ocdbt.process_0" / "d"
    if how == "truncated array files":
        for f in data.iterdir():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "deleted array files":
        shutil.rmtree(data)
    elif how == "garbage metadata":
        (state / "_METADATA").write_text("{ this is not json")
    elif how == "extra without a data position":
        (out / "checkpoints" / str(step) / "extra" / "metadata").write_text('{"other": 1}')
    else:
        raise ValueError(how)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """6 SGD steps straight; checkpoints at 2, 4, 6."""
    out = tmp_path_factory.mktemp("reference") / "run"
    records = train(_config(out))
    assert committed_steps(out) == [2, 4, 6]
    return out, records


def _copy(reference, dest: Path) -> Path:
    shutil.copytree(reference[0], dest)
    return dest


# ----------------------------------------------------------------------------- resume


def test_resume_skips_damaged_checkpoints_and_continues_bit_identically(reference, tmp_path,
                                                                        capsys):
    out = _copy(reference, tmp_path / "run")
    _damage(out, 6, "deleted array files")
    _damage(out, 4, "extra without a data position")
    capsys.readouterr()
    records = train(_config(out, resume=True))
    err = capsys.readouterr().err
    assert re.search(r"checkpoint step 6 is unusable, trying the one before: .*step 6", err), err
    assert "checkpoint step 4 is unusable" in err and "data position" in err, err
    assert "moved checkpoint steps [4, 6] (newer than step 2" in err, err
    assert "Traceback" not in err
    # Steps 3-6 trained again from step 2, exactly as the first time.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "val_loss"):
        assert _series(read_metrics(out), key) == _series(reference[1], key), key
    assert committed_steps(out) == [2, 4, 6]
    assert sorted(p.name for p in (out / SET_ASIDE_DIR).iterdir()) == ["4", "6"]


def test_resume_past_a_half_written_step_and_a_garbled_metrics_line(reference, tmp_path,
                                                                    capsys):
    out = _copy(reference, tmp_path / "run")
    # Killed while saving step 6: its folder exists without the commit marker; and killed
    # while appending to metrics.jsonl: a half line.
    (out / "checkpoints" / "6" / "commit_success.txt").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    capsys.readouterr()
    records = train(_config(out, resume=True))
    err = capsys.readouterr().err
    assert "metrics.jsonl: skipped 1 unreadable line(s) (line 7)" in err, err
    assert "removed half-written checkpoint steps [6]" in err, err
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert _series(read_metrics(out)) == _series(reference[1])
    assert committed_steps(out) == [2, 4, 6]  # step 6 saved again, over the half-written one


def test_resume_step_picks_an_older_checkpoint(reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    train(_config(out, resume=True, resume_step=4))
    assert _series(read_metrics(out)) == _series(reference[1])
    assert sorted(p.name for p in (out / SET_ASIDE_DIR).iterdir()) == ["6"]  # kept, not lost


def test_resume_takes_every_setting_from_the_run_and_flags_override_only_themselves(
        reference, tmp_path):
    # As users meet it: `--out RUN --resume` alone continues with the run's own batch size,
    # sequence length, optimizer and lr (none of them TrainConfig's defaults).
    out = _copy(reference, tmp_path / "run")
    for step in ("4", "6"):
        shutil.rmtree(out / "checkpoints" / step)
    done = run_cli("train", "--out", out, "--resume", timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    for key in ("loss", "grad_norm"):
        assert _series(read_metrics(out), key) == _series(reference[1], key), key
    # A flag given overrides that setting alone (the run's config.json is rewritten with the
    # effective settings); the schedule change is said.
    done = run_cli("train", "--out", out, "--resume", "--steps", 7, "--lr", 0.01,
                   timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "--lr 0.01 (was 0.03)" in said and "changes the learning-rate schedule" in said, said
    assert committed_steps(out)[-1] == 7 and read_metrics(out)[-1]["step"] == 7
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("steps", "lr", "batch_size", "seq_len", "optimizer")} == {
        "steps": 7, "lr": 0.01, "batch_size": 8, "seq_len": 32, "optimizer": "sgd"}


def test_a_single_step_run(tmp_path):
    # `--steps 1` used to fail building adamw's schedule (warm-up 1 + decay over 0 steps).
    tx = make_optimizer("adamw", 3e-3, steps=1, warmup=0)
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))
    out = tmp_path / "run"  # the loop itself (SGD: the reference's compiled programs)
    records = train(_config(out, steps=1, ckpt_every=100))
    assert [r["step"] for r in records] == [1] and "val_loss" in records[0]
    assert committed_steps(out) == [1]


def test_per_device_batch_size_equals_the_matching_global_batch(reference, tmp_path):
    # 1 sequence per data-parallel device on 8 devices: the reference's global batch of 8.
    out = tmp_path / "run"
    done = run_cli("train", *_flags(batch_size=None, steps=2, ckpt_every=100),
                   "--per-device-batch-size", 1, "--out", out, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"batch: --per-device-batch-size 1 x data-parallel 8 \(.*\) = global "
                     r"batch 8", done.stdout), done.stdout
    assert _series(read_metrics(out)) == {
        k: v for k, v in _series(reference[1]).items() if k <= 2}
    saved = json.loads((out / "config.json").read_text())
    assert (saved["batch_size"], saved["per_device_batch_size"]) == (8, None)


def test_unreadable_data_is_one_line(tmp_path, monkeypatch, capsys):
    """Checked after the backend starts (the data is read then), still one line, exit 2."""
    secret = tmp_path / "secret.txt"
    secret.write_text("text\n" * 100)
    secret.chmod(0)
    # root reads any file; /proc/self/mem fails to read (EIO) even for root
    data = "/proc/self/mem" if os.geteuid() == 0 else str(secret)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() rewrites it
    out = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", *_flags(), "--data", data, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"shardax train: error: --data {data}: "), err
    assert not out.exists()


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize("how", ["truncated array files", "deleted array files",
                                 "garbage metadata"])
def test_generate_falls_back_to_the_newest_good_checkpoint(how, reference, tmp_path, capsys):
    out = _copy(reference, tmp_path / "run")
    _damage(out, 6, how)
    capsys.readouterr()
    text = generate(str(out), prompt="def ", max_tokens=2, temperature=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "shardax generate: checkpoint step 6 is unusable, trying the one before: "), err
    assert text.startswith("def ")
    # Greedy sampling from step 4 gives what step 4 gives when asked for by name.
    assert text == generate(str(out), prompt="def ", max_tokens=2, temperature=0, step=4)


def test_generate_with_no_good_checkpoint_is_a_usage_error(reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    for step in (2, 4, 6):
        _damage(out, step, "garbage metadata")
    with pytest.raises(UsageError, match="no usable checkpoint"):
        generate(str(out), prompt="x", max_tokens=1)


def test_generate_reads_a_moved_run_from_anywhere_without_writing(reference, tmp_path):
    """A run trained with a relative --out elsewhere, moved, sampled from another working
    directory with another device count, while a save of the trainer is 'in flight'."""
    out = _copy(reference, tmp_path / "moved" / "run")
    _damage(out, 6, "deleted array files")
    in_flight = out / "checkpoints" / "8.orbax-checkpoint-tmp-1700000000"
    (in_flight / "state").mkdir(parents=True)
    (in_flight / "state" / "partial").write_bytes(b"\0" * 64)
    before = _snapshot(out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli("generate", "--out", os.path.relpath(out, elsewhere), "--prompt", "def ",
                   "--max-tokens", "3", "--devices", "3", timeout=BOUND_S, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def ")
    notes = [line for line in proc.stderr.splitlines() if line.startswith("shardax")]
    assert len(notes) == 1 and "checkpoint step 6 is unusable" in notes[0], proc.stderr
    # No traceback at all: not shardax's, nor orbax's after-effects of the failed read of
    # step 6 (TensorStore's callbacks into orbax's closed event loop, its abandoned read
    # coroutines at exit), which shardax drops (shardax.train.run.orbax_logs.drop_orbax_errors).
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, (
        proc.stderr[-3000:])
    assert _snapshot(out) == before  # nothing written, the in-flight save left alone
    assert not any(elsewhere.iterdir())


# ----------------------------------------------------------------------------- signals


def _start(out: Path, cwd: Path, **overrides) -> subprocess.Popen:
    """``shardax train`` with 40 steps (it is stopped long before), stdout and stderr piped."""
    return subprocess.Popen(
        cli_command("train", *_flags(steps=40, ckpt_every=100, **overrides), "--out", out),
        env=cli_env(PYTHONUNBUFFERED="1"), cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _wait_for(stream, pattern: str, proc: subprocess.Popen) -> str:
    return wait_for_line(stream, pattern, proc, BOUND_S)


def _signal_at_step(out, tmp_path, step: int, signum: int):
    """Starts a run, sends ``signum`` once it logged ``step``; ``(process, stderr)`` at exit."""
    proc = _start(out, tmp_path)
    try:
        _wait_for(proc.stdout, rf"^step\s+{step}\s", proc)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, stderr


def test_sigterm_saves_the_current_step_whole(tmp_path):
    out = tmp_path / "run"
    proc, stderr = _signal_at_step(out, tmp_path, 2, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stopped = re.findall(r"shardax train: stopped at step (\d+), saved; continue with --resume",
                         stderr)
    assert len(stopped) == 1 and "Traceback" not in stderr, stderr
    step = int(stopped[0])
    logged = max(r["step"] for r in read_metrics(out))
    assert committed_steps(out) == [step] and step >= logged >= 2
    assert step < TINY["steps"], "stopped too late: the signal did not cut the run short"
    assert not (out / "run.lock").exists()  # the run directory's lock is released
    # What --resume starts from (the checkpoint API; resuming a run is proved bit-identical
    # once, in test_train.py): the step reads back whole, every array against its save-time
    # fingerprint, with the data position of that step.
    with Checkpointer(out / "checkpoints", read_only=True) as ckpt:
        restored = ckpt.restore()
    assert restored.step == step and restored.extra["data"]["step"] == step


def test_a_first_ctrl_c_saves_the_current_step(tmp_path):
    out = tmp_path / "run"
    proc, stderr = _signal_at_step(out, tmp_path, 1, signal.SIGINT)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    stopped = re.findall(r"stopped at step (\d+), saved; continue with --resume", stderr)
    assert len(stopped) == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    step = int(stopped[0])
    assert committed_steps(out) == [step] and step >= max(r["step"] for r in read_metrics(out))


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, tmp_path)
    try:
        _wait_for(proc.stdout, r"^step\s+1\s", proc)
        proc.send_signal(signal.SIGINT)
        _wait_for(proc.stderr, "received SIGINT; finishing this step", proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT
    assert "interrupted again; aborting without saving" in stderr, stderr
    assert "stopped at step" not in stderr and "Traceback" not in stderr, stderr


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    assert report.plot(tmp_path, [{"step": 1, "loss": 2.0}]) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed, so no loss.png" in err
    assert not (tmp_path / "loss.png").exists()
