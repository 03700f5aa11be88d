"""`shardax train`: determinism and resume, resharding resume, sharded == single-device training,
gradient accumulation, mixed precision, run outputs, bad input, `generate`, and `train_step`.

Runs are tiny (llama-tiny, 8 x 32 tokens, a few steps). Comparisons across meshes use plain SGD
(Adam would hide a gradient off by a constant factor) and compare both the loss and the gradient
norm that the loop logs. The 1-device reference is a real `python -m shardax.cli train
--devices 1` subprocess, started early so that it runs while the in-process runs compile.
"""

import hashlib
import json
import math
import os
import shutil
import subprocess
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cli import cli_command, cli_env, committed_steps, run_cli
from _reference import TINY_TRAIN, assert_trained_alike, init_train_state
from flax import nnx

from shardax import layout, models
from shardax.cli import main
from shardax.errors import UsageError
from shardax.mesh import MeshShardingHelper
from shardax.precision import Policy
from shardax.rules import LogicalAxisRules
from shardax.train.config import check
from shardax.train.generate import generate
from shardax.train.loop import TrainConfig, prepare, train
from shardax.train.optimizers import make_optimizer
from shardax.train.step import train_step

MESH_3D = "dp=2,fsdp=2,tp=2"
TINY = {**TINY_TRAIN, "eval_every": 100}  # val_loss at the last step
REL = 1e-6  # across meshes / devices / microbatching: float32 reduction order (seen: 1.0e-7)


def _config(out, **overrides) -> TrainConfig:
    return TrainConfig(out=str(out), **{**TINY, **overrides})


def _flags(**overrides) -> list[str]:
    return [s for k, v in {**TINY, **overrides}.items()
            for s in (f"--{k.replace('_', '-')}", str(v))]


def _read_metrics(out) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _by_step(records, key="loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def _resume_copy(run_dir: Path, dest: Path, keep_step: int) -> Path:
    """A copy of a finished run as if it had stopped right after checkpoint ``keep_step``:
    later checkpoints removed (``steps`` is fixed on resume, so the saved state at
    ``keep_step`` is exactly what an interrupted run would have saved)."""
    shutil.copytree(run_dir, dest)
    for step_dir in (dest / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > keep_step:
            shutil.rmtree(step_dir)
    assert committed_steps(dest)[-1] == keep_step
    return dest


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- runs


class _Subprocess:
    def __init__(self, proc: subprocess.Popen, out: Path, log: Path):
        self.proc, self.out, self.log = proc, out, log

    def records(self) -> list[dict]:
        rc = self.proc.wait(timeout=600)
        assert rc == 0, f"1-device run failed (rc {rc}):\n{self.log.read_text()[-3000:]}"
        return _read_metrics(self.out)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """`python -m shardax.cli train --devices 1 --mesh fsdp=1`, 3 SGD steps (started now,
    awaited by `records()`)."""
    out = tmp_path_factory.mktemp("one_device")
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cli_command("train", "--devices", "1", "--mesh", "fsdp=1",
                        *_flags(steps=3, ckpt_every=100), "--out", out),
            env=cli_env(), stdout=f, stderr=subprocess.STDOUT)
    handle = _Subprocess(proc, out, log)
    yield handle
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def fsdp_run(single_device, tmp_path_factory):
    """4 SGD steps on ``--mesh fsdp=-1`` (8 devices), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    records = train(_config(out, mesh="fsdp=-1"))
    return out, records


@pytest.fixture(scope="module")
def mesh3d_run(single_device, tmp_path_factory):
    """3 SGD steps on ``--mesh dp=2,fsdp=2,tp=2 --rules fsdp_tp``."""
    out = tmp_path_factory.mktemp("mesh3d") / "run"
    return out, train(_config(out, mesh=MESH_3D, rules="fsdp_tp", steps=3))


@pytest.fixture(scope="module")
def dp_run(single_device, tmp_path_factory):
    """3 SGD steps of pure data parallelism: ``--mesh dp=8 --rules dp`` (params replicated)."""
    out = tmp_path_factory.mktemp("dp") / "run"
    return out, train(_config(out, mesh="dp=8", rules="dp", steps=3))


@pytest.fixture(scope="module")
def resumed_same_mesh(fsdp_run, tmp_path_factory):
    """`fsdp_run` stopped after step 2 and resumed on the same mesh to step 4."""
    out = _resume_copy(fsdp_run[0], tmp_path_factory.mktemp("resume_same") / "run", 2)
    return out, train(_config(out, mesh="fsdp=-1", resume=True))


# ----------------------------------------------------------------------------- determinism


def test_resume_is_bit_identical_to_a_straight_run(fsdp_run, resumed_same_mesh):
    (_, straight), (out, resumed) = fsdp_run, resumed_same_mesh
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    # metrics.jsonl of the resumed run: steps 1-2 kept from before, 3-4 newly trained.
    assert [r["step"] for r in _read_metrics(out)] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "val_loss"):
        assert _by_step(_read_metrics(out), key) == _by_step(straight, key), key
    assert _by_step(resumed) == _by_step(straight)
    assert committed_steps(out) == [2, 4]


def test_resume_onto_another_mesh_continues_training(fsdp_run, resumed_same_mesh,
                                                     tmp_path):
    out = _resume_copy(fsdp_run[0], tmp_path / "run", 2)
    records = train(_config(out, mesh=MESH_3D, resume=True))  # saved on fsdp=8
    other, same = _by_step(records), _by_step(resumed_same_mesh[1])
    assert sorted(other) == [1, 2, 3, 4]
    for step in (3, 4):
        assert math.isfinite(other[step])
        np.testing.assert_allclose(other[step], same[step], rtol=REL)
    np.testing.assert_allclose(_by_step(records, "grad_norm")[3],
                               _by_step(resumed_same_mesh[1], "grad_norm")[3], rtol=REL)
    # Training went on: step 4's loss is not a copy of step 3's.
    assert other[4] != other[3]


def test_a_scanned_run_resumes_onto_a_circular_pipeline(fsdp_run, resumed_same_mesh,
                                                       tmp_path):
    """Scanned layers are stored as a pipeline stores them (one stack, in layer order), so a
    run saved on fsdp=8 continues on pp=2 (circular, 2 virtual stages: each stage's layers
    are not a contiguous slice) with the losses of the run that stayed on fsdp=8."""
    out = _resume_copy(fsdp_run[0], tmp_path / "run", 2)
    records = train(_config(out, mesh="pp=2,fsdp=4", pp_schedule="circular",
                            virtual_stages=2, resume=True))
    piped, same = _by_step(records), _by_step(resumed_same_mesh[1])
    assert sorted(piped) == [1, 2, 3, 4]
    for step in (3, 4):
        np.testing.assert_allclose(piped[step], same[step], rtol=REL)


def test_first_loss_is_mesh_invariant(fsdp_run, mesh3d_run, single_device):
    one = _by_step(single_device.records())[1]
    assert math.isfinite(one) and 4.0 < one < 7.0  # ~ln(256) = 5.55 for an untrained model
    np.testing.assert_allclose(_by_step(fsdp_run[1])[1], one, rtol=REL)
    np.testing.assert_allclose(_by_step(mesh3d_run[1])[1], one, rtol=REL)


@pytest.mark.parametrize("run", ["fsdp_run", "mesh3d_run", "dp_run"])
def test_sharded_training_equals_single_device_training(run, request, single_device):
    records = request.getfixturevalue(run)[1]
    reference = single_device.records()
    for key in ("loss", "grad_norm"):
        want = [_by_step(reference, key)[s] for s in (1, 2, 3)]
        got = [_by_step(records, key)[s] for s in (1, 2, 3)]
        np.testing.assert_allclose(got, want, rtol=REL, err_msg=f"{run}: {key}")
    # The comparison can fail: SGD moved the loss well beyond the tolerance.
    losses = [_by_step(reference)[s] for s in (1, 2, 3)]
    assert abs(losses[2] - losses[0]) > 1e3 * REL * losses[0]


# ----------------------------------------------------------------------------- outputs


def test_run_directory_outputs(fsdp_run):
    out, records = fsdp_run
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4  # log_every=1: one JSON object per step
    written = [json.loads(line) for line in lines]
    assert [r["step"] for r in written] == [1, 2, 3, 4]
    for row, record in zip(written, records):
        assert isinstance(row["loss"], float) and math.isfinite(row["loss"])
        assert row["loss"] == record["loss"]  # full precision: the float round-trips
        assert np.float32(row["loss"]) == row["loss"]  # a float32 loss, not a rounded one
    assert "val_loss" in written[-1] and math.isfinite(written[-1]["val_loss"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the checked config: defaults such as --tokenizer filled in
    assert json.loads((out / "config.json").read_text()) == \
        check(_config(out, mesh="fsdp=-1")).to_json()
    assert (out / "checkpoints").is_dir()
    assert committed_steps(out) == [2, 4]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def run_main(monkeypatch, tmp_path, capsys):
    """In-process ``main(argv)`` -> (exit code, stdout, stderr); main() rewrites XLA_FLAGS
    (harmless here: the backend is already up), so the variable is restored afterwards."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.chdir(tmp_path)  # a wrong default --out would land here, not in the repo

    def run(*argv):
        capsys.readouterr()
        code = main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def _assert_one_line_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardax train: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("flags, needles", [
    (["--mesh", "fsdp=3"], ["fsdp=3", "8"]),
    (["--mesh", "dp=3,fsdp=-1"], ["dp=3", "8"]),
    (["--mesh", "data=8"], ["data"]),  # no rule maps it: would silently replicate everything
    (["--data", "/nonexistent/corpus.txt"], ["--data", "/nonexistent/corpus.txt"]),
    (["--model", "llama-huge"], ["llama-huge", "llama-tiny"]),
    (["--rules", "zero3"], ["zero3", "fsdp_tp"]),
    (["--resume"], ["--resume", "checkpoint"]),
    (["--grad-accum", "3"], ["--batch-size 8", "--grad-accum 3"]),
])
def test_bad_input_is_one_line_and_exit_code_2(flags, needles, run_main, tmp_path):
    out = tmp_path / "run"
    code, _, err = run_main("train", *flags, *_flags(), "--out", str(out))
    _assert_one_line_error(code, err, *needles)
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_fresh_run_never_overwrites_existing_checkpoints(fsdp_run, run_main, tmp_path):
    out = tmp_path / "existing"
    shutil.copytree(fsdp_run[0], out)
    before = _snapshot(out)
    code, _, err = run_main("train", *_flags(), "--out", str(out))
    _assert_one_line_error(code, err, str(out), "--resume")
    assert _snapshot(out) == before


def test_bad_input_from_the_command_line(tmp_path):
    proc = run_cli("train", "--mesh", "fsdp=3", "--out", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    _assert_one_line_error(proc.returncode, proc.stderr, "fsdp=3")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- generate


def test_generate_continues_the_prompt(fsdp_run):
    text = generate(str(fsdp_run[0]), prompt="def ", max_tokens=8)
    assert text.startswith("def ")
    new = text[len("def "):]
    # 8 sampled bytes; invalid UTF-8 runs decode to one U+FFFD each, so <= 8 characters.
    assert 1 <= len(new) <= 8
    if "\ufffd" not in new:
        assert len(new.encode("utf-8")) == 8


def test_generate_without_a_run_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not a shardax run"):
        generate(str(tmp_path), prompt="x", max_tokens=1)


# ----------------------------------------------------------------------------- the step


def _small_config(**overrides):
    return models.get_config("llama-tiny", n_layers=1, dim=32, mlp_dim=64, max_seq_len=16,
                             **overrides)


def _batch(rows=4, length=16, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


@pytest.fixture(scope="module")
def sgd_reference():
    """A small llama, a batch of 8 rows, and a hand-written single-device loss + SGD step."""
    cfg, lr = _small_config(), 0.1
    tx = optax.sgd(lr)
    graphdef, state = init_train_state(cfg, tx)
    batch = _batch(rows=8)

    @jax.jit
    def reference(params, rest, inputs, targets):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(inputs).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads), grad_norm

    want = (*reference(state.params, state.rest, *batch), state.params)
    assert want[2] > 0.1  # the update is visible at the tolerances below
    return tx, graphdef, state, batch, want


def _check_step(new, metrics, want):
    want_loss, want_params, want_norm, start = want
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], want_norm, rtol=1e-6)
    assert_trained_alike(new.params, want_params, start, steps=1, optimizer="sgd")
    assert int(new.step) == 1


@pytest.mark.parametrize("accum", [1, 2])
def test_train_step_equals_a_hand_written_sgd_step(accum, sgd_reference):
    tx, graphdef, state, batch, want = sgd_reference
    step = jax.jit(partial(train_step, graphdef=graphdef, tx=tx, grad_accum=accum))
    _check_step(*step(state, batch), want)


def test_sharded_grad_accumulation_equals_one_big_batch_on_one_device(sgd_reference):
    # As the loop compiles it: dp=2,fsdp=2,tp=2, rules fsdp_tp, accumulation in the parameter
    # sharding; 8 rows on 4 data shards = 2 microbatches of one row per shard.
    tx, graphdef, state, batch, want = sgd_reference
    mesh = MeshShardingHelper.from_string(MESH_3D)
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    step = mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=tx, grad_accum=2, param_rules=rules),
        in_shardings=(rules, rules.spec_for(("batch", "length"), mesh.mesh)),
        out_shardings=(rules, None))
    new, metrics = step(state, batch)
    embed = new.params["embed"][...]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")  # really sharded
    _check_step(new, metrics, want)


def test_mixed_precision_keeps_params_and_optimizer_state_in_float32(sgd_reference, tmp_path):
    spec = "params=float32,compute=bfloat16,output=float32"
    policy = Policy.from_string(spec)
    assert (policy.params, policy.compute, policy.output) == (
        jnp.float32, jnp.bfloat16, jnp.float32)
    run = prepare(_config(tmp_path / "run", precision=spec, optimizer="adamw")).run
    assert run.model_config.dtype == jnp.bfloat16
    assert run.model_config.param_dtype == jnp.float32

    tx = make_optimizer("adamw", 1e-2, steps=10, warmup=1)
    _, _, base, batch, (full_loss, *_) = sgd_reference  # the float32-compute loss
    state = base._replace(opt_state=jax.jit(tx.init)(base.params))
    graphdef, _ = init_train_state(_small_config(dtype=jnp.bfloat16, param_dtype=jnp.float32), tx,
                        abstract=True)
    step = jax.jit(partial(train_step, graphdef=graphdef, tx=tx, policy=policy))
    new, metrics = step(state, batch)
    new, _ = step(new, batch)  # two steps: the moments have a history
    loss = float(metrics["loss"])
    assert metrics["loss"].dtype == jnp.float32 and math.isfinite(loss)
    floats = [x for x in jax.tree.leaves(new) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    for key in ("params", "opt_state"):  # the step keeps every dtype
        before, after = (jax.tree.leaves(getattr(s, key)) for s in (state, new))
        assert [x.dtype for x in after] == [x.dtype for x in before]
    moved = [not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params))]
    assert all(moved)

    # Same parameters and batch as the float32 reference: bfloat16 compute really happened
    # (another rounding) and stays close to the float32 loss.
    assert loss != float(full_loss)
    np.testing.assert_allclose(loss, full_loss, rtol=2e-2)
