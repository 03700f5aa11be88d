"""Run every CPU benchmark, each in a fresh process, and write ``benchmarks/RESULTS.md``.

    python benchmarks/run.py                    # all sections (~45-50 minutes on 2 cores)
    python benchmarks/run.py --only overhead    # some sections; the others keep the last run

Sections: memory + communication (``memory_comm.py``), collective dtypes (the same script with
XLA dumping the SPMD-partitioned HLO), overhead (``overhead.py``), compile time vs depth
(``compile_depth.py``), peers (``peers.py``, with scalax pip-installed into
``benchmarks/.peers``), the CLI's default step against a hand-written ``jax.jit``
(``cli_step.py``: compile CPU s and tokens/s per layout), the FSDP modes against ZeRO-3
(``fsdp.py``), the data pipeline's host memory (``data_memory.py``), Hugging Face import +
KV-cache generation (``hf.py``), the planner's ranking vs measured step times (``planner.py``),
attention's temporaries against sequence length and step time per implementation
(``attention.py``), the dropless mixture of experts against the capacity-based one
(``moe.py``), the planner against published runs (``published.py``), LoRA's memory
against full fine-tuning (``lora.py``) and post-training and evaluation against the paths they
reuse (``post_training.py``: GRPO rollouts vs generation, GRPO / DPO steps vs SFT's, evaluation
vs training tokens/s). The llama-8b planner
searches (``planner.py --8b``, ~10-20 minutes) run only when named: ``--only planner_8b``. A
section that fails or times out is reported as such in RESULTS.md.
The GPU benchmark (``gpu_llama_1b.py``) is run by hand on a GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_DIR = HERE / ".peers"
SCALAX = "scalax==0.2.6"
SECTIONS = ("memory_comm", "dtypes", "overhead", "compile_depth", "peers", "cli_step", "fsdp",
            "data_memory", "hf", "planner", "attention", "moe", "published", "lora",
            "post_training")
# Run only when named with --only: the llama-8b planner searches take ~10-20 minutes.
EXTRA_SECTIONS = ("planner_8b",)
SECTION_TIMEOUT = {"planner": 1800.0, "planner_8b": 2400.0,  # seconds, over --timeout
                   "cli_step": 1800.0, "published": 1200.0}
RAW = HERE / ".results.json"  # the last run's raw numbers (committed with RESULTS.md)


def _env(extra_xla_flags: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    if extra_xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_xla_flags).strip()
    return env


def _run(script: str, args: list[str], timeout: float, env: dict[str, str]) -> dict:
    """Runs ``benchmarks/<script>`` with ``--json``; returns its result or the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)],
                                  cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s",
                    "seconds": time.perf_counter() - start}
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}",
                    "seconds": seconds}
        return {"result": json.loads(out.read_text()), "seconds": seconds}


def install_scalax() -> str | None:
    """pip-installs scalax into ``benchmarks/.peers`` (not into the project's environment)."""
    if (PEERS_DIR / "scalax").exists():
        return None
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
           str(PEERS_DIR), SCALAX]  # scalax needs numpy and jax, which are here already
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{' '.join(cmd[2:])}` failed: {e}"
    if proc.returncode != 0:
        return f"`{' '.join(cmd[2:])}` failed: {proc.stderr.strip()[-1000:]}"
    return None


def _failed(title: str, outcome: dict) -> str:
    return f"## {title}\n\nDid not run: {outcome['error']}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS + EXTRA_SECTIONS,
                        default=list(SECTIONS),
                        help="run these sections; the others keep the last run's results")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--timeout", type=float, default=600, help="per section, seconds")
    parser.add_argument("--render-only", action="store_true",
                        help=f"rewrite RESULTS.md from the last run's {RAW.name}")
    args = parser.parse_args()
    if args.render_only:
        sys.path.insert(0, str(HERE))
        sys.path.insert(0, str(ROOT / "src"))
        raw = json.loads(RAW.read_text())
        Path(args.out).write_text(render(raw["machine"], raw["outcomes"], raw["total_s"],
                                         raw["date"]))
        print(f"[bench] wrote {args.out} from {RAW}")
        return
    if set(args.only) != set(SECTIONS) and not RAW.exists():
        # RESULTS.md is rendered from the raw results of every section: without the last run's,
        # a partial run would drop every section it does not run.
        parser.error(f"--only keeps the other sections' results from the last run's {RAW.name}, "
                     f"which {RAW.parent} lacks (it is committed with RESULTS.md from the next "
                     "full run on): run every section first (make bench)")
    started = time.perf_counter()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT / "src"))

    machine = json.loads(subprocess.run(
        [sys.executable, str(HERE / "_common.py")], cwd=ROOT, env=_env(), capture_output=True,
        text=True, check=True, timeout=300).stdout)
    outcomes: dict[str, dict] = {}
    if set(args.only) != set(SECTIONS):
        # A partial run refreshes its sections and keeps the last run's numbers for the rest.
        outcomes = {k: v for k, v in json.loads(RAW.read_text())["outcomes"].items()
                    if k not in args.only}
    for section in args.only:
        print(f"[bench] {section} ...", flush=True)
        if section == "dtypes":
            dump = Path(tempfile.mkdtemp(prefix="shardax-bench-hlo-"))
            flags = f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
            outcomes[section] = _run("memory_comm.py", ["--dtypes"], args.timeout,
                                     _env(flags))
            shutil.rmtree(dump, ignore_errors=True)
        elif section == "planner_8b":
            outcomes[section] = _run("planner.py", ["--8b"],
                                     max(args.timeout, SECTION_TIMEOUT[section]), _env())
        elif section in ("peers", "overhead"):  # both compare with scalax
            problem = install_scalax()
            outcomes[section] = _run(f"{section}.py", [], args.timeout, _env())
            if problem and section == "peers" and "result" in outcomes[section]:
                outcomes[section]["result"]["scalax"] += f"; install: {problem}"
        else:
            outcomes[section] = _run(f"{section}.py", [],
                                     max(args.timeout, SECTION_TIMEOUT.get(section, 0)), _env())
        status = "ok" if "result" in outcomes[section] else outcomes[section]["error"][:200]
        print(f"[bench] {section}: {outcomes[section]['seconds']:.0f} s, {status}", flush=True)

    total = time.perf_counter() - started + sum(
        v["seconds"] for k, v in outcomes.items() if k not in args.only)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    RAW.write_text(json.dumps({"machine": machine, "outcomes": outcomes, "total_s": total,
                               "date": now}, default=str) + "\n")
    Path(args.out).write_text(render(machine, outcomes, total, now))
    print(f"[bench] wrote {args.out}")


def render(machine: dict, outcomes: dict[str, dict], total_s: float, now: str) -> str:
    import attention
    import cli_step
    import compile_depth
    import data_memory
    import fsdp
    import hf
    import lora
    import memory_comm
    import moe
    import overhead
    import peers
    import planner
    import post_training
    import published

    def ok(name: str) -> dict | None:
        return outcomes.get(name, {}).get("result")

    parts, summary = [], []
    dtypes = (ok("dtypes") or {}).get("dtypes", [])
    if ok("memory_comm"):
        mc = ok("memory_comm")
        parts.append(memory_comm.render_memory(mc["cases"][:memory_comm.MEMORY_CASES]))
        parts.append(memory_comm.render_comm(mc["cases"], mc["tp_forward"], mc["tp_mlp"],
                                             dtypes))
        summary += memory_comm.summary(mc, dtypes)
    elif "memory_comm" in outcomes:
        parts.append(_failed("1-2. Memory and communication", outcomes["memory_comm"]))
    if "dtypes" in outcomes and not ok("dtypes"):
        parts.append(_failed("2. Collective dtypes", outcomes["dtypes"]))
    for name, module, title in (("overhead", overhead, "3. Overhead"),
                                ("compile_depth", compile_depth, "4. Compile time vs depth"),
                                ("peers", peers, "5. Peers"),
                                ("cli_step", cli_step, "5b. The CLI's step against jax.jit"),
                                ("fsdp", fsdp, "7. FSDP: explicit ZeRO-3 against XLA's"),
                                ("data_memory", data_memory, "8. Data pipeline memory"),
                                ("hf", hf, "9. Hugging Face import and generation")):
        if ok(name):
            parts.append(module.render(ok(name)))
            summary += module.summary(ok(name))
        elif name in outcomes:
            parts.append(_failed(title, outcomes[name]))

    planned = {**(ok("planner") or {}), **(ok("planner_8b") or {})}
    if planned:
        parts.append(planner.render(planned))
        summary += planner.summary(planned)
    for name in ("planner", "planner_8b"):
        if name in outcomes and not ok(name):
            parts.append(_failed(f"10. Planner ({name})", outcomes[name]))
    if ok("attention"):
        parts.append(attention.render(ok("attention")))
        summary += attention.summary(ok("attention"))
    elif "attention" in outcomes:
        parts.append(_failed("11. Attention", outcomes["attention"]))
    if ok("moe"):
        parts.append(moe.render(ok("moe")))
        summary += moe.summary(ok("moe"))
    elif "moe" in outcomes:
        parts.append(_failed("12. Mixture of experts", outcomes["moe"]))
    if ok("published"):
        parts.append(published.render(ok("published")))
        summary += published.summary(ok("published"))
    elif "published" in outcomes:
        parts.append(_failed("13. Planner: against published runs", outcomes["published"]))
    if ok("lora"):
        parts.append(lora.render(ok("lora")))
        summary += lora.summary(ok("lora"))
    elif "lora" in outcomes:
        parts.append(_failed("14. LoRA against full fine-tuning", outcomes["lora"]))
    if ok("post_training"):
        parts.append(post_training.render(ok("post_training")))
        summary += post_training.summary(ok("post_training"))
    elif "post_training" in outcomes:
        parts.append(_failed("15. Post-training and evaluation", outcomes["post_training"]))

    head = [
        "# Benchmark results",
        "",
        f"Generated by `make bench` (`python benchmarks/run.py`) on {now}; total "
        f"{total_s / 60:.1f} min ("
        + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in outcomes.items()) + "). "
        "Do not edit by hand: rerun. Numbers are taken side by side in one run; timings on "
        "a shared 2-core machine are noisy, so ratios come from interleaved runs and medians.",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in machine.items()),
        "",
        "## Summary: every ratio against its goal",
        "",
        "| section | ratio | value | goal | met |",
        "|---|---|---|---|---|",
        *(f"| {r['section']} | {r['what']} | "
          f"{'—' if r['ratio'] != r['ratio'] else format(r['ratio'], '.3f')} | {r['goal']} | "
          f"{'yes' if r['met'] else '**no** (explained below)'} |" for r in summary),
        "",
        "GPU (section 6): `benchmarks/gpu_llama_1b.py` (llama-1b, FSDP, bf16 compute; tokens/s "
        "and MFU) runs only on a GPU machine and is not part of this CPU run; no GPU numbers "
        "are reported here.",
        "",
    ]
    return "\n".join(head + parts)


if __name__ == "__main__":
    main()
