"""`shardax train --objective dpo|simpo|orpo`: sharded DPO equals a hand-written one-device DPO,
resume is bit-identical (the reference log-probabilities read back), LoRA DPO holds no second
copy of the weights, SimPO and ORPO train, bad input is one line.

One module-scoped DPO run (llama-tiny, bytes tokenizer, 8 pairs x 32 tokens, plain SGD, mesh
fsdp=4,tp=2) is the reference of most tests; the one-device reference is written here from
the model's own logits and `shardax.train.post.objectives.dpo_loss`, outside the train step.
"""

import json
import math
import shutil
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cli import assert_one_line_error, committed_steps, run_cli
from _reference import assert_trained_alike, init_train_state
from flax import nnx

from shardax.cli import main
from shardax.data.preference_data import encode_preferences, read_preferences
from shardax.data.tokenizer import load_tokenizer
from shardax.errors import UsageError
from shardax.train import build
from shardax.train.config import ExportConfig, check, check_export
from shardax.train.export import export_run
from shardax.train.loop import TrainConfig, train
from shardax.train.post import preference_step
from shardax.train.post.objectives import dpo_loss, sequence_logps
from shardax.train.post.preference_batches import REFERENCE_FILE, PreferenceBatches
from shardax.train.resolve import resolve
from shardax.train.run.checkpoint import Checkpointer, flat

PAIRS, SEQ, STEPS, LR = 8, 32, 5, 0.03
RTOL = 1e-5
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def _records(n: int = 16) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}?"}
            for i in range(n)]


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return path


def _config(out: Path, prefs: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**dict(
        out=str(out), objective="dpo", data=[str(prefs)], mesh="fsdp=4,tp=2", steps=STEPS,
        batch_size=PAIRS, seq_len=SEQ, lr=LR, optimizer="sgd", log_every=1, ckpt_every=3,
        scan_layers=True),
        **overrides})


@pytest.fixture(scope="module")
def dpo_run(prefs, tmp_path_factory):
    """5 SGD steps of DPO on fsdp=4,tp=2, checkpoints at steps 3 and 5."""
    out = tmp_path_factory.mktemp("dpo") / "run"
    return out, train(_config(out, prefs))


def _params(out: Path, step: int) -> dict:
    with Checkpointer(Path(out) / "checkpoints", read_only=True) as reader:
        state = reader.restore(step).state
    return {k: np.asarray(v) for k, v in state.items() if k.startswith("params.")}


@pytest.fixture(scope="module")
def initial(prefs):
    """``(graphdef, state, rows)``: the runs' initial SGD train state on one device (plain SGD
    holds no optimizer state: any lr may use it) and the data's encoded rows."""
    config = check(_config(Path("unused"), prefs))
    rows = encode_preferences(read_preferences(prefs), load_tokenizer("bytes"), SEQ)
    with jax.default_device(jax.devices()[0]):
        graphdef, state = init_train_state(resolve(config).model_config, optax.sgd(LR),
                                           seed=config.seed)
    return graphdef, state, rows


@pytest.fixture(scope="module")
def one_device(initial):
    """The reference: DPO written out on one device from the model's logits, plain SGD over the
    batches of the run's data order; ``(losses, metrics per step, start, params, ref logps)``."""
    graphdef, state, rows = initial
    data = PreferenceBatches(rows, PAIRS, seed=0)
    with jax.default_device(jax.devices()[0]):
        params, rest = state.params, state.rest

        def logps_of(params, inputs, labels, mask):
            logits = nnx.merge(graphdef, params, rest)(inputs)
            return sequence_logps(logits, labels, mask)[0]

        reference = np.asarray(jax.jit(logps_of)(params, rows.inputs, rows.labels,
                                                 rows.completion_mask))
        data.reference = reference

        @jax.jit
        def step(params, inputs, labels, mask, ref):
            def loss_fn(p):
                logps = logps_of(p, inputs, labels, mask)
                losses, metrics = dpo_loss(logps[:PAIRS], logps[PAIRS:], ref[:PAIRS],
                                           ref[PAIRS:], beta=0.1)
                return losses.mean(), metrics

            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss, metrics

        start = flat({"params": jax.device_get(params)})
        losses, metrics = [], []
        for k in range(STEPS):
            params, loss, m = step(params, *data.batch(k))
            losses.append(float(loss))
            metrics.append({key: float(v) for key, v in m.items()})
    return losses, metrics, start, flat({"params": jax.device_get(params)}), reference


def test_sharded_dpo_equals_one_device(dpo_run, one_device):
    out, records = dpo_run
    losses, _, start, want, reference = one_device
    saved = json.loads((out / REFERENCE_FILE).read_text())
    np.testing.assert_allclose(saved["logps"], reference, rtol=RTOL)
    np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=RTOL)
    assert losses[-1] < losses[0] - 0.1  # it trained: the comparison could fail
    got = _params(out, STEPS)
    assert sorted(got) == sorted(want)
    assert_trained_alike(got, want, start, steps=STEPS, optimizer="sgd")


def test_step_metrics_are_dpo_loss_of_the_models_logps(dpo_run, one_device):
    first = dpo_run[1][0]
    want = one_device[1][0]
    assert first["step"] == 1
    np.testing.assert_allclose(first["loss"], np.log(2), rtol=RTOL)  # policy == reference
    for key in TRL_METRICS:
        np.testing.assert_allclose(first[key], want[key], rtol=RTOL, atol=1e-6, err_msg=key)
    later = dpo_run[1][-1]  # rewards move once the policy does
    for key in TRL_METRICS:
        np.testing.assert_allclose(later[key], one_device[1][-1][key], rtol=1e-4, atol=1e-5,
                                   err_msg=key)
    assert later["rewards/margins"] > 0.1 and later["rewards/accuracies"] == 1.0


def test_resumed_dpo_is_bit_identical(dpo_run, prefs, tmp_path):
    straight_out, straight = dpo_run
    out = tmp_path / "run"
    shutil.copytree(straight_out, out)
    for step_dir in (out / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > 3:
            shutil.rmtree(step_dir)
    assert committed_steps(out)[-1] == 3
    reference = out / REFERENCE_FILE
    before = reference.stat().st_mtime_ns
    resumed = train(_config(out, prefs, resume=True))
    assert reference.stat().st_mtime_ns == before  # read back, not computed again
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    skip = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}
    for a, b in zip(resumed, straight, strict=True):
        assert {k: v for k, v in a.items() if k not in skip} == \
            {k: v for k, v in b.items() if k not in skip}
    got, want = _params(out, STEPS), _params(straight_out, STEPS)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # A reference file that is not this data's: refused, one line naming it.
    saved = json.loads(reference.read_text())
    reference.write_text(json.dumps({**saved, "data_sha256": "0" * 64}))
    shutil.rmtree(out / "checkpoints" / str(STEPS))
    with pytest.raises(UsageError, match=REFERENCE_FILE) as e:
        train(_config(out, prefs, resume=True))
    assert "\n" not in str(e.value)


def test_lora_dpo_holds_no_second_copy_of_the_weights(prefs):
    """The compiled LoRA DPO step takes the LoRA SFT step's train state (frozen base once,
    adapters, their optimizer state: ``run.state_rules``, the SFT step's ``in_shardings``) and
    its batch, nothing else: no reference model beside it."""
    config = check(_config(Path("unused"), prefs, lora_rank=4, mesh="fsdp=8", steps=2))
    run = resolve(config)
    graphdef, shapes = build.abstract(run.model_config, run.tx, config.seed, run.mesh)
    shardings = run.shardings(shapes)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         shapes, shardings)
    sft_state = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                    for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings),
                                    strict=True))
    rows = 2 * PAIRS
    batch = (jax.ShapeDtypeStruct((rows, SEQ), jnp.int32),) * 2 + (
        jax.ShapeDtypeStruct((rows, SEQ), jnp.bool_), jax.ShapeDtypeStruct((rows,), jnp.float32))
    plan = preference_step.step_function(run, graphdef).plan(state, batch)
    state_rows = [r for r in plan.rows if r.kind == "input" and r.path.startswith("state/")]
    assert sum(r.bytes_per_device for r in state_rows) == sft_state
    assert any("lora" in r.path for r in state_rows)  # the adapters train ...
    frozen = sum(x.size for x in jax.tree.leaves(shapes.rest))
    assert frozen > 10 * sum(x.size for x in jax.tree.leaves(shapes.params))  # ... the base not
    batch_bytes = rows * SEQ * (4 + 4 + 1) // 8 + rows * 4 // 8  # split over fsdp=8
    assert plan.argument_bytes_per_device == sft_state + batch_bytes


@pytest.mark.parametrize("objective, extra", [
    ("simpo", ()), ("orpo", ("log_odds_ratio", "log_odds_chosen", "nll_loss"))])
def test_simpo_and_orpo_train(objective, extra, prefs, initial):
    """Two steps of the preference step itself on one device (the loop around it is the
    DPO run's): finite, falling loss and the objective's metrics."""
    config = check(_config(Path("unused"), prefs, objective=objective, lr=0.1))
    graphdef, state, rows = initial
    data, tx = PreferenceBatches(rows, PAIRS, seed=config.seed), optax.sgd(config.lr)
    with jax.default_device(jax.devices()[0]):
        step = jax.jit(partial(preference_step.preference_step, graphdef=graphdef, tx=tx,
                               config=config))
        losses = []
        for k in range(2):
            state, metrics = step(state, data.batch(k))
            losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0]
    for key in ("grad_norm", *TRL_METRICS, *extra):
        assert np.isfinite(float(metrics[key])), key
    assert bool(metrics["finite"])


def test_bad_preference_input_is_one_line(prefs, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_records(1)[0]) + "\n"
                   + json.dumps({"prompt": "1+1=", "chosen": " 2."}) + "\n")
    out = tmp_path / "run"
    proc = run_cli("train", "--objective", "dpo", "--data", bad, "--out", out, "--steps", 1)
    assert_one_line_error(proc, "train", f"{bad}:2", "'rejected'")
    assert not out.exists()
    code = main(["train", "--objective", "orpo", "--dpo-loss", "ipo", "--data", str(prefs),
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--dpo-loss ipo" in err[0] and "--objective orpo" in err[0]
    assert not out.exists()


def test_a_dpo_run_exports_as_any_fine_tune(dpo_run, tmp_path):
    from safetensors.numpy import load_file

    out = dpo_run[0]
    files = export_run(check_export(ExportConfig(out=str(out), to=str(tmp_path / "hf"))))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    embed = _params(out, STEPS)["params.embed.value"]
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], embed)


@pytest.mark.parametrize("flags, needle", [
    (dict(objective="orpo", dpo_loss="ipo"), "--dpo-loss ipo: --objective orpo"),
    (dict(objective="sft", beta=0.5), "--beta 0.5: --objective sft"),
    (dict(objective="dpo", simpo_gamma=1.0), "--simpo-gamma 1.0: --objective dpo"),
    (dict(objective="dpo", dpo_loss="ipo", label_smoothing=0.1), "--label-smoothing"),
    (dict(objective="dpo", label_smoothing=0.5), "--label-smoothing 0.5: must be in [0, 0.5)"),
    (dict(objective="dpo", beta=0.0), "--beta 0.0: must be"),
    (dict(objective="dpo", pack="concat"), "--pack concat: --objective dpo"),
    (dict(objective="simpo", grad_accum=2), "--grad-accum 2: --objective simpo"),
    (dict(objective="dpo", fsdp_mode="explicit"), "--fsdp-mode explicit does not run with "
                                                  "--objective dpo"),
    (dict(objective="orpo", mesh="pp=2,fsdp=-1"), "'pp' axis"),
    (dict(objective="dpo", data=[]), "--objective dpo trains on preference pairs"),
    (dict(objective="dpo", data=["a.jsonl:0.5", "b.jsonl:0.5"]), "weighted mixtures"),
])
def test_settings_a_preference_objective_does_not_use_are_refused(flags, needle, prefs):
    with pytest.raises(UsageError) as e:
        check(TrainConfig(**{"data": [str(prefs)], **flags}))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_each_objective_gets_the_log_probabilities_trl_gives_it():
    """Sums for DPO, per-token averages for IPO (the reference's too), SimPO and ORPO, and
    ORPO's NLL the token mean over the chosen completions (TRL's batch cross-entropy)."""
    rng = np.random.default_rng(0)
    logps, ref = (jnp.asarray(-rng.uniform(5, 20, 6), jnp.float32) for _ in range(2))
    counts = jnp.asarray([3.0, 4.0, 5.0, 2.0, 6.0, 7.0])
    avg, ref_avg = logps / counts, ref / counts
    c, r = slice(0, 3), slice(3, 6)
    config = check(TrainConfig(objective="dpo", data=["x"], dpo_loss="ipo", beta=0.2))
    want = ((avg[c] - ref_avg[c]) - (avg[r] - ref_avg[r]) - 1 / 0.4) ** 2
    got, metrics = preference_step.PREFERENCE_LOSSES["dpo"](logps, counts, ref, config)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # TRL logs IPO's rewards and logps from the summed log-probabilities (test_objectives'
    # TRL fixtures): only the loss takes the averages
    np.testing.assert_allclose(metrics["rewards/chosen"], 0.2 * (logps[c] - ref[c]).mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(metrics["logps/rejected"], logps[r].mean(), rtol=1e-6)
    config = check(TrainConfig(objective="simpo", data=["x"], beta=2.0, simpo_gamma=0.3))
    want = -jax.nn.log_sigmoid(2.0 * (avg[c] - avg[r]) - 0.3)
    got = preference_step.PREFERENCE_LOSSES["simpo"](logps, counts, ref, config)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    config = check(TrainConfig(objective="orpo", data=["x"], beta=0.5))
    _, metrics = preference_step.PREFERENCE_LOSSES["orpo"](logps, counts, ref, config)
    np.testing.assert_allclose(metrics["nll_loss"], -logps[c].sum() / counts[c].sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["logps/chosen"], avg[c].mean(), rtol=1e-6)
