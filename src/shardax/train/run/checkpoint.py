"""Sharded checkpoints with orbax: save on one mesh, restore onto any other.

A checkpoint step holds three orbax items: ``state`` (the train-state pytree, each process
writing its own shards), ``extra`` (user JSON: data position, RNG seed, config, mesh string)
and ``meta`` (a 32-bit, position-sensitive fingerprint per array leaf). Restoring takes a
target tree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``; each array is read
straight into the target's sharding, so the mesh may differ from the one that saved it.

Example::

    ckpt = Checkpointer("/tmp/run", max_to_keep=3, save_every=100)
    ckpt.save(step, state, extra={"data": batches.state()})
    ...
    target = abstract_state(state_shapes, shardings)       # shardings on the new mesh
    step, state, extra = ckpt.restore(target=target)         # latest committed step
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from shardax import _compat
from shardax.errors import CheckpointWriteError, CorruptCheckpointError
from shardax.filewrite import remove_tree
from shardax.train.run.fingerprint import fingerprints
from shardax.train.run.orbax_logs import quiet_orbax
from shardax.utils import flatten_tree

__all__ = ["CheckpointWriteError", "Checkpointer", "CorruptCheckpointError", "Restored",
           "abstract_state", "flat", "list_steps", "listed_layers", "restore_state",
           "save_whole_shards_on_cpu"]

# Written inside a step directory just before orbax commits it (atomic rename on local and
# POSIX file systems, the commit marker itself on GCS); a step without it never finished.
_COMMIT_FILE = "commit_success.txt"
_FORMAT = 1

log = logging.getLogger(__name__)


def _write_reason(e: BaseException) -> str:
    """The operating system's reason for a failed write, found in an orbax / TensorStore
    error (``... No space left on device [os_error_code='28']``) or its causes, else the
    error itself in short."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return os.strerror(int(code.group(1)))
        seen = seen.__cause__ or seen.__context__
    return _short(e)


def _chain(e: BaseException) -> str:
    """The messages of ``e`` and of its causes, joined."""
    texts, seen = [], 0
    while e is not None and seen < 20:
        texts.append(str(e))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return " | ".join(texts)


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns."""

    step: int
    state: Any
    extra: dict


def _short(e: Exception, limit: int = 300) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def list_steps(directory: str | os.PathLike) -> tuple[list[int], list[int]]:
    """``(committed, uncommitted)`` step numbers in a checkpoint directory, oldest first,
    read from the file system alone (no orbax, nothing written). An uncommitted step is a
    step folder without its commit marker: a save that never finished (or a partial copy).
    In-flight ``*.orbax-checkpoint-tmp-*`` folders are in neither list.

    Example::

        committed, half_written = list_steps("runs/a/checkpoints")
    """
    root = epath.Path(directory)
    committed, uncommitted = [], []
    if not root.is_dir():
        return committed, uncommitted
    for p in root.iterdir():
        if p.name.isdigit() and p.is_dir():
            (committed if (p / _COMMIT_FILE).exists() else uncommitted).append(int(p.name))
    return sorted(committed), sorted(uncommitted)


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _flat(tree: Any) -> dict[str, Any]:
    return flatten_tree(tree, sep="/")


def abstract_state(tree: Any, shardings: Any = None) -> Any:
    """A restore target: ``jax.ShapeDtypeStruct`` leaves carrying the wanted shardings.

    ``tree`` holds arrays or ``ShapeDtypeStruct`` s (e.g. from ``jax.eval_shape``);
    ``shardings`` is a matching tree of ``Sharding`` s, or None to keep each leaf's own.

    Example::

        target = abstract_state(jax.eval_shape(init, key), shardings_on_new_mesh)
    """
    def one(x, sharding=None):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding if sharding is not None else x.sharding
        )

    if shardings is None:
        return jax.tree.map(one, tree)
    return jax.tree.map(one, tree, shardings)


def _check_target(target: Any, saved_tree: Any, where: str) -> None:
    want, have = _flat(target), _flat(saved_tree)
    for path in want:
        if path not in have:
            raise ValueError(
                f"restore target leaf {path!r} is not in the checkpoint at {where} "
                f"(checkpoint has {len(have)} leaves, e.g. {list(have)[:5]})"
            )
    for path in have:
        if path not in want:
            raise ValueError(
                f"checkpoint leaf {path!r} at {where} is missing from the restore target "
                f"(target has {len(want)} leaves)"
            )
    for path, leaf in want.items():
        found = have[path]
        if not hasattr(leaf, "shape") or not hasattr(found, "shape"):
            continue
        expect = jax.eval_shape(jax.random.key_data, leaf) if _is_key(leaf) else leaf
        if tuple(expect.shape) != tuple(found.shape) or np.dtype(expect.dtype) != np.dtype(
            found.dtype
        ):
            raise ValueError(
                f"restore target leaf {path!r} does not match the checkpoint at {where}: "
                f"target expects shape {tuple(expect.shape)} dtype {np.dtype(expect.dtype)}, "
                f"checkpoint has shape {tuple(found.shape)} dtype {np.dtype(found.dtype)}"
            )


#: ``adapt(target, saved_shapes) -> (target as saved, convert) | None`` (`Checkpointer.restore`)
Adapt = Callable[[Any, dict[str, tuple[int, ...]]], tuple[Any, Callable[[Any], Any]] | None]


def save_whole_shards_on_cpu() -> None:
    """On the CPU backend, each replicated shard is saved whole by its first replica; for a
    program that opts in (the ``shardax train`` command, once its backend is up): it changes
    orbax's registered array handler for the whole process.

    Orbax's default there (replica-parallel saving) has every replica copy its part of a
    shard to the host, and cutting the parts compiles a slicing program per part and device:
    ~20 ms each, about a second per save of a small state replicated over 8 CPU devices, for
    copies that are memcpys on CPU. Orbax already saves whole shards on GPUs. Its handler
    takes the setting only in its constructor, and the registered one (with its array
    metadata store) is kept, so the setting is changed on it.
    """
    if jax.default_backend() != "cpu":
        return
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", False):  # private: no public setter
        handler._use_replica_parallel = False


class _Pinned:
    """An orbax preservation policy: the steps in ``steps`` (a set the `Checkpointer` adds
    to) are kept whatever ``max_to_keep`` says, and so are step folders that are symlinks
    (e.g. to another run's step): the rotation never deletes through a link."""

    def __init__(self, directory: epath.Path) -> None:
        self.directory = directory
        self.steps: set[int] = set()

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        return [c.step in self.steps or os.path.islink(self.directory / str(c.step))
                for c in checkpoints]


class Checkpointer:
    """Saves and restores train state + JSON extras under ``directory`` with orbax.

    ``save_every=K`` keeps only saves at steps divisible by K (``force=True`` overrides);
    ``max_to_keep=N`` deletes committed steps but the newest N and those given to `pin`.
    With ``async_save`` the arrays are copied off the devices before `save` returns and
    written in the background, so the caller may donate or overwrite them at once. All
    processes must call `save` and `restore` together; each writes and reads only its own
    shards. ``read_only=True`` opens an existing directory for reading only: nothing is
    created, cleaned up or deleted (safe while another process trains into it), and `save`
    raises.

    Example::

        with Checkpointer(path, max_to_keep=2) as ckpt:
            ckpt.save(10, {"params": params, "opt": opt_state}, extra={"data_step": 10})
            step, state, extra = ckpt.restore(target=abstract_state(state, new_shardings))
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_to_keep: int | None = None,
        save_every: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = epath.Path(directory).absolute()
        self.read_only = read_only
        self._pinned = _Pinned(self.directory)
        if read_only:
            if not self.directory.is_dir():
                raise FileNotFoundError(f"no checkpoint directory {str(self.directory)!r}")
            # A reader never writes: no directory creation, no clean-up of the tmp folders
            # of a save that a running trainer may have in flight, no deletions.
            options = ocp.CheckpointManagerOptions(
                read_only=True, create=False, cleanup_tmp_directories=False,
                save_interval_steps=0, enable_async_checkpointing=False)
        else:
            options = ocp.CheckpointManagerOptions(
                # A preemption notice (multi-process jobs) also saves, when `save` is called
                # at every step without force (shardax train handles signals itself).
                save_decision_policy=policies.AnySavePolicy([
                    policies.FixedIntervalPolicy(save_every),
                    policies.PreemptionCheckpointingPolicy(),
                ]),
                preservation_policy=policies.AnyPreservationPolicy(
                    [policies.LatestN(max_to_keep), self._pinned]),
                enable_async_checkpointing=async_save,
                # Leftover tmp dirs of an interrupted save are never read; remove them on
                # start (one writer per directory).
                cleanup_tmp_directories=True,
            )
        # Registering the items up front lets a fresh manager read steps it did not write.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.StandardSave)
        registry.add("state", ocp.args.StandardRestore)
        for item in ("extra", "meta"):
            registry.add(item, ocp.args.JsonSave)
            registry.add(item, ocp.args.JsonRestore)
        with quiet_orbax():  # read_only logs a warning per option it sets
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )
        self._saving: int | None = None  # the step whose save may still be in flight
        self._failed: CheckpointWriteError | None = None
        if not read_only:
            # The tmp-folder clean-up runs in a thread; finish it now, not at interpreter exit.
            future = getattr(self._manager, "_cleanup_tmp_directory_future", None)
            if future is not None:
                future.result()

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (saves still being written are not listed)."""
        return list_steps(self.directory)[0]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def linked_steps(self) -> dict[int, str]:
        """``{step: where its link leads}`` for the step folders that are symlinks: they are
        read and kept, never deleted by ``max_to_keep``.

        Example::

            for step, target in ckpt.linked_steps().items(): print(step, "->", target)
        """
        paths = {s: os.fspath(self.directory / str(s)) for s in sum(list_steps(self.directory), [])}
        return {s: os.readlink(p) for s, p in sorted(paths.items()) if os.path.islink(p)}

    def pin(self, step: int) -> None:
        """Keeps committed (or being saved) ``step`` whatever ``max_to_keep`` says, e.g. the
        last checkpoint with finite weights of a run whose loss has become NaN."""
        self._pinned.steps.add(step)

    def save(self, step: int, state: Any, extra: dict | None = None, *, force: bool = False
             ) -> bool:
        """Saves ``state`` (any pytree of arrays) and ``extra`` (JSON) as ``step``.

        Returns False (and writes nothing) when ``save_every`` skips this step or ``step`` is
        not newer than the latest saved one; ``force=True`` saves regardless, and raises
        orbax's ``StepAlreadyExistsError`` (a ValueError) if ``step`` exists.
        """
        extra = {} if extra is None else extra
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"checkpoint extra must be JSON-serialisable: {e}") from None
        if self.read_only:
            raise ValueError(f"checkpoint directory {str(self.directory)!r} was opened read-only")
        if not (force or self._manager.should_save(step)):
            return False
        self._clear_uncommitted(step)
        meta = {"format": _FORMAT, "fingerprints": fingerprints(state)}
        with self._writing(step):
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    extra=ocp.args.JsonSave(extra),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        self._saving = step
        return saved

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turns an error of orbax while writing (this ``step``, or the save in flight) into
        one `CheckpointWriteError`, raised once."""
        if self._failed is not None:
            raise self._failed
        try:
            yield
        except Exception as e:
            named = re.search(re.escape(str(self.directory)) + r"/(\d+)", _chain(e))
            failed = (int(named.group(1)) if named else
                      self._saving if self._saving is not None else step)
            self._saving = None
            self._failed = CheckpointWriteError(failed, str(self.directory), _write_reason(e),
                                                self.all_steps())
            raise self._failed from e

    def _clear_uncommitted(self, step: int) -> None:
        """Removes a step folder that never got its commit marker (a save that died, or a
        partial copy), so that it does not block saving ``step`` again; it was never
        loadable. All processes call it; the primary one deletes."""
        if step not in list_steps(self.directory)[1]:
            return
        if jax.process_index() == 0:
            log.warning("removing half-written checkpoint step %d (no commit marker)", step)
            remove_tree(self.directory / str(step))  # a symlink: only the link
        _compat.sync_processes(f"shardax-clear-step-{step}")
        self._manager.reload()

    def restore(self, step: int | None = None, target: Any = None, *, verify: bool = True,
                fallback: bool = False, check: Callable[[Restored], None] | None = None,
                on_skip: Callable[[int, str], None] | None = None,
                adapt: Adapt | None = None) -> Restored:
        """Restores ``step`` (default: the latest committed) onto ``target`` 's shardings.

        ``target`` is a tree of ``jax.ShapeDtypeStruct`` (see `abstract_state`) or arrays; its
        structure, shapes and dtypes must match the checkpoint (ValueError naming the first
        differing leaf). ``target=None`` restores onto the shardings saved (same devices only).
        ``verify`` checks every array against the fingerprint taken at save time. A step that
        cannot be read raises `CorruptCheckpointError`, or with ``fallback=True`` the
        next older committed step is tried. ``check(restored)`` may raise
        `CorruptCheckpointError` too (e.g. an ``extra`` without the keys the caller needs);
        ``on_skip(step, reason)`` hears of every skipped step (default: a logged warning).
        ``adapt(target, saved)`` (``saved``: the step's flat ``{key: shape}``) may return
        ``(the target as saved, convert)``, ``convert`` turning what is read into ``target``'s
        form (an older layout of the same state), or None when the target fits as it is.
        """
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no committed checkpoint in {str(self.directory)!r}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"step {step} is not a committed checkpoint in {str(self.directory)!r} "
                f"(committed steps: {steps})"
            )
        older = [s for s in reversed(steps) if s < step] if fallback else []
        for s in older:
            try:
                return self._restore_checked(step, target, verify, check, adapt)
            except CorruptCheckpointError as e:
                if on_skip is None:
                    log.warning("skipping unreadable checkpoint step %d: %s", step, e)
                else:
                    on_skip(step, str(e))
                step = s
        return self._restore_checked(step, target, verify, check, adapt)

    def _restore_checked(self, step, target, verify, check, adapt=None) -> Restored:
        restored = self._restore_step(step, target, verify, adapt)
        if check is not None:
            check(restored)
        return restored

    def _restore_step(self, step: int, target: Any, verify: bool, adapt: Adapt | None = None
                      ) -> Restored:
        where = f"{str(self.directory / str(step))!r}"
        if step not in self._manager.all_steps():  # committed after this manager started
            self._manager.reload()
        try:
            saved_tree = self._manager.item_metadata(step)["state"].tree
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot read the metadata of checkpoint step {step} at {where}: {_short(e)}"
            ) from e
        adapted = None
        if target is not None:
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x,
                target,
            )
            adapted = adapt and adapt(target, {k: tuple(getattr(v, "shape", ()))
                                               for k, v in _flat(saved_tree).items()})
            if adapted:
                target, convert = adapted
            _check_target(target, saved_tree, where)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    extra=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise CorruptCheckpointError(
                f"checkpoint step {step} at {where} is committed but cannot be read "
                f"(corrupted or truncated files?): {_short(e)}"
            ) from e
        if verify:
            expected = (out["meta"] or {}).get("fingerprints")
            if expected is None:
                raise CorruptCheckpointError(f"checkpoint step {step} at {where} has no "
                                             "fingerprints; pass verify=False to load it")
            found = fingerprints(out["state"])
            # Only leaves that were jax.Arrays at save time have fingerprints.
            for path in expected:
                if expected[path] != found.get(path):
                    raise CorruptCheckpointError(
                        f"checkpoint step {step} at {where}: leaf {path!r} does not match its "
                        f"fingerprint (saved {expected.get(path)}, read {found.get(path)}); "
                        "the stored data is corrupted"
                    )
        state = convert(out["state"]) if adapted else out["state"]
        return Restored(step, state, out["extra"] or {})

    def wait(self) -> None:
        """Blocks until background saves are committed; a failed one raises
        `CheckpointWriteError`."""
        with self._writing(None):
            self._manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        """Waits for pending saves and releases orbax's threads; a failed save raises
        `CheckpointWriteError` (unless it was raised before)."""
        try:
            if self._failed is None:
                self.wait()
        finally:
            with contextlib.suppress(Exception):  # its error, if any, was raised already
                self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- train states


def flat(state: Any) -> dict[str, Any]:
    """The checkpointed form of a train state: a flat ``{path: array}`` dict keyed by its tree
    paths joined with dots (``params.embed.value``, ``opt_state.1.0.mu...``, ``step``),
    independent of the pytree node classes (NNX, optax, `TrainState`) that hold the arrays.

    >>> sorted(flat({"params": {"w": 1}, "step": 2}))
    ['params.w', 'step']
    """
    return flatten_tree(state, sep=".")


def restore_state(ckpt: Checkpointer, state_shape: Any, shardings: Any, **kwargs: Any
                  ) -> tuple[Restored, Any]:
    """Reads a checkpoint of a train state onto ``shardings``: ``(restored, state)`` with the
    state in the structure of ``state_shape`` (any pytree whose `flat` keys are the saved
    ones). ``kwargs`` go to `Checkpointer.restore` (step, fallback, check, on_skip)."""
    target = abstract_state(flat(state_shape), flat(shardings))
    restored = ckpt.restore(target=target, adapt=listed_layers, **kwargs)
    leaves = [restored.state[k] for k in flat(state_shape)]
    return restored, jax.tree_util.tree_unflatten(jax.tree.structure(state_shape), leaves)


def listed_layers(target: dict[str, Any], saved: dict[str, tuple[int, ...]]
                  ) -> tuple[dict[str, Any], Callable[[dict], dict]] | None:
    """Restores a checkpoint that holds a model's identical layers as a list (``...layers.<i>.
    ...``: runs before the layers were always stacked) onto a target that stacks them
    (``...layers....`` with a leading layer axis), for `Checkpointer.restore`'s ``adapt``:
    the target as saved (each layer's slice, its sharding without the layer axis) and the
    conversion that stacks what is read onto the target's shardings. None when the target's
    keys are the saved ones.

    >>> target = {"params.layers.w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    >>> sorted(listed_layers(target, {"params.layers.0.w": (3,), "params.layers.1.w": (3,)})[0])
    ['params.layers.0.w', 'params.layers.1.w']
    """
    stacked = {}
    for key, leaf in target.items():
        head, sep, tail = key.partition(".layers.")
        if key not in saved and sep and f"{head}.layers.0.{tail}" in saved:
            stacked[key] = [f"{head}.layers.{i}.{tail}" for i in range(leaf.shape[0])]
    if not stacked:
        return None
    listed = {k: v for k, v in target.items() if k not in stacked}
    for key, parts in stacked.items():
        leaf = target[key]
        sharding = leaf.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:]),
                memory_kind=sharding.memory_kind)
        listed.update({p: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
                       for p in parts})
    out_shardings = {k: target[k].sharding for k in stacked}

    def convert(state: dict) -> dict:
        parts = {k: [state[p] for p in ps] for k, ps in stacked.items()}
        stack = jax.jit(lambda parts: {k: jnp.stack(v) for k, v in parts.items()},
                        out_shardings=out_shardings)
        return {**{k: v for k, v in state.items() if k in target}, **stack(parts)}

    return listed, convert
