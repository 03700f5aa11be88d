"""GRPO (shardax.train.post.grpo) against a hand-computed reference and against one device.

The reference follows TRL's ``GRPOTrainer`` (trl/trainer/grpo_trainer.py):
``_generate_and_score_completions`` (rewards summed, advantages ``(r - mean) / (std + 1e-4)``
per group with torch's unbiased std) and ``_compute_loss`` (ratio ``exp(logp - old)``,
``-min(ρA, clip(ρ, 1-ε, 1+ε)A) + β(exp(ref - logp) - (ref - logp) - 1)``, the default
``loss_type="dapo"``: masked sum over the batch's completion tokens; ``kl`` and
``clip_ratio/region_mean`` masked means).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardax import layout, models
from shardax.data.tokenizer import load_tokenizer
from shardax.layout import forward
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.post import grpo
from shardax.train.post.rewards import RewardError, RewardSet
from shardax.train.step import init_state

CONFIG = models.get_config("llama-tiny", n_layers=1)
TX = optax.sgd(0.5)
G = 2
SETTINGS = grpo.GRPOConfig(group_size=G, prompts_per_step=2, max_new_tokens=4, beta=0.04,
                           num_iterations=2)
TOK = load_tokenizer("bytes")
# ragged prompts (3 and 5 bytes) and completions of 4, 2 (ends with eos 0), 3 and 1 tokens
PROMPTS = [TOK.encode("ab="), TOK.encode("cdef=")]
COMPLETIONS = [[49, 50, 51, 52], [120, 0], [55, 121, 56], [57]]
STOPPED = [False, True, False, False]
RECORDS = [{"prompt": "ab=", "answer": "1"}, {"prompt": "cdef=", "answer": "2"}]


def digits(prompts, completions, answer, **fields):
    return [sum(ch.isdigit() for ch in c) + (a in c) for c, a in zip(completions, answer)]


def create():
    return models.create(CONFIG, nnx.Rngs(0))


@pytest.fixture(scope="module")
def model_state():
    graphdef, _ = nnx.split(nnx.eval_shape(create))
    return graphdef, jax.jit(lambda: init_state(create, TX)[1])()


@pytest.fixture(scope="module")
def one_device_step(model_state):
    return jax.jit(partial(grpo.grpo_step, graphdef=model_state[0], tx=TX, beta=SETTINGS.beta,
                           epsilon=SETTINGS.epsilon))


@pytest.fixture(scope="module")
def mesh_rules():
    return (MeshShardingHelper.from_string("fsdp=4,tp=2"),
            LogicalAxisRules(layout.PRESETS["fsdp_tp"]))


def fixed_rollout() -> grpo.Rollout:
    rows = [p for p in PROMPTS for _ in range(G)]
    tokens, segments, mask = grpo.rollout_arrays(rows, COMPLETIONS, SETTINGS.max_new_tokens)
    batch = grpo.Rollouts(tokens, segments, mask, np.zeros(4, np.float32))
    return grpo.Rollout(batch, COMPLETIONS, STOPPED, 0.0)


def fixed_batch(graphdef, state):
    """The hand-made rollouts scored, with old / reference log-probabilities set off the
    policy's own by fixed amounts (some ratios outside [0.8, 1.2], both signs of A)."""
    out = fixed_rollout()
    advantages, metrics = grpo.score(out, RECORDS, RewardSet([digits]), TOK, SETTINGS)
    logps = np.asarray(jax.jit(partial(grpo.completion_logps, graphdef=graphdef))(
        state.params, state.rest, *out.batch[:3]))
    mask = out.batch.mask
    old = (logps + np.array([[0.5, -0.1, 0.0, 0.3]]).T * np.array([1, -1, 2, 0.5])) * mask
    ref = (logps + np.array([[0.2, -0.4, 0.1, 0.0]]).T * np.array([1, 2, -1, 3])) * mask
    batch = out.batch._replace(advantages=advantages, old_logps=old.astype(np.float32),
                               ref_logps=ref.astype(np.float32))
    return batch, metrics, logps


def test_one_step_equals_trl_by_hand(model_state, one_device_step):
    graphdef, state = model_state
    batch, metrics, logps = fixed_batch(graphdef, state)
    texts = ["1234", "x", "7y8", "9"]  # the stop token (eos 0) is not decoded
    rewards = np.array([sum(ch.isdigit() for ch in t) + (a in t)
                        for t, a in zip(texts, ["1", "1", "2", "2"])], np.float64)
    np.testing.assert_array_equal(rewards, [5, 0, 2, 1])
    groups = rewards.reshape(-1, G)
    want_adv = ((groups - groups.mean(1, keepdims=True))
                / (groups.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    np.testing.assert_allclose(batch.advantages, want_adv, rtol=1e-6)
    assert metrics["reward"] == pytest.approx(rewards.mean())
    assert metrics["reward_std"] == pytest.approx(groups.std(1, ddof=1).mean())
    assert metrics["rewards/digits/mean"] == pytest.approx(rewards.mean())
    assert metrics["completion_length"] == pytest.approx(2.5)
    np.testing.assert_array_equal(batch.mask.sum(1), [4, 2, 3, 1])  # eos in the mask

    # the per-token log-probabilities equal each row's, unpadded at the left (right padding
    # changes nothing before it)
    rows = [p + c for p, c in zip([p for p in PROMPTS for _ in range(G)], COMPLETIONS)]
    right = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for r, row in enumerate(rows):
        right[r, :len(row)] = row
    run = jax.jit(lambda m, t: jax.nn.log_softmax(forward.logits(m, layout.Layout(), t), -1))
    alone = np.asarray(run(nnx.merge(graphdef, state.params, state.rest), right))
    for r, c in enumerate(COMPLETIONS):
        start = len(rows[r]) - len(c) - 1
        want = alone[r, start + np.arange(len(c)), c]
        np.testing.assert_allclose(logps[r, :len(c)], want, rtol=1e-5, atol=1e-6)

    # TRL's _compute_loss, in float64
    lp, old, ref = (np.asarray(a, np.float64) for a in (logps, batch.old_logps, batch.ref_logps))
    mask, adv = batch.mask.astype(np.float64), want_adv[:, None]
    eps, beta = SETTINGS.epsilon, SETTINGS.beta
    ratio = np.exp(lp - old)
    pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    kl = np.exp(ref - lp) - (ref - lp) - 1
    want_loss = ((pg + beta * kl) * mask).sum() / mask.sum()
    clipped = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
    want_clip = (clipped * mask).sum() / mask.sum()
    assert 0 < want_clip < 1

    new, got = one_device_step(jax.tree.map(jnp.copy, state), batch)
    assert float(got["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(got["kl"]) == pytest.approx((kl * mask).sum() / mask.sum(), rel=1e-5)
    assert float(got["clip_ratio"]) == pytest.approx(want_clip, rel=1e-6)
    assert int(new.step) == 1


def test_five_sgd_steps_on_fsdp_tp_equal_one_device(model_state, one_device_step, mesh_rules):
    graphdef, state = model_state
    mesh, rules = mesh_rules
    batch, _, _ = fixed_batch(graphdef, state)
    kw = dict(graphdef=graphdef, tx=TX, beta=SETTINGS.beta, epsilon=SETTINGS.epsilon)
    sharded = mesh.sjit(partial(grpo.grpo_step, **kw), in_shardings=(rules, None),
                        out_shardings=(rules, None))
    a = jax.tree.map(jnp.copy, state)
    b = mesh.sjit(lambda s: s, in_shardings=(rules,), out_shardings=rules)(state)
    spec = b.params["layers"]["attn"]["wq"][...].sharding.spec
    assert "tp" in str(spec) and "fsdp" in str(spec), spec
    losses = []
    for _ in range(5):
        a, ma = one_device_step(a, batch)
        b, mb = sharded(b, batch)
        np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-5)
        losses.append(float(ma["loss"]))
    assert losses[-1] < losses[0]  # the steps moved the parameters
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollout_on_fsdp_tp_equals_one_device(model_state, mesh_rules, temperature):
    graphdef, state = model_state
    mesh, rules = mesh_rules
    settings = grpo.GRPOConfig(group_size=G, max_new_tokens=4, temperature=temperature)
    sharded_state = mesh.sjit(lambda s: s, in_shardings=(rules,), out_shardings=rules)(state)
    one = grpo.rollout(graphdef, state, PROMPTS, settings, step=3)
    many = grpo.rollout(graphdef, sharded_state, PROMPTS, settings, step=3, mesh=mesh,
                        rules=rules)
    assert many.completions == one.completions
    for x, y in zip(one.batch[:3], many.batch[:3]):
        np.testing.assert_array_equal(x, y)
    if temperature:  # the rows of a group differ; the key is a function of the step
        assert one.completions[0] != one.completions[1]
        again = grpo.rollout(graphdef, state, PROMPTS, settings, step=3)
        other = grpo.rollout(graphdef, state, PROMPTS, settings, step=4)
        assert again.completions == one.completions != other.completions
    else:  # greedy: the group's rows are alike
        assert one.completions[0] == one.completions[1]


@pytest.mark.parametrize("name,expected", [
    ("boom", "--reward boom: raised ValueError: no answer in record"),
    ("word", "--reward word: value 'high' at index 1 is not a finite number or None"),
])
def test_bad_reward_surfaces_from_train_grpo(model_state, name, expected):
    def boom(prompts, completions, **fields):
        raise ValueError("no answer\nin record")

    def word(prompts, completions, **fields):
        return [1.0, "high"] + [0.0] * (len(completions) - 2)

    graphdef, state = model_state
    settings = grpo.GRPOConfig(group_size=G, prompts_per_step=2, max_new_tokens=4)
    reward = RewardSet([{"boom": boom, "word": word}[name]])
    with pytest.raises(RewardError) as caught:
        grpo.train_grpo(graphdef, state, TOK, ["ab=", "cdef="], reward, tx=TX, steps=1,
                        settings=settings)
    assert str(caught.value) == expected


def test_resumed_run_is_bit_identical(model_state):
    """Prompts and sampling keys are functions of (seed, step): a run resumed from the state
    after its first step (the GRPO step is read from state.step) repeats the second step."""
    graphdef, state = model_state
    settings = grpo.GRPOConfig(group_size=G, prompts_per_step=2, max_new_tokens=4, seed=1)
    run = partial(grpo.train_grpo, graphdef, tokenizer=TOK, prompts=RECORDS * 2,
                  reward_set=RewardSet([digits]), tx=TX, settings=settings)
    saved = []

    def keep(step, state, metrics):
        saved.append(jax.tree.map(jnp.copy, state))  # the next step donates it

    straight, history = run(jax.tree.map(jnp.copy, state), steps=2, on_step=keep)
    resumed, again = run(saved[0], steps=1)
    assert [m["step"] for m in history] == [0, 1] and again[0]["step"] == 1
    speed = [k for k in again[0] if k.startswith("tokens_per_s")]
    assert {**again[0], **{k: history[1][k] for k in speed}} == history[1]
    for x, y in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lora_reference_is_the_base_model():
    """With LoRA the reference is the adapters zeroed: the base model, no copy of it."""
    from shardax.models.lora import LoRA

    config = models.get_config("llama-tiny", n_layers=1, lora=LoRA(rank=2))
    graphdef, adapters, rest = nnx.split(models.create(config, nnx.Rngs(0)),
                                         nnx.LoRAParam, ...)
    out = fixed_rollout()
    logps = jax.jit(partial(grpo.completion_logps, graphdef=graphdef))
    base = np.asarray(logps(adapters, rest, *out.batch[:3]))  # lora_b is 0 at init
    trained = jax.tree.map(lambda x: x + 0.1, adapters)
    ref = grpo.reference_params(trained, lora=True)
    assert {x.size for x in jax.tree.leaves(ref)} == {x.size for x in jax.tree.leaves(trained)}
    np.testing.assert_array_equal(np.asarray(logps(ref, rest, *out.batch[:3])), base)
    assert not np.allclose(np.asarray(logps(trained, rest, *out.batch[:3])), base)


def test_prompt_and_completion_must_fit_the_model(model_state):
    graphdef, state = model_state
    settings = grpo.GRPOConfig(group_size=G, max_new_tokens=CONFIG.max_seq_len - 2)
    with pytest.raises(ValueError, match=r"prompt of 5 tokens and max_new_tokens=126 exceed "
                                         r"the model's max_seq_len 128"):
        grpo.rollout(graphdef, state, PROMPTS, settings, step=0)


def test_resuming_a_full_fine_tune_with_kl_needs_the_reference(model_state):
    graphdef, state = model_state
    with pytest.raises(ValueError, match="needs ref_params, the initial parameters"):
        grpo.train_grpo(graphdef, state._replace(step=jnp.int32(4)), TOK, ["ab="],
                        RewardSet([digits]), tx=TX, steps=1, settings=SETTINGS)
