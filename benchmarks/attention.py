"""Attention: temporaries against sequence length, and step time of each implementation.

    python benchmarks/attention.py --json out.json

Memory: llama-small (8 layers, batch 1), forward + backward of ``training_loss`` (chunked
loss included), compiled on one CPU device; ``memory_analysis().temp_size_in_bytes`` at seq
1024 and 8192 for each attention implementation. Goal: the default ('auto') grows at most
10x for 8x the sequence (linear is 8x; the einsum's [s, s] scores grow 64x).
Time: the same forward + backward, llama-small shapes with 2 layers, at seq 1024 and 2048,
each implementation relative to 'einsum' (median of interleaved rounds).
"""

from __future__ import annotations

import argparse
import functools

from _common import emit, goal_row, interleaved, jax, jnp, machine, median, models, nnx, np

IMPLS = ("einsum", "xla", "blockwise", "auto")
MEMORY_SEQS = (1024, 8192)
TIME_SEQS = (1024, 2048)


def _loss_grad(cfg, seq):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0))),
                                 nnx.Param)

    def loss(p, t):
        return nnx.merge(graphdef, p).training_loss(t[:, :-1], t[:, 1:])[0]

    return jax.jit(jax.grad(loss)), params, jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)


def temp_bytes(impl: str, seq: int, n_layers: int = 8) -> int:
    cfg = models.get_config("llama-small", max_seq_len=seq, attention=impl, n_layers=n_layers)
    fn, params, tokens = _loss_grad(cfg, seq)
    return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def step_times(seq: int, rounds: int) -> dict[str, float]:
    """Seconds per forward + backward of each implementation (2-layer llama-small)."""
    fns = {}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32000, (1, seq + 1)), jnp.int32)
    for impl in IMPLS:
        cfg = models.get_config("llama-small", max_seq_len=seq, attention=impl, n_layers=2)
        graphdef, params = nnx.split(models.create(cfg, nnx.Rngs(0)), nnx.Param)

        def loss(p, t, g=graphdef):
            return nnx.merge(g, p).training_loss(t[:, :-1], t[:, 1:])[0]

        fn = jax.jit(jax.grad(loss))
        fns[impl] = functools.partial(fn, params, tokens)
    samples = interleaved(fns, rounds=rounds, warmup=1)
    return {impl: median(s) for impl, s in samples.items()}


def measure(rounds: int) -> dict:
    memory = {impl: {str(s): temp_bytes(impl, s) for s in MEMORY_SEQS} for impl in IMPLS}
    times = {str(s): step_times(s, rounds) for s in TIME_SEQS}
    from shardax.models.attention import BLOCKWISE_MIN_LEN

    return {"memory": memory, "times": times, "blockwise_min_len": BLOCKWISE_MIN_LEN,
            "device": jax.devices()[0].device_kind}


def _growth(r: dict, impl: str) -> float:
    m = r["memory"][impl]
    return m[str(MEMORY_SEQS[1])] / m[str(MEMORY_SEQS[0])]


def render(r: dict) -> str:
    lo, hi = MEMORY_SEQS
    mib = lambda b: f"{b / 2**20:,.0f}"
    mem_rows = [f"| {impl} | {mib(r['memory'][impl][str(lo)])} | {mib(r['memory'][impl][str(hi)])}"
                f" | {_growth(r, impl):.1f} |" for impl in IMPLS]
    t = {s: r["times"][str(s)] for s in TIME_SEQS}
    time_rows = [f"| {impl} | " + " | ".join(
        f"{t[s][impl]:.2f} s ({t[s][impl] / t[s]['einsum']:.2f})" for s in TIME_SEQS) + " |"
        for impl in IMPLS]
    return "\n".join([
        "## 11. Attention: temporaries against sequence length, step time per implementation",
        "",
        "`benchmarks/attention.py`: llama-small (batch 1) forward + backward of "
        "`training_loss` (chunked cross-entropy), compiled on one CPU device; temporaries from "
        f"`memory_analysis()`. 'auto' is xla below {r['blockwise_min_len']} keys, blockwise "
        "from there (cudnn on NVIDIA GPUs). Goal: 'auto' grows at most 10x from seq "
        f"{lo} to {hi} (linear is 8x).",
        "",
        f"| attention | temp MiB at {lo} | temp MiB at {hi} | growth |",
        "|---|---|---|---|",
        *mem_rows,
        "",
        "Step time (2 layers, batch 1; in brackets: relative to einsum):",
        "",
        "| attention | " + " | ".join(f"seq {s}" for s in TIME_SEQS) + " |",
        "|---|" + "---|" * len(TIME_SEQS),
        *time_rows,
        "",
    ])


def summary(r: dict) -> list[dict]:
    g = _growth(r, "auto")
    return [goal_row("11 attention", f"temp growth seq {MEMORY_SEQS[0]} -> {MEMORY_SEQS[1]}, "
                     "default attention", g, "≤ 10", g <= 10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result = measure(args.rounds)
    result["machine"] = machine()
    print(render(result))
    emit(result, args.json)


if __name__ == "__main__":
    main()
