"""Runs TRL's own loss code on fixed log-probabilities; saves inputs and outputs to fixtures/trl.

Run in the reference environment (torch, transformers and trl; never installed by `make test`):

    /work/hfref/bin/pip install trl torch==2.13.0
    /work/hfref/bin/python tests/reference/make_trl_fixtures.py

TRL's losses are instance methods of trainers that want a model, a dataset and an accelerator;
each is called here *unbound* with a ``SimpleNamespace`` as ``self`` holding only the attributes
the method reads, and a stand-in "model" that returns the fixed per-token log-probabilities
(what TRL's fused LM head would return). So these are TRL's lines, not a transcription:

- ``DPOTrainer._compute_loss`` (``loss_type`` ``sigmoid`` and ``ipo``; reference log-probs
  precomputed). TRL >= 1.0 no longer applies ``label_smoothing`` to ``sigmoid`` (it belongs to
  ``robust`` and ``exo_pair`` there); the conservative-DPO formula ``-(1-ε)logσ(βh) - ε logσ(-βh)``
  lives on in ``CPOTrainer.cpo_loss(loss_type="sigmoid")``, called on the log-ratios ``π - ref``.
- ``CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` (``cpo_alpha=0``: no NLL term) on
  per-token average log-probabilities.
- ``ORPOTrainer.odds_ratio_loss`` on per-token average log-probabilities, and the training loss
  ``nll - mean(...)`` of ``get_batch_loss_metrics``.
- ``GRPOTrainer._compute_loss`` (``loss_type="dapo"``, token-level ratios, k3 KL) on fixed
  per-token logps / old logps / ref logps / masks / advantages; the group advantages are the
  ``sum_then_normalize`` block of ``GRPOTrainer._generate_and_score_completions``, cut out of
  TRL's installed source by ``inspect`` and executed as it is (the rest of that method
  generates and scores completions).

Everything runs in float32. Writes ``tests/fixtures/trl/trl_losses.npz`` (inputs and per-example
outputs) and ``meta.json`` (TRL/torch versions, the call behind each case, its hyper-parameters,
TRL's batch loss and the metrics TRL logs).
"""

from __future__ import annotations

import inspect
import json
import textwrap
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import trl
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer
from trl.trainer import grpo_trainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "trl"
B, T = 6, 9          # preference pairs, sequence length (prompt + completion)
CPU = torch.device("cpu")


class _Accelerator:
    """The single-process accelerator TRL's loss code talks to: gathers are identities."""

    device = CPU
    num_processes = 1
    process_index = 0
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _metrics():
    return {"train": defaultdict(list), "eval": defaultdict(list)}


def _preference_inputs(rng):
    """Fixed per-token logps of B chosen and B rejected completions after a 3-token prompt."""
    lengths = rng.integers(2, T - 3, size=2 * B)                  # completion tokens per row
    completion_mask = np.zeros((2 * B, T), np.int64)
    for i, n in enumerate(lengths):
        completion_mask[i, 3:3 + n] = 1
    shift_mask = completion_mask[:, 1:].astype(np.float32)
    token_logps = rng.uniform(-4.0, -0.05, size=(2 * B, T - 1)).astype(np.float32) * shift_mask
    ref_token_logps = (token_logps + rng.normal(0, 0.4, size=token_logps.shape)).clip(max=-0.01)
    ref_token_logps = ref_token_logps.astype(np.float32) * shift_mask
    # pair 0 ties exactly (policy == reference): rewards 0, counted as not accurate
    token_logps[[0, B]] = ref_token_logps[[0, B]]
    return completion_mask, token_logps, ref_token_logps


def _dpo_self(loss_type, beta, precompute=True):
    return SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=precompute, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
        use_weighting=False, _metrics=_metrics(), _total_train_tokens=0, _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None))


def _fake_model(token_logps):
    """What TRL's model call returns with ``fused_lm_head=True``: per-token logps of the labels."""
    logps = torch.tensor(token_logps)

    def model(**_):
        return SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps),
                               mean_logits=torch.zeros_like(logps),
                               is_top1=torch.zeros_like(logps, dtype=torch.bool))
    return model


def run_dpo(completion_mask, token_logps, ref_token_logps, loss_type, beta):
    """TRL's DPO loss (batch mean), per-pair losses (one pair per call) and logged metrics."""
    ref = torch.tensor(ref_token_logps).sum(1)
    ref_chosen, ref_rejected = ref.chunk(2)

    def call(rows):
        self = _dpo_self(loss_type, beta)
        inputs = {"input_ids": torch.zeros(len(rows), T, dtype=torch.long),
                  "attention_mask": torch.ones(len(rows), T, dtype=torch.long),
                  "completion_mask": torch.tensor(completion_mask[rows]),
                  "ref_chosen_logps": ref_chosen[rows[: len(rows) // 2]],
                  "ref_rejected_logps": ref_rejected[rows[: len(rows) // 2]]}
        loss = DPOTrainer._compute_loss(self, _fake_model(token_logps[rows]), inputs, False)
        return float(loss), {k: v[0] for k, v in self._metrics["train"].items()}

    loss, metrics = call(list(range(2 * B)))
    per_pair = [call([i, B + i])[0] for i in range(B)]
    return loss, np.array(per_pair, np.float32), metrics


def run_cpo(chosen, rejected, loss_type, beta, label_smoothing, simpo_gamma=0.5):
    self = SimpleNamespace(alpha=0.0, accelerator=_Accelerator(), loss_type=loss_type, beta=beta,
                           label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
    losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(self, torch.tensor(chosen),
                                                       torch.tensor(rejected))
    return losses.numpy(), chosen_r.numpy(), rejected_r.numpy()


def run_orpo(chosen_avg, rejected_avg, nll, beta):
    self = SimpleNamespace(beta=beta, accelerator=_Accelerator())
    losses, chosen_r, rejected_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        self, torch.tensor(chosen_avg), torch.tensor(rejected_avg))
    loss = torch.tensor(nll).mean() - losses.mean()      # get_batch_loss_metrics' full loss
    return dict(losses=losses.numpy(), chosen_rewards=chosen_r.numpy(),
                rejected_rewards=rejected_r.numpy(), log_odds_ratio=float(ratio),
                log_odds_chosen=float(log_odds), loss=float(loss))


def run_group_advantages(rewards, num_generations, scale_rewards):
    """TRL's own advantage block, executed from its installed source."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    start = source.index('if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index("# Unscorable completions")
    block = textwrap.dedent(source[source.rindex("\n", 0, start) + 1:source.rindex("\n", 0, end)])
    rewards_per_func = torch.tensor(rewards)[:, None]
    scope = dict(vars(grpo_trainer), torch=torch, device=CPU, num_generations=num_generations,
                 rewards_per_func=rewards_per_func,
                 unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),
                 self=SimpleNamespace(multi_objective_aggregation="sum_then_normalize",
                                      reward_weights=torch.ones(1), reward_funcs=[None],
                                      scale_rewards=scale_rewards))
    exec(block, scope)  # noqa: S102 - TRL's installed source, nothing user-supplied
    return torch.nan_to_num(scope["advantages"], nan=0.0).numpy()


def run_grpo(logps, old, ref, adv, mask, beta, eps_low, eps_high, num_items):
    per_token = torch.tensor(logps)
    self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token, torch.zeros_like(per_token),
                                                            None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type="dapo", epsilon_low=eps_low,
        epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), accelerator=_Accelerator(),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, _metrics=_metrics(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
    inputs = {"prompt_ids": torch.zeros(len(logps), 2, dtype=torch.long),
              "prompt_mask": torch.ones(len(logps), 2, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
              "completion_mask": torch.tensor(mask), "advantages": torch.tensor(adv),
              "old_per_token_logps": torch.tensor(old), "ref_per_token_logps": torch.tensor(ref),
              "num_items_in_batch": torch.tensor(num_items)}
    loss = GRPOTrainer._compute_loss(self, None, inputs)
    return float(loss), {k: v[0] for k, v in self._metrics["train"].items()}


def main() -> None:
    rng = np.random.default_rng(36)
    arrays: dict[str, np.ndarray] = {}
    cases: dict[str, dict] = {}

    completion_mask, token_logps, ref_token_logps = _preference_inputs(rng)
    counts = completion_mask.sum(1).astype(np.float32)
    logps, ref_logps = token_logps.sum(1), ref_token_logps.sum(1)
    arrays.update(completion_mask=completion_mask, token_logps=token_logps,
                  ref_token_logps=ref_token_logps, policy_chosen=logps[:B],
                  policy_rejected=logps[B:], ref_chosen=ref_logps[:B], ref_rejected=ref_logps[B:],
                  chosen_counts=counts[:B], rejected_counts=counts[B:])

    for name, loss_type, beta in (("dpo_sigmoid", "sigmoid", 0.1), ("dpo_ipo", "ipo", 0.2)):
        loss, per_pair, metrics = run_dpo(completion_mask, token_logps, ref_token_logps,
                                          loss_type, beta)
        arrays[f"{name}/losses"] = per_pair
        cases[name] = dict(call="DPOTrainer._compute_loss", loss_type=loss_type, beta=beta,
                           loss=loss, metrics=metrics)

    # conservative DPO: TRL's label-smoothed sigmoid, on the DPO log-ratios
    h_c, h_r = logps[:B] - ref_logps[:B], logps[B:] - ref_logps[B:]
    for smoothing in (0.0, 0.1):
        name = f"cdpo_{smoothing}"
        losses, cr, rr = run_cpo(h_c, h_r, "sigmoid", 0.1, smoothing)
        arrays.update({f"{name}/losses": losses, f"{name}/chosen_rewards": cr,
                       f"{name}/rejected_rewards": rr})
        cases[name] = dict(call="CPOTrainer.cpo_loss", loss_type="sigmoid", beta=0.1,
                           label_smoothing=smoothing, inputs="policy - ref log-ratios")

    avg_c, avg_r = logps[:B] / counts[:B], logps[B:] / counts[B:]
    arrays.update(chosen_avg=avg_c, rejected_avg=avg_r)
    for name, beta, gamma, smoothing in (("simpo", 2.0, 0.5, 0.0), ("simpo_smooth", 2.5, 1.4, 0.1)):
        losses, cr, rr = run_cpo(avg_c, avg_r, "simpo", beta, smoothing, simpo_gamma=gamma)
        arrays.update({f"{name}/losses": losses, f"{name}/chosen_rewards": cr,
                       f"{name}/rejected_rewards": rr})
        cases[name] = dict(call="CPOTrainer.cpo_loss", loss_type="simpo", cpo_alpha=0.0,
                           beta=beta, simpo_gamma=gamma, label_smoothing=smoothing)

    nll = rng.uniform(0.3, 3.0, size=B).astype(np.float32)
    arrays["orpo/nll"] = nll
    out = run_orpo(avg_c, avg_r, nll, beta=0.1)
    for key in ("losses", "chosen_rewards", "rejected_rewards"):
        arrays[f"orpo/{key}"] = out.pop(key)
    cases["orpo"] = dict(call="ORPOTrainer.odds_ratio_loss", beta=0.1, **out)

    G = 4
    rewards = np.array([1, 0, 1, 0, 2, 2, 2, 2, 0, 0, 0, 3, 0.5, -1.0, 2.5, 0.25], np.float32)
    arrays["grpo/rewards"] = rewards
    for scale in ("group", "none"):
        arrays[f"grpo/advantages_{scale}"] = run_group_advantages(rewards, G, scale)
    n, length = len(rewards), 7
    glogps = rng.uniform(-3, -0.1, size=(n, length)).astype(np.float32)
    gold = (glogps + rng.normal(0, 0.3, size=glogps.shape)).astype(np.float32)
    gref = (glogps + rng.normal(0, 0.5, size=glogps.shape)).astype(np.float32)
    gmask = (np.arange(length)[None] < rng.integers(1, length + 1, size=n)[:, None])
    gmask = gmask.astype(np.float32)
    adv = arrays["grpo/advantages_group"]
    arrays.update({"grpo/logps": glogps, "grpo/old_logps": gold, "grpo/ref_logps": gref,
                   "grpo/mask": gmask})
    for name, beta, eps_high, num_items in (("grpo", 0.04, 0.2, float(gmask.sum())),
                                            ("grpo_dapo", 0.04, 0.28, 150.0),
                                            ("grpo_nokl", 0.0, 0.2, float(gmask.sum()))):
        loss, metrics = run_grpo(glogps, gold, gref, adv, gmask, beta, 0.2, eps_high, num_items)
        cases[name] = dict(call="GRPOTrainer._compute_loss", loss_type="dapo", beta=beta,
                           epsilon_low=0.2, epsilon_high=eps_high, num_items_in_batch=num_items,
                           loss=loss, metrics=metrics)

    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(OUT / "trl_losses.npz", **{k: np.asarray(v) for k, v in arrays.items()})
    meta = dict(trl=trl.__version__, torch=torch.__version__, preference_pairs=B,
                grpo_group_size=G, cases=cases)
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} with TRL {trl.__version__}")


if __name__ == "__main__":
    main()
