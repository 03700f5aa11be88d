"""``--optimizer adamw|sgd|lion|adafactor|muon`` and the schedule flags: every optimizer's
state is sharded by the rules like its parameters and a sharded step trains like one device;
step 1 trains at lr > 0; the flags reach the optimizer and bad values are one line."""

import dataclasses
import json
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import assert_trained_alike, init_train_state, train_one_device

from shardax import frameworks, layout, models
from shardax.errors import UsageError
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.config import TrainConfig, check
from shardax.train.optimizers import OPTIMIZERS, make_optimizer, make_schedule, muon_dimensions
from shardax.train.resolve import optimizer, schedule_change
from shardax.train.rundir import check_resume, load_run_config
from shardax.train.step import train_step
from shardax.utils import tree_path_to_string

CONFIG = models.get_config("llama-tiny", n_layers=1, max_seq_len=16)
# sgd and lion compared for 3 steps, the others for 2 (a sharded run of each for a step or two)
STEPS = {"sgd": 3, "lion": 3, "adamw": 2, "adafactor": 2, "muon": 2}


def _batches(n):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 256, (8, 17), dtype=np.int32) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _tx(name):
    return make_optimizer(name, 0.02 if name == "sgd" else 1e-3, steps=10, warmup=1)


@pytest.fixture(scope="module")
def one_device():
    """Per optimizer name: its one-device run, made on first use and shared by the meshes it
    is compared on."""
    return cache(lambda name: train_one_device(CONFIG, _tx(name), _batches(STEPS[name])))


@pytest.mark.parametrize("name, mesh_spec, fsdp_mode", [
    *((name, "fsdp=4,tp=2", "xla") for name in OPTIMIZERS),
    # the boxed optimizers under explicit ZeRO-3 (what `shardax train` runs on a dense llama)
    ("adafactor", "fsdp=8", "explicit"), ("muon", "fsdp=8", "explicit")])
def test_sharded_optimizer_state_follows_the_params_and_trains_like_one_device(
        name, mesh_spec, fsdp_mode, one_device):
    tx = _tx(name)
    batches = _batches(STEPS[name])
    want = one_device(name)

    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp_tp"], mesh.shape, heads=CONFIG.n_heads, kv_heads=CONFIG.n_kv_heads,
        sequence_parallel=False))
    graphdef, state = init_train_state(CONFIG, tx)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=tx, param_rules=rules,
                             layout=layout.Layout(fsdp_mode=fsdp_mode)),
                     in_shardings=(rules, rules.spec_for(("batch", "length"), mesh.mesh)),
                     out_shardings=(rules, None))
    for batch in batches:
        state, _ = step(state, tuple(jnp.asarray(x) for x in batch))

    # Every state leaf of a parameter's shape is sharded as that parameter is.
    specs = {tree_path_to_string(p, sep="/").removesuffix("/value"): x.sharding.spec
             for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    shapes = {k: x.shape for k, x in zip(specs, jax.tree.leaves(state.params))}
    followed = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        key = tree_path_to_string(path, sep="/").removesuffix("/value")
        owner = next((k for k in specs if key.endswith("/" + k)), None)
        if owner is not None and x.shape == shapes[owner]:
            assert x.sharding.spec == specs[owner], (key, x.sharding.spec, specs[owner])
            followed += 1 if any(specs[owner]) else 0
    assert followed >= (0 if name == "sgd" else len(specs) // 2), followed
    assert_trained_alike(state.params, want.state.params, want.start, steps=len(batches),
                         optimizer="sgd" if name == "sgd" else "adam", err_msg=f"{name}: ")


def test_muon_takes_the_hidden_matrices_and_leaves_embeddings_to_adamw():
    from flax import nnx

    model = nnx.eval_shape(lambda: models.create(
        models.get_config("llama-tiny", n_layers=2), nnx.Rngs(0)))
    dims = muon_dimensions(nnx.state(model, nnx.Param))
    got = {tree_path_to_string(p, sep="/"): d for p, d in jax.tree_util.tree_flatten_with_path(
        dims, is_leaf=lambda x: x is None or hasattr(x, "reduction_axis"))[0]}
    assert got["embed"] is None and got["lm_head"] is None
    assert got["final_norm/scale"] is None and got["layers/attn_norm/scale"] is None
    # the 'layers' axis (0) is a batch axis; embed is the input of wq, the output of wo
    assert tuple(got["layers/attn/wq"]) == ((1,), (2, 3))
    assert tuple(got["layers/attn/wo"]) == ((1, 2), (3,))
    assert tuple(got["layers/mlp/w_down"]) == ((1,), (2,))
    assert frameworks.is_box(nnx.state(model, nnx.Param)["embed"])


def test_step_one_trains_at_a_positive_lr_and_the_schedule_flags_apply():
    schedule = make_schedule("adamw", 1e-3, 100, warmup=9)
    assert float(schedule(0)) == pytest.approx(1e-4)  # lr / (warmup + 1), not 0
    assert float(schedule(9)) == pytest.approx(1e-3)
    assert float(schedule(100)) == pytest.approx(1e-4)  # --min-lr-ratio 0.1
    run_config = check(TrainConfig(steps=50, warmup_steps=4, min_lr_ratio=0.0, lr=2e-3,
                                   optimizer="lion"))
    _, sched = optimizer(run_config)
    assert float(sched(0)) == pytest.approx(4e-4) and float(sched(50)) == pytest.approx(0.0)
    assert float(optimizer(check(TrainConfig(steps=20)))[1](0)) > 0  # the defaults too


def test_default_lr_from_scratch_and_for_fine_tuning(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert check(TrainConfig()).lr == 3e-3
    assert check(TrainConfig(init_from=f"hf:{tmp_path}")).lr == 2e-5
    assert check(TrainConfig(init_from=f"hf:{tmp_path}", lr=1e-4)).lr == 1e-4


def test_weight_decay_and_clipping_reach_the_optimizer():
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.full(3, 100.0)}
    sgd = make_optimizer("sgd", 1.0, 10, clip_grad_norm=1.0, weight_decay=0.5)
    update, _ = sgd.update(grads, sgd.init(params), params)
    # clipped to norm 1 (100/|100*sqrt3| each), plus decay 0.5 * w, times -lr
    np.testing.assert_allclose(update["w"], -(1 / np.sqrt(3) + 0.5), rtol=1e-6)
    plain = make_optimizer("sgd", 1.0, 10)
    np.testing.assert_allclose(plain.update(grads, plain.init(params), params)[0]["w"], -100.0)


@pytest.mark.parametrize("flags, needle", [
    (dict(warmup_steps=-1), "--warmup-steps -1"),
    (dict(min_lr_ratio=1.5), "--min-lr-ratio 1.5"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1"),
    (dict(clip_grad_norm=float("nan")), "--clip-grad-norm nan"),
    (dict(optimizer="adam"), "--optimizer 'adam'"),
])
def test_bad_schedule_flags_are_usage_errors(flags, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        check(TrainConfig(**flags))


def test_check_is_pure_and_fills_every_default_once():
    """`check` leaves its argument alone and returns a frozen config with the defaults filled
    in; checking that again changes nothing (sgd's constant schedule included)."""
    given = TrainConfig(steps=100)
    config = check(given)
    assert given.lr is None and given.warmup_steps is None  # untouched
    assert (config.lr, config.warmup_steps, config.min_lr_ratio, config.weight_decay,
            config.clip_grad_norm, config.tokenizer) == (3e-3, 5, 0.1, 0.01, 1.0, "bytes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    for c in (config, check(TrainConfig(steps=100, optimizer="sgd"))):
        assert check(c) == c
    sgd = check(TrainConfig(optimizer="sgd"))
    assert (sgd.warmup_steps, sgd.min_lr_ratio, sgd.weight_decay, sgd.clip_grad_norm) == (
        0, 1.0, 0.0, 0.0)


def test_a_config_json_from_before_the_defaults_were_saved_resumes(tmp_path):
    """A run directory's config.json written when the optimizer's defaults were left null
    reads back with them filled in as the run used them, and resumes under the same flags."""
    old = dataclasses.asdict(TrainConfig(steps=100, lr=3e-3, tokenizer="bytes", out=str(tmp_path)))
    assert old["warmup_steps"] is None
    (tmp_path / "config.json").write_text(json.dumps(old))
    saved = load_run_config(tmp_path)
    assert saved == check(TrainConfig(steps=100, out=str(tmp_path)))
    check_resume(saved, check(TrainConfig(steps=100, out=str(tmp_path), resume=True)))
    assert schedule_change(saved, check(TrainConfig(steps=100, out=str(tmp_path))), 50) is None
