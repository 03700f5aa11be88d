"""Mixture of experts: the dropless MoE (sorted tokens, grouped matmuls) against the
capacity-based one, in step time, temporaries and tokens dropped.

    python benchmarks/moe.py --json out.json

Model: 2 layers, dim 256, 8 experts of 512 hidden units, top-2, vocabulary 4096, batch 4 x
seq 512 (2,048 tokens), float32, one CPU device; forward + backward of ``training_loss``
(median of interleaved rounds) and ``memory_analysis().temp_size_in_bytes`` of that program.
The capacity-based MoE (capacity factor 1.25) drops the tokens over an expert's capacity;
the dropless one drops none. Goal: dropless no slower than 1.5x the capacity-based step and
no more than 1.5x its temporaries.
"""

from __future__ import annotations

import argparse
import functools

from _common import emit, goal_row, interleaved, jax, jnp, machine, median, models, nnx, np

from shardax.parallel import moe_mlp

IMPLS = ("capacity", "dropless")
SHAPE = dict(vocab_size=4096, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=512,
             n_experts=8, top_k=2, max_seq_len=512)
BATCH, SEQ = 4, 512


def _program(impl: str):
    cfg = models.LlamaConfig(**SHAPE, moe_impl=impl)
    graphdef, params = nnx.split(models.create(cfg, nnx.Rngs(0)), nnx.Param)

    def loss(p, t):
        return nnx.merge(graphdef, p).training_loss(t[:, :-1], t[:, 1:])[0]

    return jax.jit(jax.grad(loss)), params


def dropped_fraction(tokens: jax.Array) -> float:
    """The capacity MoE's dropped fraction in layer 0 of the benchmark model."""
    cfg = models.LlamaConfig(**SHAPE, moe_impl="capacity")
    model = models.create(cfg, nnx.Rngs(0))
    x = model.embed_inputs(tokens[:, :-1])[0]
    moe = model.layers[0].mlp
    _, aux = moe_mlp(x, moe.router[...], moe.w_up[...], moe.w_down[...], moe.w_gate[...],
                     top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                     num_groups=x.shape[0], activation=jax.nn.silu)
    return float(aux["dropped_fraction"])


def measure(rounds: int) -> dict:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, SHAPE["vocab_size"],
                                                           (BATCH, SEQ + 1)), jnp.int32)
    fns, temp = {}, {}
    for impl in IMPLS:
        fn, params = _program(impl)
        temp[impl] = fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        fns[impl] = functools.partial(fn, params, tokens)
    samples = interleaved(fns, rounds=rounds, warmup=1)
    return {"step_s": {impl: median(s) for impl, s in samples.items()}, "temp_bytes": temp,
            "dropped_fraction": dropped_fraction(tokens)}


def render(r: dict) -> str:
    rows = [f"| {impl} | {r['step_s'][impl] * 1e3:.0f} | {r['temp_bytes'][impl] / 2**20:.1f} |"
            f" {r['dropped_fraction'] if impl == 'capacity' else 0:.1%} |" for impl in IMPLS]
    return "\n".join([
        "## 12. Mixture of experts: dropless against capacity-based",
        "",
        f"2 layers, dim {SHAPE['dim']}, {SHAPE['n_experts']} experts x {SHAPE['mlp_dim']} "
        f"hidden, top-{SHAPE['top_k']}, batch {BATCH} x seq {SEQ}, float32, one CPU device; "
        "forward + backward.",
        "",
        "| MoE | step ms | temporaries MiB | tokens dropped (layer 0) |",
        "|---|---|---|---|",
        *rows,
        "",
    ])


def summary(r: dict) -> list[dict]:
    t = r["step_s"]["dropless"] / r["step_s"]["capacity"]
    m = r["temp_bytes"]["dropless"] / max(r["temp_bytes"]["capacity"], 1)
    return [goal_row("12 moe", "dropless / capacity step time", t, "≤ 1.5", t <= 1.5),
            goal_row("12 moe", "dropless / capacity temporaries", m, "≤ 1.5", m <= 1.5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = measure(args.rounds)
    result["machine"] = machine()
    print(render(result))
    emit(result, args.json)


if __name__ == "__main__":
    main()
