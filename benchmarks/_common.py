"""Shared set-up for the benchmarks: 8 emulated CPU devices, the llama train step, timers.

Import this module before JAX anywhere in a benchmark: it sets the device count.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

N_DEVICES = 8
ROOT = Path(__file__).resolve().parents[1]

if "jax" not in sys.modules:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flag = f"--xla_force_host_platform_device_count={N_DEVICES}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import models  # noqa: E402
from shardax.mesh import MeshShardingHelper  # noqa: E402
from shardax.precision import Policy  # noqa: E402
from shardax.rules import LogicalAxisRules  # noqa: E402
from shardax.train.optimizers import make_optimizer  # noqa: E402
from shardax.train.step import init_state, train_step  # noqa: E402


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import flax
    import optax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "shardax_commit": _git_commit(),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (src modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------- the train step

def abstract_train_state(config: Any, tx: Any) -> tuple[Any, Any]:
    """``(graphdef, state)`` of a llama train state as ``ShapeDtypeStruct``s: nothing
    allocated."""
    graphdefs = []

    def state_only():
        graphdef, state = init_state(
            lambda: models.create(config, nnx.Rngs(0)), tx)
        graphdefs.append(graphdef)
        return state

    state = jax.eval_shape(state_only)
    return graphdefs[0], state


def real_train_state(config: Any, tx: Any, shardings: Any = None) -> tuple[Any, Any]:
    """``(graphdef, state)`` with real arrays, created directly in ``shardings`` when given."""
    graphdef, _ = abstract_train_state(config, tx)
    create = jax.jit(lambda: init_state(lambda: models.create(
        config, nnx.Rngs(0)), tx)[1], out_shardings=shardings)
    return graphdef, create()


def batch_shape(batch: int, seq: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return tokens, tokens


def real_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def llama_step(
    mesh: MeshShardingHelper,
    rules: LogicalAxisRules,
    graphdef: Any,
    tx: Any,
    policy: Policy,
    donate: bool = False,
    layout: Any = None,
):
    """The library's train step under ``mesh.sjit`` with one logical rule set for the state
    (``layout``: a `shardax.layout.Layout`, default the plain one)."""
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    return mesh.sjit(
        partial(train_step, graphdef=graphdef, tx=tx, policy=policy,
                **({} if layout is None else {"layout": layout})),
        in_shardings=(rules, batch_spec),
        out_shardings=(rules, None),
        **({"donate_argnums": 0} if donate else {}),
    )


def adamw() -> Any:
    return make_optimizer("adamw", 1e-3, 1000, warmup=10)


def llama_config(name: str, policy: Policy, **overrides: Any) -> Any:
    return models.get_config(name, dtype=policy.compute, param_dtype=policy.params, **overrides)


# ----------------------------------------------------------------------------- timing

def import_scalax() -> tuple[Any, str | None]:
    """``(scalax.sharding, version)`` from ``benchmarks/.peers`` (where ``run.py`` installs it)
    or the environment; ``(None, why)`` when it cannot be imported."""
    peers = ROOT / "benchmarks" / ".peers"
    if peers.exists() and str(peers) not in sys.path:
        sys.path.insert(0, str(peers))
    try:
        from importlib.metadata import version

        import scalax.sharding as scalax_sharding

        return scalax_sharding, version("scalax")
    except Exception as e:  # any import failure is a result to report
        return None, f"import failed: {type(e).__name__}: {e}"


def paired_ratio(samples: Sequence[float], reference: Sequence[float]) -> float:
    """Median of per-round ratios: drift on a shared machine hits both sides of a round."""
    return median([s / r for s, r in zip(samples, reference)])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds one call of ``fn`` takes (results blocked on), and its result."""
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 2,
                inner: int = 1) -> dict[str, list[float]]:
    """Per-call seconds of each function, measured round-robin so drift hits all alike.

    Each sample is the mean of ``inner`` back-to-back calls (blocked at the end).
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            fn = fns[name]
            start = time.perf_counter()
            out = None
            for _ in range(inner):
                out = fn()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def emit(result: dict[str, Any], path: str | None) -> None:
    """Writes a section's result as JSON (to ``path`` or stdout)."""
    text = json.dumps(result, indent=2, default=str)
    if path:
        Path(path).write_text(text + "\n")
    else:
        print(text)


def goal_row(section: str, what: str, ratio: float, goal: str, met: bool) -> dict[str, Any]:
    """One line of RESULTS.md's summary table."""
    return {"section": section, "what": what, "ratio": ratio, "goal": goal, "met": met}


if __name__ == "__main__":
    emit(machine(), sys.argv[1] if len(sys.argv) > 1 else None)
