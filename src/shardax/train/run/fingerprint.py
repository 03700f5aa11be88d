"""Position-sensitive 32-bit fingerprints of array leaves, the same on any mesh.

A checkpoint stores one per array and verifies them on restore
(`shardax.train.run.checkpoint`); ``shardax train`` logs one per batch (``data_hash``). Each
leaf's bits are hashed with their flat position (murmur3's finaliser) and summed in uint32,
which wraps, so the sum is exact in any reduction order: any mesh, any process count.

>>> import jax.numpy as jnp
>>> fingerprints({"w": jnp.ones(3)}) == fingerprints({"w": jnp.ones(3)})
True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from shardax.utils import flatten_tree

__all__ = ["fingerprints"]


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (64-bit elements give two words)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    w = _as_words(x)
    # Flat position from per-dimension iotas: no reshape, so no data moves between shards.
    index = jnp.zeros(w.shape, jnp.uint32)
    for d in range(w.ndim):
        index = index * jnp.uint32(w.shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d)
    h = w ^ (index * jnp.uint32(0x9E3779B1))
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)  # murmur3 finaliser
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    # uint32 addition wraps, so the sum is exact whatever the reduction order (= any mesh).
    return jnp.sum(h, dtype=jnp.uint32)


# One small program per leaf shape, dtype and sharding, shared by every leaf like it (a
# model's layers, the optimizer's moments): a few programs per model, compiled in a fraction of
# the time one program over every leaf takes.
_leaf_fingerprint_jit = jax.jit(_leaf_fingerprint)


# On the CPU backend a leaf's bytes are already in this process's memory: below this many
# elements numpy hashes it in less time than compiling its program takes (~45 ms).
_NUMPY_ON_CPU = 1 << 20


def _compiled_sum(x: jax.Array) -> int:
    """`_leaf_fingerprint` of ``x`` by its compiled program; the output is replicated, so this
    process's copy is the whole sum (across processes too)."""
    return int(np.asarray(_leaf_fingerprint_jit(x).addressable_data(0)))


def _by_numpy(x: jax.Array) -> bool:
    """Whether ``x`` is hashed from this process's shards with numpy: a leaf kept in host
    memory (``--offload-optimizer``), or a small leaf on the CPU backend."""
    if getattr(x.sharding, "memory_kind", None) not in (None, "device"):
        return True
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or jnp.issubdtype(x.dtype,
                                                                       jnp.complexfloating):
        return False  # `_as_words` turns these into words on the device
    return x.size < _NUMPY_ON_CPU and next(iter(x.devices())).platform == "cpu"


def _local_sum(x: jax.Array) -> int:
    """`_leaf_fingerprint`'s sum over this process's shards of ``x`` (one copy of each),
    computed with numpy: no device program. Same bits as the device version: uint32
    arithmetic wraps alike."""
    u32 = np.uint32
    total = 0
    for shard in x.addressable_shards:
        if shard.replica_id:
            continue
        data = np.asarray(shard.data)
        size = data.dtype.itemsize
        if data.dtype == np.bool_:
            w = data.astype(u32)
        elif size >= 4:
            w = np.ascontiguousarray(data).view(u32).reshape(
                data.shape + ((size // 4,) if size > 4 else ()))
        else:
            w = np.ascontiguousarray(data).view(np.dtype(f"uint{8 * size}")).astype(u32)
        shape = x.shape + w.shape[data.ndim:]
        starts = [s.start or 0 for s in shard.index] + [0] * (w.ndim - data.ndim)
        index = np.zeros(w.shape, u32)
        for d in range(w.ndim):
            coord = np.arange(starts[d], starts[d] + w.shape[d], dtype=u32).reshape(
                [-1 if k == d else 1 for k in range(w.ndim)])
            index = index * u32(shape[d]) + coord
        with np.errstate(over="ignore"):  # uint32 products wrap, as on the device
            h = w ^ (index * u32(0x9E3779B1))
            h = (h ^ (h >> u32(16))) * u32(0x85EBCA6B)
            h = (h ^ (h >> u32(13))) * u32(0xC2B2AE35)
            h = h ^ (h >> u32(16))
        total = (total + int(np.sum(h, dtype=u32))) % 2**32
    return total


def fingerprints(tree: Any) -> dict[str, int]:
    """A 32-bit, position-sensitive fingerprint of every array leaf of ``tree`` (keyed by its
    path), the same on any mesh and process count: what a checkpoint verifies its arrays
    against, and what ``shardax train`` logs of each batch (``data_hash``)."""
    flat = {k: v for k, v in flatten_tree(tree, sep="/").items()
            if isinstance(v, jax.Array)}
    by_numpy = [k for k, v in flat.items() if _by_numpy(v)]
    out = {}
    if by_numpy:
        sums = np.asarray([_local_sum(flat[k]) for k in by_numpy], np.uint32)
        if jax.process_count() > 1:  # one gather for all of them
            sums = np.sum(multihost_utils.process_allgather(sums), axis=0, dtype=np.uint32)
        out.update(zip(by_numpy, map(int, sums)))
    for k, v in flat.items():
        if k not in out:
            # Read before the next leaf starts: with a whole state's programs in flight at
            # once, XLA:CPU's collectives can wait on each other forever.
            out[k] = _compiled_sum(v)
    return dict(sorted(out.items()))
