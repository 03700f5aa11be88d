"""``shardax.utils``: the path strings every rule matches against (keys joined by ``/``)."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from shardax.utils import flatten_tree, named_tree_map, tree_path_to_string

Pair = collections.namedtuple("Pair", ["left", "right"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    weight: np.ndarray
    bias: np.ndarray


def _paths(tree, sep=None):
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
    assert tree_path_to_string(()) == ""


def test_named_tree_map_passes_path_then_leaves():
    tree = {"a": 1, "b": {"c": 2, "d": [3]}}
    other = {"a": 10, "b": {"c": 20, "d": [30]}}
    out = named_tree_map(lambda path, x, y: f"{path}:{x + y}", tree, other)
    assert out == {"a": "a:11", "b": {"c": "b/c:22", "d": ["b/d/0:33"]}}
    out = named_tree_map(lambda path, x: path, tree, sep="::")
    assert out["b"]["d"] == ["b::d::0"]


def test_named_tree_map_is_leaf_stops_descent():
    tree = {"a": (1, 2), "b": {"c": (3, 4)}}
    is_tuple = lambda x: isinstance(x, tuple)
    out = named_tree_map(lambda path, x: (path, len(x)), tree, is_leaf=is_tuple)
    assert out == {"a": ("a", 2), "b": {"c": ("b/c", 2)}}


def test_flatten_tree_is_a_flat_path_dict_in_leaf_order():
    tree = {"b": [np.zeros(2), np.ones(3)], "a": 1.5, "n": None}
    flat = flatten_tree(tree)
    assert list(flat) == ["a", "b/0", "b/1"]  # None has no leaves; dicts are sorted by key
    np.testing.assert_array_equal(flat["b/1"], np.ones(3))
    assert list(flatten_tree(tree, sep=".")) == ["a", "b.0", "b.1"]
    nested = flatten_tree({"x": {"y": (1, 2)}}, is_leaf=lambda x: isinstance(x, tuple))
    assert nested == {"x/y": (1, 2)}


@pytest.mark.parametrize("key", [0, "name"])
def test_paths_of_top_level_sequences_and_dicts(key):
    tree = [7] if key == 0 else {"name": 7}
    assert _paths(tree) == [str(key)]
