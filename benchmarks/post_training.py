"""Post-training and evaluation against the paths they reuse: GRPO rollouts against generation,
the GRPO and DPO steps against the SFT step, evaluation against training.

    python benchmarks/post_training.py [--rounds 5] [--quick] [--json out.json]

One process, one model (llama-tiny's byte vocabulary widened to dim 256, 4 layers, 8/4 heads,
MLP 704, float32), the CLI's resolved run on fsdp=8 (8 emulated CPU devices: mesh, rules,
layout, AdamW), compile excluded (warm-up calls), medians of interleaved rounds:

1. GRPO rollout (`shardax.train.post.grpo.rollout`, on the mesh under the run's rules, as
   ``train --objective grpo`` samples) against `shardax.models.decode.generate` with the same
   rows, mesh, rules, prompt length, new tokens and temperature 1.0 (no stop token, so every
   row samples every token): tokens/s. Same decoder, so goal ≥ 0.9. Control row: the
   ``generate`` command's own placement (parameters replicated, no mesh: no all-gathers, but
   every emulated device decodes the whole batch), a different program, so not a goal.
2. The GRPO update (`grpo_step`, TRL's defaults: β = 0, one iteration) against the SFT step
   (`shardax.train.build.step_function`) on the same B rows of P + C tokens: both are one
   forward + backward, so ≈ 1. With β > 0 or ``num_iterations`` > 1 each rollout batch also
   pays a forward for the reference / old log-probabilities (`completion_logps`, ≈ 1/3 of a
   step, measured too): a rollout batch costs it·step + [it > 1]·fwd + [β > 0]·fwd.
3. The DPO step (`shardax.train.post.preference_step`) on 2B rows of T tokens (B pairs) against
   the SFT step on B rows of 2T: the same tokens, one forward + backward: ≈ 1.
4. Evaluation (the perplexity path of `shardax.train.evaluate`: its jitted summed-NLL
   forward) against the SFT step on the same rows: forward only is ≈ 1/3 of a step's FLOPs,
   so tokens/s ≥ 2.5x. It runs under the rules' ``sjit`` as training does (its activation
   constraints active). Control row: the same forward under a plain ``jax.jit``, the
   activations' layout left to the partitioner (what ``shardax eval`` ran before).
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

from _common import (
    emit,
    goal_row,
    interleaved,
    jax,
    machine,
    median,
    models,
    nnx,
    np,
    paired_ratio,
)

from shardax.models import decode
from shardax.train import build, evaluate
from shardax.train.config import TrainConfig, check
from shardax.train.post import grpo, preference_step
from shardax.train.resolve import resolve

SHAPE = dict(dim=256, n_heads=8, n_kv_heads=4, mlp_dim=704, n_layers=4, max_seq_len=256)
MESH = "fsdp=8"
# (rows B, group size G, prompt P, new tokens C): P + C odd, so the SFT rows (P + C - 1
# tokens) split into DPO's halves.
SIZES = {"full": (16, 4, 33, 96), "quick": (8, 4, 17, 48)}


def _run(batch: int, seq: int):
    run = resolve(check(TrainConfig(model="llama-tiny", mesh=MESH, batch_size=batch,
                                    seq_len=seq, pack="concat", optimizer="adamw")))
    return dataclasses.replace(run, model_config=models.get_config("llama-tiny", **SHAPE))


def _fresh(run):
    """A fresh sharded train state (each timed step donates its own)."""
    return run.mesh.sjit(lambda: build.create(run.model_config, run.tx, 0)[1],
                         out_shardings=run.state_rules)()


def measure(rounds: int, quick: bool) -> dict:
    b, g, p, c = SIZES["quick" if quick else "full"]
    width = p + c - 1  # the SFT rows: the forward positions of a rollout row
    run = _run(b, width)
    mesh, rules = run.mesh, run.rules
    graphdef = build.abstract(run.model_config, run.tx, 0, mesh)[0]
    vocab = run.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, vocab, (b // g, p)).tolist()
    settings = grpo.GRPOConfig(group_size=g, prompts_per_step=b // g, max_new_tokens=c,
                               temperature=1.0)
    logps = mesh.sjit(partial(grpo.completion_logps, graphdef=graphdef, layout=run.layout,
                              policy=run.policy),
                      in_shardings=(rules, rules, None, None, None), out_shardings=None)
    state = _fresh(run)
    model = nnx.merge(graphdef, state.params, state.rest)
    replicated = jax.device_put(model, jax.sharding.NamedSharding(
        mesh.mesh, jax.sharding.PartitionSpec()))
    rows = [q for q in prompts for _ in range(g)]
    sample = dict(temperature=1.0, attention=run.layout.attention)
    inside: dict[str, list[float]] = {"rollout": [], "generate": [], "generate_command": []}

    def kept(name, out, tokens):
        inside[name].append(out.tokens_per_s)  # the decoder's own clock, inside the call
        return tokens

    def roll():
        out = grpo.rollout(graphdef, state, prompts, settings, 0, mesh=mesh, rules=rules,
                           logps=logps, attention=run.layout.attention)
        return kept("rollout", out, out.batch.tokens)

    def gen(name, m, **placement):
        out = decode.generate(m, rows, c, **placement, **sample)
        return kept(name, out, out.tokens)

    decoders = {"rollout": roll,
                "generate": lambda: gen("generate", model, mesh=mesh, rules=rules),
                "generate_command": lambda: gen("generate_command", replicated)}
    decoding = interleaved(decoders, rounds, warmup=1)

    # The rollout's arrays are what GRPO trains on; the SFT and eval rows are the same tokens.
    out = grpo.rollout(graphdef, state, prompts, settings, 0, mesh=mesh, rules=rules,
                       logps=logps, attention=run.layout.attention)
    batch = out.batch._replace(advantages=rng.standard_normal(b).astype(np.float32))
    tokens = np.asarray(batch.tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    halves = lambda x: x.reshape(2 * b, width // 2)  # noqa: E731  (B rows of 2T -> 2B of T)
    mask = np.zeros((2 * b, width // 2), np.float32)
    mask[:, width // 4:] = 1.0  # the completion: the second half of each row
    pairs = (halves(inputs), halves(targets), mask,
             rng.standard_normal(2 * b).astype(np.float32) - 40.0)
    dpo_run = dataclasses.replace(run, config=dataclasses.replace(run.config, objective="dpo",
                                                                  beta=0.1))
    steps = {
        "sft": (build.step_function(run, graphdef, end_id=None), (inputs, targets)),
        "grpo": (mesh.sjit(partial(grpo.grpo_step, graphdef=graphdef, tx=run.tx,
                                   layout=run.layout, policy=run.policy),
                           in_shardings=(rules, None), out_shardings=(rules, None),
                           donate_argnums=0), batch),
        "dpo": (preference_step.step_function(dpo_run, graphdef), pairs),
    }
    states = {name: _fresh(run) for name in steps}

    def stepper(name):
        fn, data = steps[name]

        def call():
            states[name], metrics = fn(states[name], data)
            return metrics
        return call

    batch_sharding = jax.sharding.NamedSharding(mesh.mesh,
                                                rules.spec_for(("batch", "length"), mesh.mesh))
    eval_graphdef, eval_state = nnx.split(model)
    nll_jit = jax.jit(partial(evaluate._nll, eval_graphdef, run.layout))
    windows = jax.device_put(tokens, batch_sharding)
    window_mask = jax.device_put(np.ones((b, width), np.float32), batch_sharding)
    fns = {name: stepper(name) for name in steps}
    fns["logps"] = lambda: logps(state.params, state.rest, batch.tokens, batch.segment_ids,
                                 batch.mask)
    # as `shardax eval` runs it: under the run's sjit (its activation constraints active)
    spec = rules.spec_for(("batch", "length"), mesh.mesh)
    nll_sjit = mesh.sjit(partial(evaluate._nll, eval_graphdef, run.layout),
                         in_shardings=(rules, spec, spec), out_shardings=None)
    fns["eval"] = lambda: nll_sjit(eval_state, windows, window_mask)
    fns["eval_jit"] = lambda: nll_jit(eval_state, windows, window_mask)  # control
    timing = interleaved(fns, rounds)

    decoded = b * c
    per_s = lambda n, xs: n / median(xs)  # noqa: E731
    return {
        "model": f"llama dim {SHAPE['dim']}, {SHAPE['n_layers']} layers, {SHAPE['n_heads']}/"
                 f"{SHAPE['n_kv_heads']} heads, vocab {vocab}",
        "mesh": MESH, "rounds": rounds, "quick": quick,
        "rows": b, "group_size": g, "prompt": p, "new_tokens": c, "seq": width,
        "decode_tokens_per_s": {k: per_s(decoded, v) for k, v in decoding.items()},
        # the warm-up call (compile) first
        "decoder_tokens_per_s": {k: median(v[1:]) for k, v in inside.items()},
        "rollout_vs_generate": paired_ratio(decoding["generate"], decoding["rollout"]),
        "rollout_vs_command": paired_ratio(decoding["generate_command"], decoding["rollout"]),
        "step_s": {k: median(v) for k, v in timing.items()},
        "grpo_vs_sft": paired_ratio(timing["grpo"], timing["sft"]),
        "logps_vs_sft": paired_ratio(timing["logps"], timing["sft"]),
        "dpo_vs_sft": paired_ratio(timing["dpo"], timing["sft"]),
        "eval_vs_train": paired_ratio(timing["sft"], timing["eval"]),
        "train_tokens_per_s": per_s(b * width, timing["sft"]),
        "eval_tokens_per_s": per_s(b * width, timing["eval"]),
        "eval_jit_vs_train": paired_ratio(timing["sft"], timing["eval_jit"]),
    }


def render(r: dict) -> str:
    ms = {k: f"{v * 1e3:.1f}" for k, v in r["step_s"].items()}
    d, i = r["decode_tokens_per_s"], r["decoder_tokens_per_s"]
    quick = " **Quick mode** (tiny sizes, few rounds): a smoke run, not the numbers." \
        if r.get("quick") else ""
    b, t = r["rows"], r["seq"]
    return "\n".join([
        "## 15. Post-training and evaluation against the paths they reuse",
        "",
        f"{r['model']}, float32, AdamW, mesh {r['mesh']} (the CLI's resolved run); {b} rows "
        f"= {b // r['group_size']} prompts x {r['group_size']} completions, prompt "
        f"{r['prompt']}, {r['new_tokens']} new tokens at temperature 1.0; training rows of "
        f"{t} tokens; compile excluded; medians of {r['rounds']} interleaved rounds; ratios "
        f"are medians of per-round ratios.{quick}",
        "",
        "| measured | value | formula | goal |",
        "|---|---|---|---|",
        f"| GRPO rollout tokens/s | {d['rollout']:.0f} | the decoder's | — |",
        f"| `decode.generate` tokens/s, same rows, mesh and rules | {d['generate']:.0f} | — |"
        " — |",
        f"| rollout / generate | {r['rollout_vs_generate']:.3f} | 1 (same decoder) | ≥ 0.9 |",
        f"| control: `generate` command's placement (replicated, no mesh) tokens/s | "
        f"{d['generate_command']:.0f} (rollout / it {r['rollout_vs_command']:.2f}) | no "
        "all-gathers; every emulated device decodes the whole batch | — |",
        f"| control: the decoder's own tokens/s inside each call (prefill + decode) | "
        f"rollout {i['rollout']:.0f}, generate {i['generate']:.0f} | equal: a gap above is "
        "host work outside the decoder, or noise | — |",
        f"| SFT step ms ({b} x {t}) | {ms['sft']} | fwd + bwd | — |",
        f"| GRPO step (β = 0, 1 iteration) / SFT step | {r['grpo_vs_sft']:.3f} | 1 (fwd + bwd "
        "over the same rows) | ≤ 1.2 |",
        f"| GRPO old / reference log-probs forward / SFT step | {r['logps_vs_sft']:.3f} | "
        "≈ 1/3: a rollout batch costs it·step + [it > 1]·fwd + [β > 0]·fwd | ≤ 0.5 |",
        f"| DPO step ({2 * b} x {t // 2}) / SFT step ({b} x {t}) | {r['dpo_vs_sft']:.3f} | "
        "≈ 1 (same tokens, fwd + bwd) | ≤ 1.2 |",
        f"| evaluation tokens/s / training tokens/s | {r['eval_vs_train']:.2f} "
        f"({r['eval_tokens_per_s']:.0f} / {r['train_tokens_per_s']:.0f}) | ≈ 3 (fwd ≈ 1/3 of "
        "fwd + bwd) | ≥ 2.5 |",
        f"| control: the same forward under a plain `jax.jit` (activations' layout left to "
        f"the partitioner) / training tokens/s | {r['eval_jit_vs_train']:.2f} | — | — |",
        "",
    ])


def summary(r: dict) -> list[dict]:
    s = "15 post-training"
    return [
        goal_row(s, "GRPO rollout / generate tokens/s", r["rollout_vs_generate"], "≥ 0.9",
                 r["rollout_vs_generate"] >= 0.9),
        goal_row(s, "GRPO step / SFT step", r["grpo_vs_sft"], "≤ 1.2", r["grpo_vs_sft"] <= 1.2),
        goal_row(s, "GRPO log-probs forward / SFT step", r["logps_vs_sft"], "≤ 0.5",
                 r["logps_vs_sft"] <= 0.5),
        goal_row(s, "DPO step / SFT step (same tokens)", r["dpo_vs_sft"], "≤ 1.2",
                 r["dpo_vs_sft"] <= 1.2),
        goal_row(s, "evaluation / training tokens/s", r["eval_vs_train"], "≥ 2.5",
                 r["eval_vs_train"] >= 2.5),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 2 rounds: checks that the section runs")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = measure(2 if args.quick else args.rounds, args.quick)
    result["machine"] = machine()
    print(render(result))
    emit(result, args.json)


if __name__ == "__main__":
    main()
