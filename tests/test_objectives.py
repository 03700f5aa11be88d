"""The post-training objectives equal TRL's definitions, written out independently in numpy here.

References (huggingface/trl): trl/trainer/dpo_trainer.py ``DPOTrainer.dpo_loss`` (sigmoid with
label smoothing, ipo; rewards ``β(π - ref)``), trl/trainer/cpo_trainer.py ``CPOTrainer.cpo_loss``
(``loss_type="simpo"``: ``logits - simpo_gamma / beta``, rewards ``β·logps``),
trl/trainer/orpo_trainer.py ``ORPOTrainer.odds_ratio_loss`` (``log1p(-exp(.))`` log odds,
``loss = nll - mean(β·logsigmoid)``), trl/trainer/grpo_trainer.py
``_generate_and_score_completions``
(advantages with torch's unbiased std) and ``_compute_loss`` (clipped ratio, k3 KL,
``loss_type="dapo"``, ``clip_ratio/{low,high,region}_mean``). The ``*_trl_run`` tests compare
with TRL's own code run on fixed inputs (tests/fixtures/trl, made by
tests/reference/make_trl_fixtures.py; meta.json names the TRL version).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.train.post import objectives

# jitted, as the train step will run them (and 10x faster than op-by-op here)
dpo_loss = jax.jit(objectives.dpo_loss, static_argnames="loss_type")
simpo_loss = jax.jit(objectives.simpo_loss)
orpo_loss = jax.jit(objectives.orpo_loss)
sequence_logps = jax.jit(objectives.sequence_logps)
group_advantages = jax.jit(objectives.group_advantages, static_argnames=("group_size", "scale"))
grpo_loss = jax.jit(objectives.grpo_loss, static_argnames=("beta", "epsilon_high"))

PC = np.array([-12.0, -30.5, -7.25, -18.0], np.float32)   # policy chosen (summed) logps
PR = np.array([-14.0, -29.0, -9.0, -18.0], np.float32)    # policy rejected
RC = np.array([-13.0, -31.0, -7.0, -17.5], np.float32)    # reference chosen
RR = np.array([-13.5, -28.0, -9.5, -18.5], np.float32)    # reference rejected
AC = np.array([-0.9, -1.7, -0.35, -2.2], np.float32)      # per-token average logps, chosen
AR = np.array([-1.1, -1.5, -0.8, -2.2], np.float32)       # rejected


def _logsig(x):
    return -np.logaddexp(0.0, -x)


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=tol, atol=tol)


def _reward_metrics(chosen_r, rejected_r, chosen_logps, rejected_logps):
    return {"rewards/chosen": chosen_r.mean(), "rewards/rejected": rejected_r.mean(),
            "rewards/accuracies": (chosen_r > rejected_r).mean(),
            "rewards/margins": (chosen_r - rejected_r).mean(),
            "logps/chosen": chosen_logps.mean(), "logps/rejected": rejected_logps.mean()}


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_sigmoid_equals_trl(beta, smoothing):
    logits = (PC.astype(np.float64) - PR) - (RC - RR)
    want = (-_logsig(beta * logits) * (1 - smoothing) - _logsig(-beta * logits) * smoothing)
    losses, metrics = dpo_loss(PC, PR, RC, RR, beta=beta, label_smoothing=smoothing)
    _close(losses, want)
    want_metrics = _reward_metrics(beta * (PC - RC), beta * (PR - RR), PC, PR)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        _close(metrics[name], value)
    # the ties and the losing pair count: accuracies is not trivially 1
    assert 0 < float(metrics["rewards/accuracies"]) < 1


def test_dpo_label_smoothing_is_the_flipped_loss_mixed_in():
    flipped, _ = dpo_loss(PR, PC, RR, RC, beta=0.3)
    plain, _ = dpo_loss(PC, PR, RC, RR, beta=0.3)
    smooth, _ = dpo_loss(PC, PR, RC, RR, beta=0.3, label_smoothing=0.25)
    _close(smooth, 0.75 * np.asarray(plain) + 0.25 * np.asarray(flipped))


def test_ipo_equals_trl_on_average_logps():
    beta = 0.2
    # IPO's inputs are per-token averages (TRL divides by the completion length first)
    pc, pr, rc, rr = AC, AR, AC + 0.1, AR - 0.3
    logits = (pc.astype(np.float64) - pr) - (rc - rr)
    losses, metrics = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
    _close(losses, (logits - 1 / (2 * beta)) ** 2)
    _close(metrics["rewards/margins"], (beta * ((pc - rc) - (pr - rr))).mean())
    # IPO's minimum sits at h = 1/(2β), not at h → ∞ as in DPO
    at_target, _ = dpo_loss(jnp.array([1 / (2 * beta)]), jnp.zeros(1), jnp.zeros(1),
                            jnp.zeros(1), beta=beta, loss_type="ipo")
    assert float(at_target[0]) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="hinge"):
        dpo_loss(PC, PR, RC, RR, loss_type="hinge")


@pytest.mark.parametrize("beta,gamma,smoothing", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_equals_trl(beta, gamma, smoothing):
    logits = AC.astype(np.float64) - AR - gamma / beta   # cpo_loss: logits - simpo_gamma / beta
    want = -_logsig(beta * logits) * (1 - smoothing) - _logsig(-beta * logits) * smoothing
    losses, metrics = simpo_loss(AC, AR, beta=beta, gamma=gamma, label_smoothing=smoothing)
    _close(losses, want)
    for name, value in _reward_metrics(beta * AC, beta * AR, AC, AR).items():
        _close(metrics[name], value)


def test_simpo_margin_is_gamma_in_reward_units():
    # β(c - r) == γ puts the loss at log 2 whatever β is (the margin is γ, not βγ)
    for beta in (1.0, 2.0, 4.0):
        losses, _ = simpo_loss(jnp.array([-1.0]), jnp.array([-1.0 - 0.5 / beta]),
                               beta=beta, gamma=0.5)
        assert float(losses[0]) == pytest.approx(np.log(2), abs=1e-6)


@pytest.mark.parametrize("nll", [np.array([1.3, 2.1, 0.4, 2.5], np.float32), np.float32(1.7)])
def test_orpo_equals_trl(nll):
    lam = 0.1
    c, r = AC.astype(np.float64), AR.astype(np.float64)
    log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
    ratio = _logsig(log_odds)
    losses, metrics = orpo_loss(AC, AR, jnp.asarray(nll), lam=lam)
    _close(losses, nll - lam * ratio)
    # TRL's training loss: policy_nll_loss - mean(β·ratio)
    _close(np.asarray(losses).mean(), np.mean(nll) - (lam * ratio).mean())
    _close(metrics["log_odds_ratio"], ratio.mean())
    _close(metrics["log_odds_chosen"], log_odds.mean())
    _close(metrics["nll_loss"], np.mean(nll))
    for name, value in _reward_metrics(lam * c, lam * r, c, r).items():
        _close(metrics[name], value)


def test_sequence_logps_sums_the_masked_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    labels = rng.integers(0, 7, size=(2, 5))
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    labels_with_ignored = np.where(mask == 1, labels, -100)
    logprobs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    token = np.take_along_axis(logprobs, labels[..., None], -1)[..., 0]
    logps, counts = sequence_logps(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32),
                                   jnp.asarray(labels_with_ignored), jnp.asarray(mask))
    _close(logps, (token * mask).sum(-1), tol=1e-2)  # bf16 inputs
    logps, counts = sequence_logps(logits, labels_with_ignored, mask)
    _close(logps, (token * mask).sum(-1))
    np.testing.assert_array_equal(np.asarray(counts), [3.0, 2.0])
    assert logps.dtype == jnp.float32


def test_group_advantages_on_a_hand_computed_table():
    rewards = jnp.array([1.0, 0.0, 1.0, 0.0,    # mean 0.5, unbiased std sqrt(1/3)
                         2.0, 2.0, 2.0, 2.0,    # all equal: advantage 0
                         0.0, 0.0, 0.0, 3.0])   # mean 0.75, unbiased std 1.5
    a = 0.5 / (np.sqrt(1 / 3) + 1e-4)
    want = [a, -a, a, -a, 0, 0, 0, 0,
            -0.75 / 1.5001, -0.75 / 1.5001, -0.75 / 1.5001, 2.25 / 1.5001]
    _close(group_advantages(rewards, 4), want)
    _close(group_advantages(rewards, 4, scale=False),
           [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25])
    # groups are consecutive: the same rewards read as pairs give other advantages
    _close(group_advantages(rewards, 2, scale=False)[:4], [0.5, -0.5, 0.5, -0.5])
    _close(group_advantages(rewards, 2, scale=False)[8:], [0, 0, -1.5, 1.5])
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards, 5)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(rewards, 1)


def _grpo_reference(logps, old, ref, adv, mask, eps_low, eps_high, beta, normaliser):
    """trl/trainer/grpo_trainer.py _compute_loss, loss_type="dapo", in numpy (float64)."""
    logps, old, ref = (np.asarray(x, np.float64) for x in (logps, old, ref))
    coef_1 = np.exp(logps - old)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    a = np.asarray(adv, np.float64)[:, None]
    per_token = -np.minimum(coef_1 * a, coef_2 * a)
    kl = np.exp(ref - logps) - (ref - logps) - 1
    per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / normaliser
    low = (coef_1 < 1 - eps_low) & (a < 0)
    high = (coef_1 > 1 + eps_high) & (a > 0)
    n = mask.sum()
    return loss, {"kl": (kl * mask).sum() / n, "clip_ratio": ((low | high) * mask).sum() / n,
                  "clip_ratio/low_mean": (low * mask).sum() / n,
                  "clip_ratio/high_mean": (high * mask).sum() / n}


@pytest.mark.parametrize("eps_high,num_tokens", [(None, None), (0.28, 40.0)])
def test_grpo_loss_equals_trl(eps_high, num_tokens):
    rng = np.random.default_rng(1)
    logps = rng.uniform(-3, -0.1, size=(4, 6)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, size=logps.shape)).astype(np.float32)
    ref = (logps + rng.normal(0, 0.5, size=logps.shape)).astype(np.float32)
    adv = np.array([1.2, -0.4, 0.0, -1.5], np.float32)
    mask = (np.arange(6)[None] < np.array([6, 4, 5, 2])[:, None]).astype(np.float32)
    loss, metrics = grpo_loss(logps, old, ref, adv, mask, epsilon=0.2, epsilon_high=eps_high,
                              beta=0.04, num_tokens=num_tokens)
    want, want_metrics = _grpo_reference(logps, old, ref, adv, mask, 0.2,
                                         0.2 if eps_high is None else eps_high, 0.04,
                                         mask.sum() if num_tokens is None else num_tokens)
    _close(loss, want)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        _close(metrics[name], value)
    assert 0 < float(metrics["clip_ratio"]) < 1   # these rollouts do clip, on both sides
    assert float(metrics["clip_ratio/low_mean"]) > 0 and float(metrics["clip_ratio/high_mean"]) > 0


def test_grpo_on_policy_has_ratio_one_and_no_clipping():
    logps = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]])
    adv = jnp.array([0.7, -1.3])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for old in (logps, None):      # None: one step per rollout batch, old = logps held still
        loss, metrics = grpo_loss(logps, old, logps, adv, mask)
        # ratio 1 and KL 0: the loss is minus the token-weighted mean advantage
        assert float(loss) == pytest.approx(-(0.7 * 3 - 1.3 * 2) / 5, abs=1e-6)
        assert float(metrics["clip_ratio"]) == 0.0 and float(metrics["kl"]) == 0.0


def test_grpo_hand_computed_clipping():
    old = jnp.zeros((2, 2))
    logps = jnp.log(jnp.array([[1.5, 0.7], [0.5, 2.0]]))   # the ratios, as old logps are 0
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])             # the ratio 2.0 token is padding
    loss, metrics = grpo_loss(logps, old, None, adv, mask, epsilon=0.2, beta=0.0)
    # +A: min(1.5, 1.2) = 1.2 (high clip), min(0.7, 0.8) = 0.7 (below 1-ε, yet the unclipped
    # term is taken: not counted as clipped); -A: min(-0.5, -0.8) = -0.8 (low clip)
    assert float(loss) == pytest.approx((-1.2 - 0.7 + 0.8) / 3, abs=1e-6)
    assert float(metrics["clip_ratio"]) == pytest.approx(2 / 3)
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(1 / 3)
    assert "kl" not in metrics
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, old, None, adv, mask)


def test_gradients_exist_and_are_finite():
    def preference(p):
        c, r = p
        return (dpo_loss(c, r, RC, RR)[0].mean() + dpo_loss(c / 10, r / 10, RC / 10, RR / 10,
                                                             loss_type="ipo")[0].mean()
                + simpo_loss(c / 20, r / 20)[0].mean()
                + orpo_loss(c / 20, r / 20, -c / 20)[0].mean())

    grads = jax.jit(jax.grad(preference))((jnp.asarray(PC), jnp.asarray(PR)))
    for g in grads:
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0

    logps = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]])
    adv = jnp.array([0.7, -1.3])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    grad = jax.jit(jax.grad(lambda lp: grpo_loss(lp, None, logps, adv, mask, beta=0.0)[0]))(logps)
    # on policy the clipped surrogate's gradient is the policy gradient: -A per token / tokens
    _close(grad, -np.array([[0.7] * 3, [-1.3, -1.3, 0.0]]) / 5)
    grad = jax.jit(jax.grad(lambda lp: grpo_loss(lp, None, logps - 0.5, adv, mask)[0]))(logps)
    assert np.isfinite(np.asarray(grad)).all()
    assert float(jnp.abs(grad[1, 2])) == 0.0   # a padding token gets no gradient


# --- TRL's own code, run once in the reference environment -------------------------------------
# tests/reference/make_trl_fixtures.py calls TRL's loss methods (DPOTrainer._compute_loss,
# CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss, GRPOTrainer._compute_loss and its advantage
# block) on fixed log-probabilities and saves inputs and outputs; meta.json names TRL's version.

TRL_DIR = Path(__file__).parent / "fixtures" / "trl"


@pytest.fixture(scope="module")
def trl():
    arrays = np.load(TRL_DIR / "trl_losses.npz")
    meta = json.loads((TRL_DIR / "meta.json").read_text())
    return {k: arrays[k] for k in arrays}, meta["cases"]


def _trl_close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours, np.float64), theirs, rtol=1e-6, atol=1e-6)


def _check_reward_metrics(metrics, logged):
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected"):
        _trl_close(metrics[name], logged[name])


def test_dpo_sigmoid_equals_trl_run(trl):
    a, cases = trl
    case = cases["dpo_sigmoid"]
    losses, metrics = dpo_loss(a["policy_chosen"], a["policy_rejected"], a["ref_chosen"],
                               a["ref_rejected"], beta=case["beta"])
    _trl_close(losses, a["dpo_sigmoid/losses"])
    _trl_close(np.asarray(losses).mean(), case["loss"])
    _check_reward_metrics(metrics, case["metrics"])
    assert 0 < case["metrics"]["rewards/accuracies"] < 1    # a tie and losing pairs are in it


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_conservative_dpo_equals_trl_run(trl, smoothing):
    # TRL >= 1.0 keeps the label-smoothed sigmoid only in CPOTrainer.cpo_loss: fed the DPO
    # log-ratios it is conservative DPO; its rewards are then β·(π - ref), DPO's rewards
    a, cases = trl
    name = f"cdpo_{smoothing}"
    losses, metrics = dpo_loss(a["policy_chosen"], a["policy_rejected"], a["ref_chosen"],
                               a["ref_rejected"], beta=cases[name]["beta"],
                               label_smoothing=smoothing)
    _trl_close(losses, a[f"{name}/losses"])
    _trl_close(metrics["rewards/chosen"], a[f"{name}/chosen_rewards"].mean())
    _trl_close(metrics["rewards/rejected"], a[f"{name}/rejected_rewards"].mean())
    if smoothing == 0.0:   # and DPOTrainer's own sigmoid is the ε = 0 case
        _trl_close(losses, a["dpo_sigmoid/losses"])


def test_ipo_equals_trl_run(trl):
    # TRL's IPO divides each log-ratio by its completion length; we take per-token averages
    a, cases = trl
    case = cases["dpo_ipo"]
    cc, rc = a["chosen_counts"], a["rejected_counts"]
    losses, metrics = dpo_loss(a["policy_chosen"] / cc, a["policy_rejected"] / rc,
                               a["ref_chosen"] / cc, a["ref_rejected"] / rc,
                               beta=case["beta"], loss_type="ipo")
    _trl_close(losses, a["dpo_ipo/losses"])
    _trl_close(np.asarray(losses).mean(), case["loss"])
    # TRL logs IPO's rewards and logps from the summed log-probabilities, as for DPO
    _, summed = dpo_loss(a["policy_chosen"], a["policy_rejected"], a["ref_chosen"],
                         a["ref_rejected"], beta=case["beta"], loss_type="ipo")
    _check_reward_metrics(summed, case["metrics"])


@pytest.mark.parametrize("name", ["simpo", "simpo_smooth"])
def test_simpo_equals_trl_run(trl, name):
    a, cases = trl
    case = cases[name]
    losses, metrics = simpo_loss(a["chosen_avg"], a["rejected_avg"], beta=case["beta"],
                                 gamma=case["simpo_gamma"],
                                 label_smoothing=case["label_smoothing"])
    _trl_close(losses, a[f"{name}/losses"])
    _trl_close(metrics["rewards/chosen"], a[f"{name}/chosen_rewards"].mean())
    _trl_close(metrics["rewards/rejected"], a[f"{name}/rejected_rewards"].mean())
    chosen, rejected = a[f"{name}/chosen_rewards"], a[f"{name}/rejected_rewards"]
    _trl_close(metrics["rewards/accuracies"], (chosen > rejected).mean())


def test_orpo_equals_trl_run(trl):
    a, cases = trl
    case = cases["orpo"]
    losses, metrics = orpo_loss(a["chosen_avg"], a["rejected_avg"], a["orpo/nll"],
                                lam=case["beta"])
    # TRL's odds_ratio_loss returns +β·logσ(log odds); the loss is nll - that
    _trl_close(losses, a["orpo/nll"] - a["orpo/losses"])
    _trl_close(np.asarray(losses).mean(), case["loss"])
    _trl_close(metrics["log_odds_ratio"], case["log_odds_ratio"])
    _trl_close(metrics["log_odds_chosen"], case["log_odds_chosen"])
    chosen, rejected = a["orpo/chosen_rewards"], a["orpo/rejected_rewards"]
    _trl_close(metrics["rewards/chosen"], chosen.mean())
    _trl_close(metrics["rewards/rejected"], rejected.mean())
    # get_batch_loss_metrics' accuracies and margins, from TRL's rewards
    _trl_close(metrics["rewards/accuracies"], (chosen > rejected).mean())
    _trl_close(metrics["rewards/margins"], (chosen - rejected).mean())
    _trl_close(metrics["nll_loss"], a["orpo/nll"].mean())


@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_advantages_equal_trl_run(trl, scale):
    a, _ = trl
    ours = group_advantages(jnp.asarray(a["grpo/rewards"]), 4, scale=scale == "group")
    _trl_close(ours, a[f"grpo/advantages_{scale}"])


@pytest.mark.parametrize("name", ["grpo", "grpo_dapo", "grpo_nokl"])
def test_grpo_loss_equals_trl_run(trl, name):
    a, cases = trl
    case = cases[name]
    loss, metrics = grpo_loss(a["grpo/logps"], a["grpo/old_logps"], a["grpo/ref_logps"],
                              a["grpo/advantages_group"], a["grpo/mask"],
                              epsilon=case["epsilon_low"], epsilon_high=case["epsilon_high"],
                              beta=case["beta"], num_tokens=case["num_items_in_batch"])
    logged = case["metrics"]
    _trl_close(loss, case["loss"])
    _trl_close(metrics["clip_ratio"], logged["clip_ratio/region_mean"])
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean"):
        _trl_close(metrics[key], logged[key])
    assert ("kl" in metrics) == ("kl" in logged)
    if "kl" in logged:
        _trl_close(metrics["kl"], logged["kl"])
    assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0
