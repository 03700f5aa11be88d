"""``shardax generate``: sample text from a run's checkpoint, without its training data.

The run directory is only read: its ``config.json`` says which model to build, and the newest
good checkpoint (or ``step``) is opened read-only, so sampling from a run that is still
training never disturbs it (no clean-up of the trainer's in-flight save, nothing written). The
directory may have been moved or copied: paths are taken relative to the ``out`` given here,
never from ``config.json``. A damaged newest checkpoint is skipped with a note on stderr.

>>> print(generate("runs/a", prompt="def ", max_tokens=40))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax.mesh import MeshShardingHelper
from shardax.train import build
from shardax.train.checkpoint import Checkpointer, CorruptCheckpointError, list_steps
from shardax.train.config import (
    GenerateConfig,
    TrainConfig,
    UsageError,
    check_generate,
    load_run_config,
    pipelined,
)

__all__ = ["check_run", "generate"]

CHECKPOINT_DIR = "checkpoints"


def _note(message: str) -> None:
    print(f"shardax generate: {message}", file=sys.stderr, flush=True)


def check_run(out: str, step: int | None = None) -> TrainConfig:
    """The config of run directory ``out``, if it has a committed checkpoint (``step``, if
    given); UsageError otherwise. Reads the file system only (no JAX backend, no writes)."""
    config = load_run_config(out)
    ckpt_dir = Path(out) / CHECKPOINT_DIR
    try:
        committed, uncommitted = list_steps(ckpt_dir)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot read {ckpt_dir} ({e.strerror or e})") from None
    if not committed:
        half = f" (steps {uncommitted} were never committed)" if uncommitted else ""
        raise UsageError(f"--out {out}: no checkpoint in {ckpt_dir}{half}; train first")
    if step is not None and step not in committed:
        raise UsageError(f"--step {step}: not a committed checkpoint in {ckpt_dir} "
                         f"(committed steps: {committed})")
    return config


def generate(out: str, prompt: str = "", max_tokens: int = 200, temperature: float = 0.8,
             seed: int = 0, step: int | None = None) -> str:
    """Samples ``max_tokens`` bytes after ``prompt`` from the newest good checkpoint in run
    directory ``out`` (or checkpoint ``step``); ``temperature`` 0 takes the likeliest byte."""
    check_generate(GenerateConfig(out=out, prompt=prompt, max_tokens=max_tokens,
                                  temperature=temperature, seed=seed, step=step))
    config = check_run(out, step)
    ckpt_dir = Path(out) / CHECKPOINT_DIR

    # Sampling is small: the model is replicated over all devices, without the run's
    # parallelism flags (a pipelined run saved its layers stacked, which the model keeps).
    model_config = build.model_config(config)
    if pipelined(config.mesh):
        model_config = dataclasses.replace(model_config, scan_layers=True)
    mesh = MeshShardingHelper.from_string(f"dp={jax.device_count()}")
    graphdef, state_shape = build.abstract(model_config, build.make_tx(config), config.seed, mesh)
    replicated = jax.tree.map(
        lambda _: jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec()),
        state_shape)

    def skipped(bad: int, why: str) -> None:
        _note(f"checkpoint step {bad} is unusable, trying the one before: {why}")

    try:
        with Checkpointer(ckpt_dir, read_only=True) as reader:
            restored, state = build.restore(reader, state_shape, replicated, step=step,
                                            fallback=step is None, on_skip=skipped)
    except CorruptCheckpointError as e:
        raise UsageError(f"--out {out}: no usable checkpoint: {e}") from None
    model = nnx.merge(graphdef, state["params"], state["rest"])
    return _sample(model, model_config.max_seq_len, prompt, max_tokens, temperature, seed)


def _sample(model, length: int, prompt: str, max_tokens: int, temperature: float,
            seed: int) -> str:
    @jax.jit
    def next_token(model, tokens, position, key):
        logits = model(tokens)[0, position].astype(np.float32)
        if temperature == 0:
            return jax.numpy.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    data = list(prompt.encode("utf-8"))
    if not data:
        data = [ord("\n")]  # something to condition on; not part of the output
        skip = 1
    else:
        skip = 0
    key = jax.random.key(seed)
    for _ in range(max_tokens):
        window = data[-length:]
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : len(window)] = window
        key, sub = jax.random.split(key)
        data.append(int(next_token(model, tokens, len(window) - 1, sub)))
    return bytes(data[skip:]).decode("utf-8", errors="replace")
