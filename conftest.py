"""Every test and doctest runs on 8 emulated CPU devices; this is the one place that sets it up.

At the repository root so it applies to `tests/` and to the doctests of `src/shardax`
(`pytest --doctest-modules src/shardax`) alike; fixtures live in `tests/conftest.py`.

The suite runs tiny programs for a few steps, so compiling them is most of its cost. These
settings cut it without touching what the tests check (partitioning, collectives and memory
come from XLA's HLO passes, before code generation; every numeric comparison runs both of its
sides under the same flags):

- LLVM code generation at ``-O0`` (``--xla_backend_optimization_level=0``): about a quarter
  less CPU time over the suite; the programs run slower, which tiny programs do not notice.
- XLA:CPU's classic elemental fusion emitters instead of its MLIR fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``), and code generation in one piece
  (``--xla_cpu_parallel_codegen_split_count=1``: splitting pays on many cores, not on two):
  compiling a sharded train step takes about a third of the CPU time it took.
- No Python call stacks in the programs' op locations (``JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0``;
  JAX's default keeps up to 100 frames per op, which lowering, Shardy and XLA's passes carry
  along): ~10% less compile time for a sharded train step (5 alternating pairs of runs). Op
  names stay; nothing here reads source lines.
- JAX's persistent compilation cache in a fresh directory per pytest run, exported through
  the environment (pytest-xdist's controller imports this file first, so both workers inherit
  it) so that single-process subprocesses (examples, the `shardax` CLI) share it too: a
  program compiled by several tests compiles once. Multi-process runs go without it (see the
  ``env`` fixture of ``test_multiprocess.py``).

Benchmarks and `make run` use none of these. One more setting is Python's own: a test
process lives for minutes and fills JAX's caches (jaxprs, lowerings, executables), and each
of the garbage collector's full collections walks that growing heap: at its default thresholds
(700, 10, 10) test_attention.py with test_parallel_fsdp.py ran 18 of them, 5.5 s of
collecting; at (10000, 10, 10) still ~6% of test_parallel_train.py's CPU time (perf). So
automatic collection is off in test processes and one collection runs after each test file
(`pytest_runtest_teardown`), which frees the file's cyclic garbage (device buffers included)
before the next file starts: test_parallel_train.py 0.94x the wall time. That collection is of
the youngest generation only: with automatic collection off, everything the file allocated
is in it, and its garbage is too (it frees as many objects as a full collection: counted after
each of nine test files and nine doctest modules run in one process), while a full collection
walks everything every earlier file left (JAX's caches): 1.3 s each by the tenth file and up
to ~4 s late in a worker. Young, those eighteen collections took 3.5 s instead of 20.4 s (the
run 0.91x the wall time, the same peak memory).
"""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
              "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shardax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Token caches (shardax.data.encode) go to a fresh directory per pytest run, shared with
# the xdist workers and their subprocesses (writes are atomic renames), never to the
# user's ~/.cache.
if "SHARDAX_CACHE_DIR" not in os.environ:
    _tokens = tempfile.mkdtemp(prefix="shardax-tests-tokens-")
    atexit.register(shutil.rmtree, _tokens, ignore_errors=True)
    os.environ["SHARDAX_CACHE_DIR"] = _tokens

import jax  # noqa: E402
import pytest  # noqa: E402

gc.disable()

assert jax.device_count() == 8, f"tests expect 8 emulated CPU devices, got {jax.device_count()}"


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


# Doctest collection imports every module under src/shardax; the modules that need an extra
# (pyproject.toml) which is not installed are left out instead of failing collection.
_TRAIN = ("flax", "optax", "orbax", "grain", "etils")  # the `train` extra
_OPTIONAL = {
    "src/shardax/frameworks/linen.py": ("flax",),
    "src/shardax/frameworks/__init__.py": ("flax",),  # its doctest builds an nnx.Param
    "src/shardax/models": ("flax",),
    "src/shardax/hf": ("flax", "ml_dtypes"),
    "src/shardax/train": _TRAIN,
    "src/shardax/train/harness.py": (*_TRAIN, "lm_eval"),  # the `eval` extra
    "src/shardax/plan": _TRAIN,
    "tests/reference": ("torch", "transformers"),  # the script that makes tests/fixtures/hf
}
collect_ignore = [path for path, modules in _OPTIONAL.items() if not _installed(*modules)]


@pytest.hookimpl(trylast=True)  # after the file's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """A collection of the youngest generation, what this file allocated, after each test file
    (automatic collection is off: see the module's docstring)."""
    if nextitem is None or nextitem.path != item.path:
        gc.collect(0)
