"""The persistent compilation cache of ``shardax train``: the second start of a run loads its
programs from the cache directory; ``--no-compile-cache`` leaves it alone."""

from pathlib import Path

from _cli import cli_env, run_cli

TINY = ["--devices", "2", "--mesh", "fsdp=2", "--model", "llama-tiny", "--steps", "2",
        "--batch-size", "4", "--seq-len", "16", "--optimizer", "sgd"]


def _train(tmp_path: Path, out: str, *flags: str) -> str:
    """Runs a tiny ``shardax train`` with its cache under ``tmp_path``; its stderr, where
    JAX's compiler logs each persistent-cache hit."""
    env = cli_env(SHARDAX_CACHE_DIR=str(tmp_path / "cache"),
                  JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = run_cli("train", *TINY, *flags, "--out", tmp_path / out, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _entries(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "cache" / "jax-cache").glob("*-cache")}


def test_second_start_compiles_from_cache(tmp_path):
    _train(tmp_path, "first")
    written = _entries(tmp_path)
    assert any(name.startswith("jit_sjit_body-") for name in written), written  # the step
    log = _train(tmp_path, "second")
    hits = {line.split("with key ")[1].strip("'") for line in log.splitlines()
            if "Persistent compilation cache hit" in line}
    assert {n.removesuffix("-cache") for n in written if n.startswith("jit_sjit_body-")} <= hits
    assert _entries(tmp_path) == written  # nothing compiled afresh, so nothing new written


def test_no_compile_cache_writes_nothing(tmp_path):
    log = _train(tmp_path, "run", "--no-compile-cache")
    assert not (tmp_path / "cache" / "jax-cache").exists()
    assert "Persistent compilation cache hit" not in log
