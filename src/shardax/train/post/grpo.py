"""GRPO on a mesh: rollouts with the sharded KV-cache decoder, rewards, clipped policy updates.

One GRPO step, as TRL's ``GRPOTrainer``: each prompt of the step's batch is sampled
``group_size`` times from the current policy (`rollout`, with `shardax.models.decode`),
the completions are scored by the user's reward functions and turned into group-normalised
advantages (`score`), and ``num_iterations`` optimizer steps minimise
`shardax.train.post.objectives.grpo_loss` on that batch (`grpo_step`). Sampling and updates run
on the same mesh, under the same rules as the train state; `train_grpo` is the loop.

Defaults follow TRL's current ``GRPOConfig``: ``beta=0.0`` (no reference model is held or
run), ``epsilon=0.2``, ``num_iterations=1`` (then the ratio is 1 and no old log-probabilities
are computed), ``scale_rewards`` by the group's std, and ``loss_type="dapo"`` aggregation (the
masked token sum over the batch's completion tokens). With ``beta > 0`` the reference is the
initial policy: for a LoRA model the base with the adapters zeroed (no second copy of the
weights), else a frozen copy of the initial parameters.

Example::

    state, history = train_grpo(graphdef, state, tokenizer, ["2+2=", "3+4="], RewardSet([fn]),
                                tx=optax.adam(1e-3), steps=20, mesh=mesh, rules=rules,
                                settings=GRPOConfig(group_size=8, max_new_tokens=16))
    history[-1]["reward"]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardax.data import packing
from shardax.data.tokenizer import Tokenizer
from shardax.layout import forward
from shardax.layout.spec import Layout
from shardax.models import decode
from shardax.precision import Policy
from shardax.train.post import objectives
from shardax.train.post.rewards import RewardSet, reward_metrics
from shardax.train.step import FULL_PRECISION, ONE_DEVICE, TrainState, apply_gradients

__all__ = ["GRPOConfig", "Rollout", "Rollouts", "completion_logps", "grpo_step",
           "reference_params", "rollout", "rollout_arrays", "rollout_seed", "score",
           "step_prompts", "train_grpo"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings, named and defaulted as TRL's ``GRPOConfig``.

    ``group_size`` is TRL's ``num_generations``; ``prompts_per_step`` prompts make one
    rollout batch of ``prompts_per_step * group_size`` completions of at most
    ``max_new_tokens`` (``max_completion_length``) tokens each, sampled with ``temperature``,
    ``top_k`` (0: all) and ``top_p``. ``epsilon`` / ``epsilon_high`` clip the ratio, ``beta``
    weighs the KL to the reference (0: none), ``num_iterations`` optimizer steps are taken
    per rollout batch, ``scale_rewards`` divides the advantages by the group's std.
    ``seed`` fixes the prompt order and the sampling keys: both are functions of
    ``(seed, step)``, so a resumed run samples what the straight one did.
    """

    group_size: int = 8
    prompts_per_step: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    num_iterations: int = 1
    scale_rewards: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.group_size < 2 and self.scale_rewards:
            raise ValueError(f"group_size={self.group_size}: GRPO needs at least 2 completions "
                             "per prompt")
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0, top_p="
                             f"{self.top_p} in (0, 1] and top_k={self.top_k} >= 0")


class Rollouts(NamedTuple):
    """What `grpo_step` trains on (a pytree of arrays), ``B`` completions of ``C`` tokens.

    ``tokens`` [B, P + C] int32: each row's prompt left-padded to ``P`` columns, then its
    completion from column ``P`` (right-padded); ``segment_ids`` [B, P + C]: 0 on the left
    padding, 1 on the row's tokens (so padding is never attended to and positions start at
    the prompt's first token, as in decoding); ``mask`` [B, C] float32: the completion's
    tokens, up to and including its stop token; ``advantages`` [B]; ``old_logps`` /
    ``ref_logps`` [B, C]: the sampling policy's and the reference's per-token
    log-probabilities (None: not needed, see `grpo_step`)."""

    tokens: Any
    segment_ids: Any
    mask: Any
    advantages: Any
    old_logps: Any = None
    ref_logps: Any = None


@dataclasses.dataclass
class Rollout:
    """One rollout batch: the arrays to train on (``batch``, advantages still 0), the new
    tokens of each row (``completions``, a stop token last where ``stopped``) and the
    sampling speed (new tokens per second, compile included on first use)."""

    batch: Rollouts
    completions: list[list[int]]
    stopped: list[bool]
    tokens_per_s: float


def completion_logps(params: Any, rest: Any, tokens: jax.Array, segment_ids: jax.Array,
                     mask: jax.Array, *, graphdef: Any, layout: Layout = ONE_DEVICE,
                     policy: Policy = FULL_PRECISION) -> jax.Array:
    """The per-token log-probabilities ``[B, C]`` (float32, 0 off ``mask``) of the
    completions in ``tokens`` (laid out as in `Rollouts`) under the model
    ``nnx.merge(graphdef, params, rest)`` run by ``layout`` in ``policy``'s dtypes.

    Example::

        logps = completion_logps(state.params, state.rest, *batch[:3], graphdef=graphdef)
    """
    width = tokens.shape[1] - mask.shape[1]
    # Fresh Variables for the frozen state at this trace level (as forward.params_loss).
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
    positions = packing.segment_positions(segment_ids)
    logits = forward.logits(model, layout, tokens[:, :-1], positions[:, :-1],
                            segment_ids=segment_ids[:, :-1])
    logits = policy.cast_to_output(logits)[:, width - 1:]
    return objectives.token_logps(logits, tokens[:, width:], mask)


def grpo_step(state: TrainState, batch: Rollouts, *, graphdef: Any,
              tx: optax.GradientTransformation, layout: Layout = ONE_DEVICE,
              policy: Policy = FULL_PRECISION, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.0
              ) -> tuple[TrainState, dict]:
    """One optimizer step on `shardax.train.post.objectives.grpo_loss` of ``batch``.

    ``batch.old_logps`` None: the batch was sampled by these very parameters (TRL's
    ``num_iterations=1``: ratio 1, no clipping); ``batch.ref_logps`` is needed when
    ``beta != 0``. Jit it with the state's rules (``mesh.sjit``) to run on a mesh; the
    layout's tensor parallelism applies, its explicit FSDP mode does not (XLA's is used).

    Returns:
      ``(state, metrics)``: ``loss``, ``grad_norm``, ``clip_ratio`` (and its ``/low_mean``,
      ``/high_mean``), and ``kl`` when ``beta != 0``.

    Example::

        step = mesh.sjit(partial(grpo_step, graphdef=graphdef, tx=tx),
                         in_shardings=(rules, None), out_shardings=(rules, None))
        state, metrics = step(state, batch)
    """
    def objective(params):
        logps = completion_logps(params, state.rest, batch.tokens, batch.segment_ids,
                                 batch.mask, graphdef=graphdef, layout=layout, policy=policy)
        return objectives.grpo_loss(logps, batch.old_logps, batch.ref_logps, batch.advantages,
                                    batch.mask, epsilon=epsilon, epsilon_high=epsilon_high,
                                    beta=beta)

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    new_state, applied = apply_gradients(state, loss, grads, tx=tx)
    return new_state, {**applied, **metrics}


def reference_params(params: Any, lora: bool) -> Any:
    """The reference policy's trainable parameters, for ``beta > 0``: under LoRA the adapters
    zeroed (the model is then its frozen base: no copy of the base weights), else a copy of
    ``params`` (the initial policy, frozen; it survives the train step's donation). Both
    keep ``params``' sharding.

    >>> reference_params({"lora_b": jnp.ones(2)}, lora=True)["lora_b"].tolist()
    [0.0, 0.0]
    """
    return jax.tree.map((lambda x: x * 0) if lora else jnp.copy, params)


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of GRPO step ``step``: a function of ``(seed, step)`` only.

    >>> rollout_seed(0, 3) == rollout_seed(0, 3) != rollout_seed(0, 4)
    True
    """
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)


def step_prompts(n: int, per_step: int, seed: int, step: int) -> list[int]:
    """The indices of the ``per_step`` prompts (of ``n``) of step ``step``: epochs of seeded
    permutations read in order, a function of ``(seed, step)`` only.

    >>> sorted(step_prompts(4, 2, 0, 0) + step_prompts(4, 2, 0, 1))
    [0, 1, 2, 3]
    """
    picked = []
    for j in range(step * per_step, (step + 1) * per_step):
        order = np.random.default_rng([seed, j // n]).permutation(n)
        picked.append(int(order[j % n]))
    return picked


def rollout_arrays(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                 max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, segment_ids, mask)`` of `Rollouts` (numpy) for prompts and their
    completions (token ids; a row per completion), completions padded to ``max_new_tokens``.

    >>> tokens, segment_ids, mask = rollout_arrays([[5], [6, 7]], [[1, 0], [2]], 3)
    >>> tokens.tolist(), segment_ids.tolist()
    ([[0, 5, 1, 0, 0], [6, 7, 2, 0, 0]], [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    >>> mask.tolist()
    [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    """
    width = max(map(len, prompts))
    b = len(prompts)
    tokens = np.zeros((b, width + max_new_tokens), np.int32)
    segments = np.zeros_like(tokens)
    mask = np.zeros((b, max_new_tokens), np.float32)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        tokens[r, width - len(p):width] = p
        tokens[r, width:width + len(c)] = c
        segments[r, width - len(p):] = 1
        mask[r, :len(c)] = 1
    return tokens, segments, mask


def rollout(graphdef: Any, state: TrainState, prompts: Sequence[Sequence[int]],
            settings: GRPOConfig, step: int, *, stop_ids: Sequence[int] = (),
            mesh: Any = None, rules: Any = None, logps: Callable | None = None,
            ref_params: Any = None, attention: str = "auto") -> Rollout:
    """``settings.group_size`` completions of each prompt (token ids, any lengths) sampled
    from the policy in ``state`` with the KV-cache decoder (on ``mesh`` under ``rules`` when
    given), with the key `rollout_seed` ``(settings.seed, step)``; rows are the prompts'
    groups in order (``group_size`` consecutive rows per prompt, as TRL's). A completion ends
    at the first of ``stop_ids`` (kept, and in the mask) or after ``max_new_tokens``; the
    longest prompt plus ``max_new_tokens`` must fit the model's ``max_seq_len``.

    ``logps``: `completion_logps` jitted for the mesh (called as ``logps(params, rest,
    tokens, segment_ids, mask)``; default: ``jax.jit`` of it); it gives ``old_logps`` when
    ``num_iterations > 1`` and ``ref_logps`` (under ``ref_params``, `reference_params`) when
    ``beta != 0``.

    Example::

        out = rollout(graphdef, state, [tok.encode("2+2=")], GRPOConfig(group_size=4), step=0)
        out.completions   # 4 lists of new token ids
    """
    rows = [list(p) for p in prompts for _ in range(settings.group_size)]
    model = nnx.merge(graphdef, state.params, state.rest)
    longest, limit = max(map(len, rows)), model.config.max_seq_len
    if longest + settings.max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest} tokens and max_new_tokens="
                         f"{settings.max_new_tokens} exceed the model's max_seq_len {limit}")
    out = decode.generate(model, rows, settings.max_new_tokens,
                          temperature=settings.temperature, top_k=settings.top_k,
                          top_p=settings.top_p, seed=rollout_seed(settings.seed, step),
                          stop_ids=stop_ids, mesh=mesh, rules=rules, attention=attention)
    arrays = rollout_arrays(rows, out.tokens, settings.max_new_tokens)
    logps = logps or jax.jit(partial(completion_logps, graphdef=graphdef))
    old = ref = None
    if settings.num_iterations > 1:
        old = logps(state.params, state.rest, *arrays)
    if settings.beta != 0.0:
        if ref_params is None:
            raise ValueError("rollout: beta != 0 needs ref_params (reference_params)")
        ref = logps(ref_params, state.rest, *arrays)
    batch = Rollouts(*arrays, np.zeros(len(rows), np.float32), old, ref)
    return Rollout(batch, out.tokens, out.stopped, out.tokens_per_s)


def score(rollout: Rollout, records: Sequence[Mapping], reward_set: RewardSet,
          tokenizer: Tokenizer, settings: GRPOConfig) -> tuple[np.ndarray, dict[str, float]]:
    """``(advantages, metrics)`` of a rollout of the prompts of ``records`` (each a mapping
    with the prompt text under ``"prompt"`` and any other columns, passed to the reward
    functions as TRL passes a dataset's). Completions are decoded without their stop token;
    the rewards of ``reward_set`` (a `RewardError`, one line, for a function that raises or
    returns something else than one number per completion) are summed and normalised per
    group (`shardax.train.post.objectives.group_advantages`). ``metrics`` are TRL's: ``reward``,
    ``reward_std``, ``rewards/<function>/mean`` and ``/std``, ``completion_length``.

    Example::

        advantages, metrics = score(out, [{"prompt": "2+2="}], RewardSet([fn]), tok, settings)
    """
    g = settings.group_size
    texts = [tokenizer.decode(c[:-1] if stopped else c)
             for c, stopped in zip(rollout.completions, rollout.stopped)]
    prompts = [r["prompt"] for r in records for _ in range(g)]
    total, per_function = reward_set(prompts, texts, [r for r in records for _ in range(g)])
    advantages = objectives.group_advantages(jnp.asarray(total), g, settings.scale_rewards)
    metrics = reward_metrics(total, per_function, g)
    metrics["completion_length"] = float(np.mean([len(c) for c in rollout.completions]))
    return np.asarray(advantages), metrics


def _jit(fn: Callable, mesh: Any, in_shardings: Any, out_shardings: Any, **kw) -> Callable:
    if mesh is None:
        return jax.jit(fn, **kw)
    return mesh.sjit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **kw)


def train_grpo(graphdef: Any, state: TrainState, tokenizer: Tokenizer,
               prompts: Sequence[str | Mapping], reward_set: RewardSet, *,
               tx: optax.GradientTransformation, steps: int,
               settings: GRPOConfig | None = None, mesh: Any = None, rules: Any = None,
               layout: Layout = ONE_DEVICE, policy: Policy = FULL_PRECISION, lora: bool = False,
               ref_params: Any = None,
               on_step: Callable[[int, TrainState, dict], None] | None = None
               ) -> tuple[TrainState, list[dict]]:
    """``steps`` GRPO steps from ``state`` (a `TrainState` of the model ``graphdef``, sharded
    on ``mesh`` by ``rules`` when given; ``lora``: its parameters are LoRA adapters).
    With ``beta != 0`` the reference is ``ref_params``, by default `reference_params` of
    ``state``: a run that resumes a full fine-tune (``state.step > 0``) must pass those of
    its initial parameters.

    Each step takes `step_prompts` of ``prompts`` (strings, or records with ``"prompt"`` and
    other columns for the reward functions), encodes them with ``tokenizer``, samples
    (`rollout`, stopping at the tokenizer's eos), scores (`score`) and takes
    ``settings.num_iterations`` optimizer steps (`grpo_step`). The GRPO step index is
    ``state.step // num_iterations``, so a restored state resumes where it stopped.
    ``on_step(step, state, metrics)`` runs after each step (logging, checkpoints).

    Returns:
      ``(state, history)``: the final state and one dict per step: ``step``, TRL's ``reward``,
      ``reward_std``, ``rewards/<fn>/mean`` and ``/std``, ``completion_length``, ``loss``,
      ``kl`` (``beta != 0``), ``clip_ratio``, ``grad_norm`` (means over the iterations), and
      ``tokens_per_s/generation`` and ``tokens_per_s/train``.

    Example::

        state, history = train_grpo(graphdef, state, tok, prompts, RewardSet([fn]),
                                    tx=optax.adam(1e-3), steps=50, mesh=mesh, rules=rules)
    """
    records = [{"prompt": p} if isinstance(p, str) else dict(p) for p in prompts]
    if not records:
        raise ValueError("train_grpo: no prompts")
    for i, r in enumerate(records):
        if not isinstance(r.get("prompt"), str):
            raise ValueError(f"train_grpo: prompt record {i} has no 'prompt' string")
    s = settings or GRPOConfig()
    logps = _jit(partial(completion_logps, graphdef=graphdef, layout=layout, policy=policy),
                 mesh, (rules, rules, None, None, None), None)
    update = _jit(partial(grpo_step, graphdef=graphdef, tx=tx, layout=layout, policy=policy,
                          epsilon=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta),
                  mesh, (rules, None), (rules, None), donate_argnums=0)
    ref = None
    if s.beta != 0.0:
        if ref_params is None and int(state.step) > 0 and not lora:
            raise ValueError("train_grpo: resuming a full fine-tune with beta != 0 needs "
                             "ref_params, the initial parameters (reference_params)")
        ref = reference_params(state.params, lora) if ref_params is None else ref_params
    stop_ids = [tokenizer.eos_id]
    first = int(state.step) // s.num_iterations
    history = []
    for step in range(first, first + steps):
        picked = [records[i] for i in step_prompts(len(records), s.prompts_per_step, s.seed,
                                                   step)]
        ids = [tokenizer.encode(r["prompt"]) for r in picked]
        out = rollout(graphdef, state, ids, s, step, stop_ids=stop_ids, mesh=mesh,
                      rules=rules, logps=logps, ref_params=ref, attention=layout.attention)
        advantages, metrics = score(out, picked, reward_set, tokenizer, s)
        batch = out.batch._replace(advantages=advantages)
        start = time.perf_counter()
        updates = []
        for _ in range(s.num_iterations):
            state, m = update(state, batch)
            updates.append(m)
        updates = jax.device_get(updates)
        seconds = time.perf_counter() - start
        for name in updates[0]:
            metrics[name] = float(np.mean([m[name] for m in updates]))
        metrics["tokens_per_s/generation"] = out.tokens_per_s
        metrics["tokens_per_s/train"] = batch.tokens.size * s.num_iterations / seconds
        metrics = {"step": step, **metrics}
        history.append(metrics)
        if on_step is not None:
            on_step(step, state, metrics)
    return state, history
