"""Sharded checkpoints: exact round trips, resharding restore, atomicity, corruption."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardax import models
from shardax.data.lm_data import TokenBatches
from shardax.errors import CorruptCheckpointError
from shardax.train.run.checkpoint import Checkpointer, abstract_state, flat, restore_state
from shardax.train.step import TrainState, init_state


def mesh_of(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


FSDP = mesh_of((8,), ("fsdp",))
DP_FSDP_TP = mesh_of((2, 2, 2), ("dp", "fsdp", "tp"))


def make_state(mesh=FSDP):
    """A train-state-like tree: params, optax adam state, a PRNG key, mixed dtypes."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w": jax.random.normal(k[0], (16, 8), jnp.float32),
        "emb": jax.random.normal(k[1], (32, 4), jnp.bfloat16),
        "b": jnp.arange(8, dtype=jnp.int32),
    }
    opt = optax.adam(1e-2).init(params)
    state = {"params": params, "opt": opt, "rng": k[2], "step": jnp.int32(5)}
    specs = {"w": P("fsdp"), "emb": P("fsdp"), "b": P()}

    def place(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else None
        spec = specs.get(name, P()) if x.ndim else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def host(tree):
    """Numpy copy; PRNG keys become their raw bits."""
    def one(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def assert_tree_equal(a, b):
    ha, hb = host(a), host(b)
    assert jax.tree.structure(ha) == jax.tree.structure(hb)
    for x, y in zip(jax.tree.leaves(ha), jax.tree.leaves(hb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)  # bit-exact: no tolerance


def new_specs(path, x):
    """Shardings on the 2x2x2 mesh: different layout from the fsdp=8 save."""
    if x.ndim == 2:
        return NamedSharding(DP_FSDP_TP, P(("dp", "fsdp"), "tp"))
    if x.ndim == 1 and x.shape[0] % 2 == 0:
        return NamedSharding(DP_FSDP_TP, P("tp"))
    return NamedSharding(DP_FSDP_TP, P())


def step_files(directory, step):
    return sorted(p for p in (Path(directory) / str(step) / "state").rglob("*") if p.is_file())


def test_round_trip_same_mesh_bit_exact(tmp_path):
    state = make_state()
    extra = {"data": {"step": 7, "seed": 1}, "mesh": "fsdp=8", "lr": 0.01, "tags": ["a", 1]}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(3, state, extra)
        ckpt.wait()
        assert ckpt.latest_step() == 3
        step, restored, got_extra = ckpt.restore(target=abstract_state(state))
    assert step == 3
    assert got_extra == extra
    assert_tree_equal(restored, state)
    for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert r.sharding == s.sharding
    # The optax state keeps its own node types (namedtuples), not dicts.
    assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_resharding_restore_to_other_mesh_and_single_device(tmp_path):
    state = make_state()
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, state, {"mesh": "fsdp=8"})
    ckpt.wait()

    shardings = jax.tree_util.tree_map_with_path(new_specs, state)
    _, on_mesh, _ = ckpt.restore(target=abstract_state(state, shardings))
    assert_tree_equal(on_mesh, state)
    for r, want in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(shardings), strict=True):
        assert r.sharding == want
    w = on_mesh["params"]["w"]
    assert w.sharding.spec == P(("dp", "fsdp"), "tp")
    assert {s.data.shape for s in w.addressable_shards} == {(4, 4)}

    one = SingleDeviceSharding(jax.devices()[3])
    _, on_one, _ = ckpt.restore(target=abstract_state(state, jax.tree.map(lambda _: one, state)))
    assert_tree_equal(on_one, state)
    assert all(x.sharding == one for x in jax.tree.leaves(on_one))

    one_mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,),
                             devices=[jax.devices()[0]])
    target = abstract_state(state, jax.tree.map(lambda _: NamedSharding(one_mesh, P()), state))
    _, on_mesh1, _ = ckpt.restore(target=target)
    assert_tree_equal(on_mesh1, state)
    ckpt.close()


def test_max_to_keep_and_save_every(tmp_path):
    state = {"x": jnp.arange(4.0)}
    with Checkpointer(tmp_path / "a", max_to_keep=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"x": state["x"] + step}, {"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        on_disk = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.isdigit())
        assert on_disk == ["3", "4"]
        step, got, extra = ckpt.restore(3, target=abstract_state(state))
        assert step == 3 and extra == {"step": 3}
        np.testing.assert_array_equal(got["x"], np.arange(4.0) + 3)

    with Checkpointer(tmp_path / "b", save_every=3) as ckpt:
        saved = [step for step in range(7) if ckpt.save(step, state)]
        assert saved == [0, 3, 6]
        assert ckpt.save(7, state, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [0, 3, 6, 7]


def test_target_mismatch_errors_name_the_leaf(tmp_path):
    state = {"params": {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}, "n": jnp.int32(0)}
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(0, state)
    ckpt.wait()
    good = abstract_state(state)

    bad_shape = dict(good, params=dict(good["params"], w=jax.ShapeDtypeStruct((4, 3), jnp.float32)))
    with pytest.raises(ValueError, match=r"'params/w'.*shape \(4, 3\).*shape \(4, 2\)"):
        ckpt.restore(target=bad_shape)
    bad_dtype = dict(good, n=jax.ShapeDtypeStruct((), jnp.float32))
    with pytest.raises(ValueError, match=r"'n'.*dtype float32.*dtype int32"):
        ckpt.restore(target=bad_dtype)
    extra_leaf = dict(good, params=dict(good["params"], v=jax.ShapeDtypeStruct((2,), jnp.float32)))
    with pytest.raises(ValueError, match="'params/v' is not in the checkpoint"):
        ckpt.restore(target=extra_leaf)
    missing_leaf = {"params": good["params"]}
    with pytest.raises(ValueError, match="checkpoint leaf 'n' .* missing from the restore target"):
        ckpt.restore(target=missing_leaf)
    ckpt.close()


def test_no_checkpoint_and_unknown_step(tmp_path):
    ckpt = Checkpointer(tmp_path / "empty")
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
        ckpt.restore()
    ckpt.save(2, {"x": jnp.ones(2)})
    ckpt.wait()
    with pytest.raises(FileNotFoundError, match=r"step 5 .*committed steps: \[2\]"):
        ckpt.restore(5)
    with pytest.raises(TypeError, match="JSON"):
        ckpt.save(3, {"x": jnp.ones(2)}, extra={"bad": object()})
    ckpt.close()


def test_uncommitted_steps_are_ignored(tmp_path):
    state = {"x": jnp.arange(8.0)}
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state)
    # Orbax commits by renaming a tmp dir; a finished step carries the commit marker.
    assert (directory / "1" / "commit_success.txt").exists()
    assert not [p for p in directory.iterdir() if "tmp" in p.name]
    # A save interrupted before its rename, and a step dir copied without its marker.
    tmp = directory / "2.orbax-checkpoint-tmp-1234567"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "garbage").write_bytes(b"\x00" * 10)
    (directory / "3" / "state").mkdir(parents=True)
    (directory / "3" / "state" / "garbage").write_bytes(b"\x00" * 10)

    ckpt = Checkpointer(directory)
    assert ckpt.latest_step() == 1
    assert ckpt.all_steps() == [1]
    step, got, _ = ckpt.restore(target=abstract_state(state))
    assert step == 1
    np.testing.assert_array_equal(got["x"], np.arange(8.0))
    with pytest.raises(FileNotFoundError, match="step 3 is not a committed checkpoint"):
        ckpt.restore(3)
    assert not tmp.exists()  # leftover tmp dirs are cleaned up on start
    # The half-written step 3 does not block saving step 3 (it is replaced).
    ckpt.save(3, {"x": jnp.arange(8.0) + 1}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 3]
    assert not (directory / "3" / "state" / "garbage").exists()
    ckpt.close()


def test_read_only_checkpointer_writes_nothing(tmp_path):
    state = {"x": jnp.arange(8.0)}
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state)
    in_flight = directory / "2.orbax-checkpoint-tmp-1234567"  # a trainer's save in progress
    (in_flight / "state").mkdir(parents=True)

    def listing():
        return sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))

    before = listing()
    with Checkpointer(directory, read_only=True) as reader:
        assert reader.all_steps() == [1]
        step, got, _ = reader.restore(target=abstract_state(state))
        np.testing.assert_array_equal(got["x"], np.arange(8.0))
        with pytest.raises(ValueError, match="read-only"):
            reader.save(2, state, force=True)
    assert listing() == before  # the in-flight folder untouched, nothing created
    with pytest.raises(FileNotFoundError):
        Checkpointer(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()


def test_corrupted_checkpoint_is_detected(tmp_path):
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((64, 64)).astype(np.float32)  # incompressible, > inline size
    mk = lambda v: {"w": jax.device_put(v, NamedSharding(FSDP, P("fsdp")))}
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, mk(x0))
        ckpt.save(2, mk(x0 + 1))
    target = abstract_state(mk(x0))

    # Flip one bit in the middle of the largest (array data) file of step 2.
    data = max(step_files(directory, 2), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    ckpt = Checkpointer(directory)
    assert ckpt.latest_step() == 2  # committed, so listed; reading it must fail loudly
    with pytest.raises(CorruptCheckpointError, match=f"step 2 at '{directory}/2'"):
        ckpt.restore(target=target)
    step, got, _ = ckpt.restore(target=target, fallback=True)
    assert step == 1
    np.testing.assert_array_equal(np.asarray(got["w"]), x0)

    # A missing file is caught as well.
    for f in step_files(directory, 2):
        os.remove(f)
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        ckpt.restore(target=target)
    ckpt.close()


def test_async_save_is_not_affected_by_donation(tmp_path):
    state = make_state()
    expected = host(state)
    bump = jax.jit(
        lambda s: jax.tree.map(lambda x: x if x.dtype == jax.random.key(0).dtype else x + 1, s),
        donate_argnums=0,
    )
    with Checkpointer(tmp_path / "ckpt", async_save=True) as ckpt:
        ckpt.save(0, state)
        saved_leaves = jax.tree.leaves(state)
        state = bump(state)  # donates the saved buffers while the write may still be running
        for leaf in saved_leaves:  # JAX skips donating buffers orbax still views: free them
            if not leaf.is_deleted():
                leaf.delete()
        for leaf in jax.tree.leaves(state):
            leaf.block_until_ready()
        ckpt.wait()
        _, restored, _ = ckpt.restore(target=abstract_state(state))
    assert_tree_equal(host(restored), expected)


def test_resume_gives_bit_identical_training(tmp_path):
    """Plain SGD on byte data: 6 steps straight == 3 steps, checkpoint, fresh restore, 3 more."""
    tokens = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint8)
    sh, sh_out = NamedSharding(FSDP, P("fsdp")), NamedSharding(FSDP, P(None, "fsdp"))

    def init():
        k1, k2 = jax.random.split(jax.random.key(2))
        return {
            "emb": jax.device_put(jax.random.normal(k1, (256, 8)) * 0.1, sh),
            "out": jax.device_put(jax.random.normal(k2, (8, 256)) * 0.1, sh_out),
        }

    @jax.jit
    def step_fn(params, x, y):
        def loss(p):
            logits = p["emb"][x] @ p["out"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    def train(params, data, n):
        for _ in range(n):
            params = step_fn(params, *next(data))
        return params

    straight = train(init(), TokenBatches(tokens, 16, 8, seed=3), 6)

    data = TokenBatches(tokens, 16, 8, seed=3)
    params = train(init(), data, 3)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, params, {"data": data.state()})
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        step, params, extra = ckpt.restore(target=abstract_state(init()))
    data = TokenBatches(tokens, 16, 8, seed=3).restore(json.loads(json.dumps(extra["data"])))
    resumed = train(params, data, 3)
    assert step == 3
    assert_tree_equal(resumed, straight)


def test_a_checkpoint_of_the_old_dict_train_state_restores_into_train_state(tmp_path):
    """Before `TrainState`, the train state was a dict ``{"params", "rest", "opt_state",
    "step"}``; a checkpoint written from it (here: with the old key names, the flat form
    orbax stores) restores into the typed state, leaf for leaf."""
    config = models.get_config("llama-tiny", n_layers=1)
    tx = optax.adamw(1e-3)
    _, state = init_state(lambda: models.create(config, nnx.Rngs(0)), tx)
    old = {"params": state.params, "rest": state.rest, "opt_state": state.opt_state,
           "step": jnp.int32(7)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, flat(old), extra={}, force=True)
        ckpt.wait()
    shape = jax.eval_shape(lambda: state)
    assert isinstance(shape, TrainState)
    assert sorted(flat(shape)) == sorted(flat(old))  # the layout on disk is unchanged
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), shape)
    with Checkpointer(tmp_path, read_only=True) as reader:
        restored, back = restore_state(reader, shape, shardings)
    assert restored.step == 7 and isinstance(back, TrainState) and int(back.step) == 7
    for key, want in flat(old).items():
        np.testing.assert_array_equal(np.asarray(flat(back)[key]), np.asarray(want))
