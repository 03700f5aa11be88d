"""Turns on JAX's persistent compilation cache for ``shardax train`` and ``shardax plan``.

The second start of the same run (same model, mesh, flags and versions) then loads its
compiled programs instead of compiling them again. The cache lives in
``$JAX_COMPILATION_CACHE_DIR`` when that is set (JAX's own variable), else in
``<shardax cache>/jax-cache`` (``$SHARDAX_CACHE_DIR``, ``$XDG_CACHE_HOME/shardax`` or
``~/.cache/shardax``: `shardax.data.encode.cache_root`). Every program is cached, however
small or quick to compile: a CPU run's step compiles in seconds, below JAX's default
one-second threshold only for tiny models, and a cache that skipped those would make tests and
small runs miss.

Example::

    enable()          # before the first compilation of the process
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from shardax.data.encode import cache_root

__all__ = ["ENV", "cache_dir", "enable"]

ENV = "JAX_COMPILATION_CACHE_DIR"


def cache_dir() -> Path:
    """``$JAX_COMPILATION_CACHE_DIR``, else ``<shardax cache root>/jax-cache``."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else cache_root() / "jax-cache"


def enable() -> Path | None:
    """Points JAX's persistent cache at `cache_dir` and caches every program; returns the
    directory, or None where it stays off: the processes of a multi-process job on CPU (their
    cache keys differ, so only process 0 would load from it and race ahead of the others to
    the first collective). Call it before the process compiles anything: JAX decides once,
    at the first compilation, whether the cache is used.

    >>> enable()  # doctest: +SKIP
    PosixPath('/home/me/.cache/shardax/jax-cache')
    """
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        return None
    path = cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
