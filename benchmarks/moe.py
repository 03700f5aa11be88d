"""Mixture of experts: the dropless MoE (sorted tokens, grouped matmuls) against the
capacity-based one, in step time, temporaries and tokens dropped.

    python benchmarks/moe.py --json out.json

Model: 2 layers, dim 256, 8 experts of 512 hidden units, top-2, vocabulary 4096, batch 4 x
seq 512 (2,048 tokens), float32, one CPU device; forward + backward of ``training_loss``
(median of interleaved rounds) and ``memory_analysis().temp_size_in_bytes`` of that program.
The capacity-based MoE (capacity factor 1.25) drops the tokens over an expert's capacity;
the dropless one drops none. Goal: dropless no slower than 1.1x the capacity-based step and
no more than 1.1x its temporaries.

Expert parallelism: the dropless train step (SGD) of the same model on ``ep=8`` (8 emulated
devices, batch 8 x seq 256 of random tokens, the same 2,048 tokens a step, the model's
initial router), run on a real batch: the bytes per device its exchange moved (each
collective-permute's bytes per loop step, read from the optimized HLO, times the loop steps
that the count matrices of the batch's routing give; plus the count matrices' all-gathers)
against theory: the routed rows, ``tokens/ep x top-k x dim x 4 bytes``, sent and returned
(2 directions) in the forward and again in the backward (2), per layer. Goal: <= 1.1. Also
its compile and step time, and the bytes of the static-bound padded all-to-all it replaced.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from unittest import mock

from _common import (
    LogicalAxisRules,
    MeshShardingHelper,
    abstract_train_state,
    emit,
    goal_row,
    interleaved,
    jax,
    jnp,
    machine,
    median,
    models,
    nnx,
    np,
    real_batch,
    real_train_state,
    train_step,
)

from shardax import layout
from shardax.hlo import hlo_collectives
from shardax.layout import Layout, blocks, forward
from shardax.parallel import moe_mlp
from shardax.parallel.dropless import chunk_rows, send_bound

IMPLS = ("capacity", "dropless")
SHAPE = dict(vocab_size=4096, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=512,
             n_experts=8, top_k=2, max_seq_len=512)
BATCH, SEQ = 4, 512
EP, EP_BATCH, EP_SEQ = 8, 8, 256  # the ep row's mesh and batch (the same tokens per step)
LAYOUT = Layout(scan_layers=True)


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
    moe = model.layers.mlp  # the stack: [layers, ...]; layer 0 is index 0
    _, aux = moe_mlp(x, moe.router[0], moe.w_up[0], moe.w_down[0], moe.w_gate[0],
                     top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                     num_groups=x.shape[0], activation=jax.nn.silu)
    return float(aux["dropped_fraction"])


def expert_parallel(rounds: int) -> dict:
    """The dropless train step on ``ep=EP`` run on a real batch: compile and step seconds,
    and per device and step the bytes its exchange moved (`_exchange_bytes`), theory's, and
    the padded all-to-all's (``ep x send_bound`` rows each way)."""
    import optax

    cfg = models.LlamaConfig(**SHAPE, moe_impl="dropless")
    mesh = MeshShardingHelper.from_string(f"ep={EP}")
    rules = LogicalAxisRules(layout.presets.resolve(layout.PRESETS["fsdp_tp"], mesh.shape))
    tx = optax.sgd(0.1)
    graphdef, shape = abstract_train_state(cfg, tx)
    _, state = real_train_state(cfg, tx, mesh.match_sharding_rule(rules, shape))
    batch = real_batch(EP_BATCH, EP_SEQ, cfg.vocab_size)
    step = mesh.sjit(functools.partial(train_step, graphdef=graphdef, tx=tx,
                                       param_rules=rules, layout=LAYOUT),
                     in_shardings=(rules, None), out_shardings=(rules, None))
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    step_s = median(interleaved({"ep": functools.partial(compiled, state, batch)},
                                rounds=rounds, warmup=1)["ep"])
    counts = routing_counts(mesh, rules, graphdef, state, batch[0])
    routed = compiled(state, batch)[1]["moe/expert_tokens"]  # the step's own routing, summed
    assert np.array_equal(counts.sum((0, 1)), np.asarray(routed)), (counts.sum((0, 1)), routed)
    local_tokens, k, d = EP_BATCH * EP_SEQ // EP, SHAPE["top_k"], SHAPE["dim"]
    moved, gathered = _exchange_bytes(compiled.as_text(), counts, chunk_rows(local_tokens * k, EP))
    theory = local_tokens * k * d * 4 * 2 * 2 * SHAPE["n_layers"]
    padded = EP * send_bound(local_tokens, k, SHAPE["n_experts"] // EP) * d * 4 * 2 * 2 * \
        SHAPE["n_layers"]
    return {"moved_bytes": moved, "counts_bytes": gathered, "theory_bytes": theory,
            "padded_bytes": padded, "compile_s": compile_s, "step_s": step_s,
            "kept_fraction": float(np.trace(counts.reshape(-1, EP, EP, SHAPE["n_experts"] // EP)
                                            .sum(-1), axis1=1, axis2=2).sum() / counts.sum())}


def routing_counts(mesh, rules, graphdef, state, tokens: jax.Array) -> np.ndarray:
    """``[layers, EP, n_experts]`` (layers in any order): the pairs each ``ep`` device's
    tokens route to each expert, per layer: the routing that the forward of the same program
    (same mesh, same parameters, same batch) hands the dropless exchange (device ``i`` holds
    batch rows ``i * EP_BATCH / EP`` on)."""
    seen, exchange = [], blocks.dropless_moe

    def record(tokens, weights, experts, *args, **kwargs):
        jax.debug.callback(lambda e: seen.append(np.asarray(e)), experts)
        return exchange(tokens, weights, experts, *args, **kwargs)

    def run(state, tokens):
        return forward.logits(nnx.merge(graphdef, state.params, state.rest), LAYOUT, tokens)

    with mock.patch.object(blocks, "dropless_moe", record):
        fn = mesh.sjit(run, in_shardings=(rules, None))
        jax.block_until_ready(fn(state, tokens))
    assert len(seen) == SHAPE["n_layers"], len(seen)
    return np.stack([np.stack([np.bincount(e.ravel(), minlength=SHAPE["n_experts"])
                               for e in np.split(layer, EP)]) for layer in seen])


def _exchange_bytes(hlo: str, counts: np.ndarray, chunk: int) -> tuple[int, int]:
    """Bytes per device the step's exchanges moved, and the count matrices' all-gathers.

    Each collective-permute in the optimized HLO moves its bytes (read from the HLO) per loop
    step it runs (`shardax.parallel.dropless.exchange`): one of shift ``s`` (all pairs ``(i,
    i+s)``) runs ``min_i ceil(c[i, i+s] / chunk)`` steps, one of pair ``(i, j)`` the rest of
    that pair's ``ceil(c[i, j] / chunk)``; ``c`` the layer's count matrix. Of each
    collective's copies, half (the send forward, its transpose backward) run on ``c``, half
    (the return and its transpose) on ``c.T``."""
    ops = hlo_collectives(hlo)
    steps = -(-counts.reshape(len(counts), EP, EP, -1).sum(-1) // chunk)
    moved = 0
    for op in (o for o in ops if o.kind == "collective-permute"):
        line = next(line for line in hlo.splitlines() if f"%{op.name} = " in line)
        src, dst = np.array([tuple(map(int, p)) for p in re.findall(
            r"\{(\d+),(\d+)\}", re.search(r"source_target_pairs=\{(.*?\})\}", line)[1])]).T
        ring = np.arange(EP), (np.arange(EP) + dst[0] - src[0]) % EP
        per_step = op.bytes // op.multiplier  # the layer scan's trips are the layers
        for c in (m for layer in steps for m in (layer, layer.T)):
            runs = c[ring].min() if len(src) == EP else c[src[0], dst[0]] - c[ring].min()
            moved += per_step * len(src) * int(runs)
    moved //= 2 * EP  # half the copies each way; bytes per device
    gathered = sum(o.bytes for o in ops if o.kind == "all-gather" and o.dtype == "s32")
    return int(moved), int(gathered)


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
            "dropped_fraction": dropped_fraction(tokens), "ep": expert_parallel(rounds)}


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
        "On CPU the dropless grouped matmul runs each expert's rows in tiles (a scan of "
        "one matmul per tile, `shardax.parallel.grouped_kernel`): XLA:CPU lowers "
        "`jax.lax.ragged_dot` to one dense matmul of a [rows, experts x dim] masked copy "
        "against every expert (experts times the work), which GPU and TPU kernels do not.",
        "",
        *_render_ep(r["ep"]),
    ])


def _ep_ratio(ep: dict) -> float:
    return (ep["moved_bytes"] + ep["counts_bytes"]) / ep["theory_bytes"]


def _render_ep(ep: dict) -> list[str]:
    ratio = _ep_ratio(ep)
    n_local = SHAPE["n_experts"] // EP
    local_tokens = EP_BATCH * EP_SEQ // EP
    chunk = chunk_rows(local_tokens * SHAPE["top_k"], EP)
    return [
        f"Dropless expert parallelism, `ep={EP}` (8 emulated devices, batch {EP_BATCH} x seq "
        f"{EP_SEQ} of random tokens, the model's initial router), per device and step: the "
        "bytes the exchange moved (rows and count matrices) against theory = tokens/ep x "
        "top-k x dim x 4 bytes x 2 directions x 2 (forward, backward) x layers.",
        "",
        "| moved MiB | count all-gathers B | theory MiB | ratio | padded all-to-all MiB "
        "(ratio) | kept on device | compile s | step ms |",
        "|---|---|---|---|---|---|---|---|",
        f"| {ep['moved_bytes'] / 2**20:.2f} | {ep['counts_bytes']} | "
        f"{ep['theory_bytes'] / 2**20:.2f} | {ratio:.3f} | {ep['padded_bytes'] / 2**20:.2f} "
        f"({ep['padded_bytes'] / ep['theory_bytes']:.2f}) | {ep['kept_fraction']:.1%} | "
        f"{ep['compile_s']:.1f} | {ep['step_s'] * 1e3:.0f} |",
        "",
        "The devices all-gather their pairs per expert (the count matrix), then each ordered "
        f"pair of devices moves its rows {chunk} at a time (`chunk_rows`: a quarter of a mean "
        "pair) with `ppermute`s in one `while_loop` whose trip count is that matrix's "
        "(`shardax.parallel.dropless.exchange`: the chunks that every pair (i, i + s) of a "
        "shift s has move in one `ppermute` of all of them, the rest pair by pair); rows "
        "routed to the device's own experts do not move. Moved = the bytes of each "
        "collective-permute per loop step, read from the optimized HLO, times the steps it "
        "ran: ceil(rows / chunk) per pair in all, from the count matrices of this batch's "
        "routing (recorded from the forward of the same program and "
        "checked against the step's expert load), over ep for bytes per device. So the ratio "
        "is the off-device fraction of the routed rows plus the rounding to whole chunks, and "
        "can be below 1. The padded column is what the static-bound all-to-all moved before "
        f"(each of the {EP} destinations sent tokens/ep x min(top-k, local experts) = "
        f"min({SHAPE['top_k']}, {n_local}) rows: {EP * min(SHAPE['top_k'], n_local)} / "
        f"{SHAPE['top_k']} times theory). XLA:CPU has no `ragged-all-to-all` (JAX 0.10: "
        "UNIMPLEMENTED); on GPU and TPU one `jax.lax.ragged_all_to_all` would move the same "
        "rows in one collective.",
        "",
    ]


def summary(r: dict) -> list[dict]:
    t = r["step_s"]["dropless"] / r["step_s"]["capacity"]
    m = r["temp_bytes"]["dropless"] / max(r["temp_bytes"]["capacity"], 1)
    a = _ep_ratio(r["ep"])
    return [goal_row("12 moe", "dropless / capacity step time", t, "≤ 1.1", t <= 1.1),
            goal_row("12 moe", "dropless / capacity temporaries", m, "≤ 1.1", m <= 1.1),
            goal_row("12 moe", f"dropless ep={EP} exchange bytes moved / (tokens x top-k x "
                     "dim x 4 B x 2 directions x 2 passes x layers)", a, "≤ 1.1", a <= 1.1)]


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
