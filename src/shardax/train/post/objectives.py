"""Post-training objectives (DPO/IPO, SimPO, ORPO, GRPO) as pure JAX functions of log-probabilities.

Each loss follows Hugging Face TRL's definition and reports TRL's metric names, so a shardax run
reads like a TRL run: ``dpo_trainer.py`` (``dpo_loss``: ``sigmoid`` with label smoothing, ``ipo``),
``cpo_trainer.py`` (SimPO is CPO with ``loss_type="simpo"`` and ``cpo_alpha=0``),
``orpo_trainer.py`` (``odds_ratio_loss``) and ``grpo_trainer.py`` (``_compute_loss``, group
advantages in ``_generate_and_score_completions``). The functions take per-sequence (preference)
or per-token (GRPO) log-probabilities; `sequence_logps` turns a model's logits into them.

>>> import jax.numpy as jnp
>>> losses, metrics = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]),
...                            jnp.array([-2.0]), jnp.array([-2.0]), beta=0.5)
>>> round(float(losses[0]), 4), float(metrics["rewards/accuracies"])
(0.3133, 1.0)
>>> [round(float(a), 3) for a in group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 2)]
[0.707, -0.707, 0.0, 0.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]

_DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(logits: jax.Array, labels: jax.Array,
                   mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The summed log-probability of each sequence's masked tokens, and how many there are.

    ``logits[b, t]`` is the prediction for ``labels[b, t]`` (the caller shifts: labels are the
    inputs moved left by one); ``mask`` marks the completion tokens (prompt and padding 0), and
    labels under a 0 mask may hold anything (``-100`` included). Computed in float32. DPO uses the
    sums; IPO, SimPO and ORPO use the per-token average ``logps / counts``.

    Args:
      logits: ``[batch, seq, vocab]``.
      labels: ``[batch, seq]`` integer token ids.
      mask: ``[batch, seq]``, 1 (or True) for the tokens that count.

    Returns:
      ``(logps, counts)``, each ``[batch]`` float32.

    >>> logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75]]]))
    >>> logps, counts = sequence_logps(logits, jnp.array([[0, 1]]), jnp.array([[0, 1]]))
    >>> round(float(logps[0]), 4), float(counts[0])
    (-0.2877, 1.0)
    """
    mask = mask.astype(jnp.float32)
    return (token_logps(logits, labels, mask) * mask).sum(-1), mask.sum(-1)


def token_logps(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Each label's log-probability ``[batch, seq]`` (float32) under ``logits``; 0 where
    ``mask`` is 0 (whatever the label there: ``-100`` included). GRPO's per-token input.

    >>> logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75]]]))
    >>> [round(float(x), 4) for x in token_logps(logits, jnp.array([[0, 1]]), jnp.ones((1, 2)))[0]]
    [-0.6931, -0.2877]
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    safe = jnp.where(mask > 0, labels, 0)
    token = jnp.take_along_axis(logprobs, safe[..., None], axis=-1)[..., 0]
    return jnp.where(mask > 0, token, 0.0)


def _smoothed_sigmoid(logits: jax.Array, label_smoothing: float) -> jax.Array:
    """``-log σ(x)(1-ε) - log σ(-x)ε``: the conservative (cDPO) binary loss TRL uses."""
    return (-jax.nn.log_sigmoid(logits) * (1 - label_smoothing)
            - jax.nn.log_sigmoid(-logits) * label_smoothing)


def _reward_metrics(chosen_rewards: jax.Array, rejected_rewards: jax.Array,
                    chosen_logps: jax.Array, rejected_logps: jax.Array) -> Metrics:
    """TRL's preference metrics (batch means), without gradient."""
    chosen_rewards = jax.lax.stop_gradient(chosen_rewards)
    rejected_rewards = jax.lax.stop_gradient(rejected_rewards)
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": jax.lax.stop_gradient(chosen_logps).mean(),
        "logps/rejected": jax.lax.stop_gradient(rejected_logps).mean(),
    }


def dpo_loss(policy_chosen_logps: jax.Array, policy_rejected_logps: jax.Array,
             ref_chosen_logps: jax.Array, ref_rejected_logps: jax.Array, *,
             beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> tuple[jax.Array, Metrics]:
    """Direct Preference Optimization, per example, as TRL's ``DPOTrainer.dpo_loss``.

    With ``h = (π_c - ref_c) - (π_r - ref_r)`` (log-probabilities of the chosen and rejected
    completions under the policy and the frozen reference):

    - ``"sigmoid"`` (DPO; conservative DPO when ``label_smoothing > 0``):
      ``-log σ(βh)(1-ε) - log σ(-βh)ε``, as TRL < 1.0's ``DPOTrainer`` and TRL 1.16's
      ``CPOTrainer`` compute it (TRL 1.x's ``DPOTrainer`` ignores ε for sigmoid).
    - ``"ipo"``: ``(h - 1/(2β))²``. TRL feeds IPO per-token *average* log-probabilities
      (``logps / counts`` of `sequence_logps`); passing them is the caller's job.
      ``label_smoothing`` does not apply to IPO.

    Args:
      policy_chosen_logps, policy_rejected_logps: ``[batch]`` policy log-probabilities.
      ref_chosen_logps, ref_rejected_logps: ``[batch]`` reference log-probabilities.
      beta: β, the strength of the implicit KL penalty (τ of the IPO paper).
      label_smoothing: ε, the assumed probability that a preference label is flipped.
      loss_type: ``"sigmoid"`` or ``"ipo"``.

    Returns:
      ``(losses, metrics)``: ``[batch]`` losses (the training loss is their mean) and TRL's
      ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
      ``logps/chosen``, ``logps/rejected`` (rewards are ``β(π - ref)``).

    >>> losses, _ = dpo_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.zeros(2))
    >>> [round(float(x), 4) for x in losses]
    [0.6931, 0.6931]
    """
    if loss_type not in _DPO_LOSS_TYPES:
        raise ValueError(f"dpo loss_type {loss_type!r}: expected one of {_DPO_LOSS_TYPES}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    logits = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = _smoothed_sigmoid(beta * logits, label_smoothing)
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio,
                              policy_chosen_logps, policy_rejected_logps)
    return losses, metrics


def simpo_loss(chosen_avg_logps: jax.Array, rejected_avg_logps: jax.Array, *,
               beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> tuple[jax.Array, Metrics]:
    """SimPO (reference-free, length-normalised), per example, as TRL's CPO ``loss_type="simpo"``.

    ``-log σ(β(c - r) - γ)(1-ε) - log σ(-(β(c - r) - γ))ε`` on per-token average
    log-probabilities ``c``, ``r``. γ is TRL's ``simpo_gamma``: the target margin in reward
    units (TRL writes it as ``β(c - r - γ/β)``), so the margin is γ, not βγ. This is pure SimPO
    (TRL's ``cpo_alpha=0``); CPO-SimPO adds ``cpo_alpha`` times the chosen NLL, the caller's sum.

    Args:
      chosen_avg_logps, rejected_avg_logps: ``[batch]`` per-token average log-probabilities.
      beta: β, the reward scale.
      gamma: γ, the target reward margin.
      label_smoothing: ε, as in `dpo_loss`.

    Returns:
      ``(losses, metrics)``: ``[batch]`` losses and TRL's reward metrics, rewards ``β·logps``.

    >>> losses, _ = simpo_loss(jnp.array([-1.0]), jnp.array([-1.25]), beta=2.0, gamma=0.5)
    >>> round(float(losses[0]), 4)
    0.6931
    """
    logits = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    losses = _smoothed_sigmoid(logits, label_smoothing)
    metrics = _reward_metrics(beta * chosen_avg_logps, beta * rejected_avg_logps,
                              chosen_avg_logps, rejected_avg_logps)
    return losses, metrics


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate near 0 (TRL writes ``log1p(-exp(x))``)."""
    return jnp.log(-jnp.expm1(x))


def orpo_loss(chosen_avg_logps: jax.Array, rejected_avg_logps: jax.Array,
              chosen_nll: jax.Array, *, lam: float = 0.1) -> tuple[jax.Array, Metrics]:
    """ORPO (odds-ratio preference optimisation), per example, as TRL's ``odds_ratio_loss``.

    ``NLL + λ·(-log σ(log odds(c) - log odds(r)))`` with ``log odds(p) = p - log(1 - e^p)`` on
    per-token average log-probabilities. λ is TRL's ``ORPOConfig.beta``.

    Args:
      chosen_avg_logps, rejected_avg_logps: ``[batch]`` per-token average log-probabilities
        (each < 0).
      chosen_nll: the SFT loss on the chosen completions: ``[batch]`` per example, or a scalar
        (TRL's batch-mean cross-entropy), broadcast.
      lam: λ, the weight of the odds-ratio term.

    Returns:
      ``(losses, metrics)``: ``[batch]`` losses and TRL's reward metrics (rewards ``λ·logps``),
      plus ``log_odds_ratio`` (mean ``log σ(log odds ratio)``), ``log_odds_chosen`` (mean log
      odds ratio) and ``nll_loss``.

    >>> losses, m = orpo_loss(jnp.array([-0.5]), jnp.array([-0.5]), jnp.array([1.0]), lam=1.0)
    >>> round(float(losses[0]), 4), float(m["log_odds_chosen"])
    (1.6931, 0.0)
    """
    log_odds = ((chosen_avg_logps - rejected_avg_logps)
                - (_log1mexp(chosen_avg_logps) - _log1mexp(rejected_avg_logps)))
    ratio = jax.nn.log_sigmoid(log_odds)
    losses = chosen_nll - lam * ratio
    metrics = _reward_metrics(lam * chosen_avg_logps, lam * rejected_avg_logps,
                              chosen_avg_logps, rejected_avg_logps)
    metrics["log_odds_ratio"] = jax.lax.stop_gradient(ratio).mean()
    metrics["log_odds_chosen"] = jax.lax.stop_gradient(log_odds).mean()
    metrics["nll_loss"] = jax.lax.stop_gradient(jnp.asarray(chosen_nll)).mean()
    return losses, metrics


def group_advantages(rewards: jax.Array, group_size: int, scale: bool = True) -> jax.Array:
    """GRPO's group-relative advantages: ``(r - mean_group) / (std_group + 1e-4)``, as TRL.

    ``rewards`` holds ``group_size`` consecutive completions per prompt (TRL's
    ``view(-1, num_generations)``). The standard deviation is the unbiased one (``ddof=1``,
    torch's ``std``), so ``group_size`` must be at least 2 when ``scale``. ``scale=False`` is
    TRL's ``scale_rewards="none"`` (Dr. GRPO): centred only.

    Args:
      rewards: ``[prompts * group_size]`` rewards.
      group_size: G, completions per prompt.
      scale: divide by the group's standard deviation.

    Returns:
      ``[prompts * group_size]`` float32 advantages.

    >>> group_advantages(jnp.array([3.0, 1.0]), 2, scale=False).tolist()
    [1.0, -1.0]
    """
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_advantages: {rewards.shape[0]} rewards are not whole groups "
                         f"of {group_size}")
    if scale and group_size < 2:
        raise ValueError("group_advantages: scaling by the group std needs group_size >= 2")
    groups = rewards.astype(jnp.float32).reshape(-1, group_size)
    advantages = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        advantages = advantages / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return advantages.reshape(-1)


def grpo_loss(logps: jax.Array, old_logps: jax.Array | None, ref_logps: jax.Array | None,
              advantages: jax.Array, mask: jax.Array, *, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.04,
              num_tokens: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
    """GRPO's clipped policy-gradient loss with k3 KL, as TRL's ``GRPOTrainer._compute_loss``.

    Per token, with ratio ``ρ = exp(logp - old_logp)`` and the sequence's advantage ``A``:
    ``-min(ρA, clip(ρ, 1-ε, 1+ε_high)A) + β·(exp(ref - logp) - (ref - logp) - 1)``.
    The tokens are averaged as TRL's default ``loss_type="dapo"``: the masked sum over the
    number of completion tokens in the whole (accumulated, all-process) batch, ``num_tokens``;
    it defaults to ``mask.sum()``, right for one batch without gradient accumulation (then
    equal to ``"bnpo"``).

    Args:
      logps: ``[batch, seq]`` per-token log-probabilities of the sampled tokens under the
        policy being trained.
      old_logps: the same under the policy that sampled them; ``None`` means ``logps`` without
        gradient (one optimisation step per rollout batch: ρ = 1).
      ref_logps: the same under the reference model; ``None`` only when ``beta == 0``.
      advantages: ``[batch]`` (from `group_advantages`).
      mask: ``[batch, seq]``, 1 for completion tokens.
      epsilon: ε, the lower clip (and the upper one unless ``epsilon_high``).
      epsilon_high: the upper clip (DAPO's clip-higher), ``None`` for ``epsilon``.
      beta: β, the KL weight (0 skips the reference). 0.04 is DeepSeekMath's value and TRL's
        earlier default; current TRL's ``GRPOConfig.beta`` defaults to 0.0.
      num_tokens: the DAPO normaliser, see above.

    Returns:
      ``(loss, metrics)``: the scalar loss and ``kl`` (masked mean k3 KL, when ``beta != 0``),
      ``clip_ratio`` (fraction of tokens whose clipped term is taken: TRL's
      ``clip_ratio/region_mean``), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``.

    >>> lp = jnp.full((2, 3), -1.0)
    >>> loss, m = grpo_loss(lp, lp, lp, jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
    >>> float(loss), float(m["kl"]), float(m["clip_ratio"])
    (0.0, 0.0, 0.0)
    """
    if ref_logps is None and beta != 0.0:
        raise ValueError("grpo_loss: beta != 0 needs ref_logps")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.astype(jnp.float32)
    logps = logps.astype(jnp.float32)
    old = jax.lax.stop_gradient(logps if old_logps is None else old_logps.astype(jnp.float32))
    ratio = jnp.exp(logps - old)
    adv = advantages.astype(jnp.float32)[:, None]
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high) * adv)
    count = jnp.maximum(mask.sum(), 1.0)

    def masked_mean(x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient((x * mask).sum() / count)

    metrics: Metrics = {}
    if beta != 0.0:
        delta = ref_logps.astype(jnp.float32) - logps
        kl = jnp.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl)
    normaliser = count if num_tokens is None else jnp.maximum(num_tokens, 1.0)
    loss = (per_token * mask).sum() / normaliser
    ratio = jax.lax.stop_gradient(ratio)
    low = ((ratio < 1 - epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    metrics["clip_ratio"] = masked_mean(jnp.maximum(low, high))
    metrics["clip_ratio/low_mean"] = masked_mean(low)
    metrics["clip_ratio/high_mean"] = masked_mean(high)
    return loss, metrics
