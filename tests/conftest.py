"""Every test runs on 8 emulated CPU devices; this is the one place that sets it up.

The suite runs tiny programs for a few steps, so XLA compile time is most of its cost. Two
settings cut it without touching what the tests check (partitioning, collectives and memory
come from XLA's HLO passes, before code generation; every numeric comparison runs both of its
sides under the same flags):

- LLVM code generation at ``-O0`` (``--xla_backend_optimization_level=0``): about a quarter
  less CPU time over the suite; the programs run slower, which tiny programs do not notice.
- JAX's persistent compilation cache in a fresh directory per test process, exported through
  the environment so single-process subprocesses (examples, the `shardax` CLI) share it: a
  program compiled by several tests compiles once. Multi-process runs go without it (see the
  ``env`` fixture of ``test_multiprocess.py``).

Benchmarks and `make run` use neither.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shardax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Token caches (shardax.train.encode) go to a fresh directory per test process, shared with
# its subprocesses, never to the user's ~/.cache.
if "SHARDAX_CACHE_DIR" not in os.environ:
    _tokens = tempfile.mkdtemp(prefix="shardax-tests-tokens-")
    atexit.register(shutil.rmtree, _tokens, ignore_errors=True)
    os.environ["SHARDAX_CACHE_DIR"] = _tokens

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests expect 8 emulated CPU devices, got {jax.device_count()}"


# Shared meshes: one `MeshShardingHelper` per layout for the whole session (per xdist worker).
# Tests that are about constructing a helper build their own.


@pytest.fixture(scope="session")
def fsdp8():
    """The 1-D mesh of all 8 devices on 'fsdp'."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([-1], ["fsdp"])


@pytest.fixture(scope="session")
def dp8():
    """The 1-D mesh of all 8 devices on 'dp'."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([-1], ["dp"])


@pytest.fixture(scope="session")
def dp2_fsdp4():
    """dp=2 x fsdp=4."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([2, -1], ["dp", "fsdp"])


@pytest.fixture(scope="session")
def dp_fsdp_tp():
    """dp=2 x fsdp=2 x tp=2."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([2, 2, 2], ["dp", "fsdp", "tp"])


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory):
    """One tiny 4-step `shardax train` run shared by test_observability.py (trackers, profile,
    metrics) and test_planner.py (its plan.json against `shardax plan`): ``(config, out,
    records)``. Logs to the trackers that are installed (their tests skip otherwise) and
    profiles steps 2-3."""
    from shardax.train.config import TrainConfig
    from shardax.train.loop import train

    out = tmp_path_factory.mktemp("observed") / "run"
    os.environ.setdefault("WANDB_MODE", "offline")
    trackers = [name for name, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb"))
                if _installed(module)]
    config = TrainConfig(
        model="llama-tiny", batch_size=8, seq_len=32, mesh="fsdp=4,tp=2", remat="full",
        out=str(out), steps=4, log_every=1, eval_every=2, ckpt_every=100,
        log_to=",".join(["jsonl", *trackers]), profile_steps="2:4")
    return config, out, train(config)
