"""Weighted mixtures (`shardax.data.mixture`): shares follow the weights, the global batch
is a pure function of the step on any process count and across resumes, and changing the weights on
resume keeps every source's position."""

import json

import numpy as np
import pytest

from shardax.data.mixture import Mixture, parse_weighted
from shardax.errors import UsageError

STEPS, BATCH = 2000, 8


def _schedule(mix: Mixture, steps: range, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    parts = [mix.rows(t, batch) for t in steps]
    return np.stack([s for s, _ in parts]), np.stack([p for _, p in parts])


@pytest.fixture(scope="module")
def straight():
    mix = Mixture([0.7, 0.3], seed=3)
    return mix, _schedule(mix, range(STEPS))


def _assert_each_source_contiguous(sources, positions, num_sources, start=None):
    """Every source's positions are exactly 0.. (or start..) its count - 1: none repeated or
    skipped."""
    for s in range(num_sources):
        got = np.sort(positions[sources == s])
        first = 0 if start is None else start[s]
        np.testing.assert_array_equal(got, np.arange(first, first + len(got)))


def test_shares_follow_the_weights_over_2000_steps(straight):
    mix, (sources, positions) = straight
    shares = np.bincount(sources.ravel(), minlength=2) / sources.size
    np.testing.assert_allclose(shares, [0.7, 0.3], atol=0.02)
    # every prefix, not only the whole run, stays close: the interleave is not random
    for steps in (1, 10, 100):
        first = np.bincount(sources[:steps].ravel(), minlength=2) / sources[:steps].size
        assert abs(first[0] - 0.7) <= 1 / BATCH + 1e-9, (steps, first)
    _assert_each_source_contiguous(sources, positions, 2)
    np.testing.assert_array_equal(mix.counts(STEPS, BATCH), np.bincount(sources.ravel()))


def test_three_sources_and_unnormalised_weights():
    sources, positions = _schedule(Mixture([5, 3, 2], seed=0), range(500))
    np.testing.assert_allclose(np.bincount(sources.ravel()) / sources.size, [0.5, 0.3, 0.2],
                               atol=0.01)
    _assert_each_source_contiguous(sources, positions, 3)


def test_seed_permutes_rows_within_the_batch_only(straight):
    _, (sources, positions) = straight
    other_s, other_p = _schedule(Mixture([0.7, 0.3], seed=4), range(STEPS))
    assert not np.array_equal(sources, other_s)
    key = lambda s, p: np.sort(s * 10**9 + p, axis=1)  # noqa: E731
    np.testing.assert_array_equal(key(sources, positions), key(other_s, other_p))


def test_global_batch_is_identical_over_1_and_2_processes(straight):
    _, (sources, positions) = straight
    mix = Mixture([0.7, 0.3], seed=3)  # a fresh object: no state shared with the fixture
    for t in (0, 1, 17, STEPS - 1):
        parts = [mix.rows(t, BATCH, process_index=p, process_count=2) for p in range(2)]
        assert all(len(s) == BATCH // 2 for s, _ in parts)
        np.testing.assert_array_equal(np.concatenate([s for s, _ in parts]), sources[t])
        np.testing.assert_array_equal(np.concatenate([p for _, p in parts]), positions[t])


def test_resume_from_the_saved_state_gives_the_same_rows(straight):
    mix, (sources, positions) = straight
    saved = json.loads(json.dumps(mix.state()))  # as written with the checkpoint
    resumed = Mixture.from_state(saved).reweighted([7, 3], step=1000, batch_size=BATCH)
    s, p = _schedule(resumed, range(1000, STEPS))
    np.testing.assert_array_equal(s, sources[1000:])
    np.testing.assert_array_equal(p, positions[1000:])
    # from the counts alone, a schedule starting at the resume step continues every source
    counts = mix.counts(1000, BATCH)
    alone = Mixture.resumed(counts, [0.7, 0.3], step=1000, batch_size=BATCH, seed=3)
    s2, p2 = _schedule(alone, range(1000, STEPS))
    _assert_each_source_contiguous(s2, p2, 2, start=counts)
    with pytest.raises(UsageError, match="before this mixture starts"):
        alone.rows(999, BATCH)


def test_changed_weights_on_resume_keep_every_source_position(straight):
    mix, (sources, positions) = straight
    at = 1000
    changed = Mixture.from_state(mix.state()).reweighted([0.2, 0.8], step=at, batch_size=BATCH)
    new_s, new_p = _schedule(changed, range(STEPS))
    # the steps before the change are untouched
    np.testing.assert_array_equal(new_s[:at], sources[:at])
    np.testing.assert_array_equal(new_p[:at], positions[:at])
    # after it, each source continues where it stopped: over the whole run no row of a
    # source is repeated or skipped
    _assert_each_source_contiguous(new_s, new_p, 2)
    after = np.bincount(new_s[at:].ravel(), minlength=2) / new_s[at:].size
    np.testing.assert_allclose(after, [0.2, 0.8], atol=0.02)
    np.testing.assert_allclose(changed.weights, [0.2, 0.8], atol=1e-6)
    # and the changed schedule itself survives a save and restore
    again = Mixture.from_state(json.loads(json.dumps(changed.state())))
    np.testing.assert_array_equal(_schedule(again, range(at - 5, at + 5))[1],
                                  new_p[at - 5: at + 5])


@pytest.mark.parametrize("weights, named", [([0.7, -0.3], "weight 1 is -0.3"),
                                            ([0.0, 1.0], "weight 0 is 0.0"),
                                            ([1.0, float("nan")], "weight 1 is nan"),
                                            (["x", 1.0], "weight 0 is 'x'")])
def test_bad_weights_are_refused_naming_the_weight(weights, named):
    with pytest.raises(ValueError, match=named) as err:
        Mixture(weights)
    assert "\n" not in str(err.value)


def test_parse_weighted():
    assert parse_weighted("web/:0.7,code.jsonl:0.2,math/:0.1") == [
        ("web/", 0.7), ("code.jsonl", 0.2), ("math/", 0.1)]
    assert parse_weighted(["a.txt", "b/"]) == [("a.txt", 1.0), ("b/", 1.0)]
    assert parse_weighted(["a.txt:2", "hf:dir:1e-1"]) == [("a.txt", 2.0), ("hf:dir", 0.1)]
    assert parse_weighted("hf:dir") == [("hf:dir", 1.0)]  # a colon in a path is not a weight


@pytest.mark.parametrize("spec, entry", [("web/:0.7,code.jsonl:-1", "code.jsonl:-1"),
                                         ("web/:0", "web/:0"),
                                         ("web/:inf", "web/:inf"),
                                         ("web/:.", "web/:."),
                                         ("web/:", "web/:"),
                                         ("web/:1,,b:1", "''"),
                                         ("web/:0.7,code.jsonl", "code.jsonl")])
def test_parse_weighted_refuses_a_bad_entry_naming_it(spec, entry):
    with pytest.raises(ValueError, match="--data entry") as err:
        parse_weighted(spec)
    assert entry in str(err.value) and "\n" not in str(err.value)
