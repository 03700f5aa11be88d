"""``shardax.utils``: scalax.utils names with scalax semantics (``sep=None`` gives tuples)."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.utils import (
    JaxRNG,
    flatten_tree,
    float_tensor_to_dtype,
    float_to_dtype,
    get_float_dtype_by_name,
    named_tree_map,
    print_pytree_structure,
    tree_path_to_string,
)

Pair = collections.namedtuple("Pair", ["left", "right"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    weight: np.ndarray
    bias: np.ndarray


def _paths(tree, sep="/"):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [tree_path_to_string(path, sep=sep) for path, _ in leaves]


def test_tree_path_to_string_joins_dict_keys_indices_and_attributes():
    tree = {"layers": [{"w": 1}, Box(weight=2, bias=3)], "pair": Pair(4, 5), "top": 6}
    assert _paths(tree) == [
        "layers/0/w",
        "layers/1/weight",
        "layers/1/bias",
        "pair/left",
        "pair/right",
        "top",
    ]
    assert _paths(tree, sep=".")[0] == "layers.0.w"
    assert _paths(tree, sep=None)[0] == ("layers", "0", "w")
    assert tree_path_to_string((), sep="/") == ""
    assert tree_path_to_string(()) == ()


def test_named_tree_map_passes_path_then_leaves():
    tree = {"a": 1, "b": {"c": 2, "d": [3]}}
    other = {"a": 10, "b": {"c": 20, "d": [30]}}
    out = named_tree_map(lambda path, x, y: f"{path}:{x + y}", tree, other, sep="/")
    assert out == {"a": "a:11", "b": {"c": "b/c:22", "d": ["b/d/0:33"]}}
    assert named_tree_map(lambda path, x: path, tree)["b"]["d"] == [("b", "d", "0")]
    out = named_tree_map(lambda path, x: path, tree, sep="::")
    assert out["b"]["d"] == ["b::d::0"]


def test_named_tree_map_is_leaf_stops_descent():
    tree = {"a": (1, 2), "b": {"c": (3, 4)}}
    is_tuple = lambda x: isinstance(x, tuple)
    out = named_tree_map(lambda path, x: (path, len(x)), tree, is_leaf=is_tuple, sep="/")
    assert out == {"a": ("a", 2), "b": {"c": ("b/c", 2)}}


def test_flatten_tree_is_a_flat_path_dict_in_leaf_order():
    tree = {"b": [np.zeros(2), np.ones(3)], "a": 1.5, "n": None}
    flat = flatten_tree(tree, sep="/")
    assert list(flat) == ["a", "b/0", "b/1"]  # None has no leaves; dicts are sorted by key
    np.testing.assert_array_equal(flat["b/1"], np.ones(3))
    assert list(flatten_tree(tree, sep=".")) == ["a", "b.0", "b.1"]
    nested = flatten_tree({"x": {"y": (1, 2)}}, is_leaf=lambda x: isinstance(x, tuple))
    assert nested == {("x", "y"): (1, 2)}  # scalax's keys: tuples when sep is None


@pytest.mark.parametrize("key", [0, "name"])
def test_paths_of_top_level_sequences_and_dicts(key):
    tree = [7] if key == 0 else {"name": 7}
    assert _paths(tree) == [str(key)]


def test_jax_rng_splits_like_scalax():
    key = jax.random.PRNGKey(3)
    rng = JaxRNG(key)
    first = rng()
    carried, expected = jax.random.split(key)
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(rng.rng, carried)
    three = rng(3)
    assert isinstance(three, tuple) and len(three) == 3
    named = rng(["params", "dropout"])
    assert list(named) == ["params", "dropout"]
    # keys never repeat
    all_keys = [first, *three, *named.values()]
    assert len({tuple(np.asarray(k).tolist()) for k in all_keys}) == len(all_keys)
    np.testing.assert_array_equal(JaxRNG.from_seed(3).rng, key)


def test_global_jax_rng():
    JaxRNG.init_global_rng(0)
    a, b = JaxRNG.next_rng(), JaxRNG.next_rng()
    assert not np.array_equal(a, b)
    JaxRNG.init_global_rng(0)
    np.testing.assert_array_equal(JaxRNG.next_rng(), a)


def test_float_dtype_helpers():
    assert get_float_dtype_by_name("bf16") == jnp.bfloat16
    assert get_float_dtype_by_name("fp32") == jnp.float32
    with pytest.raises(KeyError, match="known"):
        get_float_dtype_by_name("f8")
    tree = {"w": jnp.ones(2, jnp.float32), "step": jnp.ones((), jnp.int32), "note": "x"}
    cast = float_to_dtype(tree, "bf16")
    assert cast["w"].dtype == jnp.bfloat16 and cast["step"].dtype == jnp.int32
    assert cast["note"] == "x"
    assert float_tensor_to_dtype(tree["w"], None) is tree["w"]
    assert float_tensor_to_dtype(tree["w"], jnp.float16).dtype == jnp.float16


def test_print_pytree_structure(capsys):
    print_pytree_structure({"a": {"w": jnp.zeros((2, 3))}, "n": 1})
    assert capsys.readouterr().out.splitlines() == [
        "a/w: shape: (2, 3), dtype: float32",
        "n: shape: none, dtype: none",
    ]
