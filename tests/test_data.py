"""Byte-level data: built-in corpus, file loading, deterministic resumable batches."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from shardax.train.data import (
    SEPARATOR,
    TokenBatches,
    default_corpus,
    list_text_files,
    load_bytes,
    split_tokens,
    val_batches,
)

TOKENS = np.random.default_rng(0).integers(0, 256, size=5_000).astype(np.uint8)


def take(data, n):
    return [next(data) for _ in range(n)]


def test_default_corpus_nonempty_sorted_and_split():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val, full = default_corpus("train"), default_corpus("val"), default_corpus("all")
    assert len(train) > 100 and len(val) > 10
    rel = [p.relative_to(stdlib).as_posix() for p in full]
    assert rel == sorted(rel)
    assert all(p.suffix == ".py" and p.is_file() for p in full)
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/"))
    # Held-out split: every 10th file, disjoint from train, together the whole corpus.
    assert val == full[9::10]
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(full)
    total = sum(p.stat().st_size for p in full)
    assert 1_000_000 < total <= 6 * 1024 * 1024
    assert default_corpus("train") == train  # deterministic
    with pytest.raises(ValueError, match="split"):
        default_corpus("test")


def test_load_bytes_files_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "sub" / "a.txt").write_text("sub-a")
    (tmp_path / "d" / "a.txt").write_text("aa")
    (tmp_path / "d" / "blob.bin").write_bytes(b"\x00\x01\x02")  # binary: skipped
    (tmp_path / "d" / ".hidden").write_text("secret")  # hidden: skipped
    (tmp_path / "one.txt").write_text("one")
    files = list_text_files([tmp_path / "one.txt", tmp_path / "d"])
    names = [p.relative_to(tmp_path).as_posix() for p in files]
    assert names == ["one.txt", "d/a.txt", "d/b.txt", "d/sub/a.txt"]
    tokens = load_bytes([tmp_path / "one.txt", tmp_path / "d"])
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == SEPARATOR.join([b"one", b"aa", b"bee", b"sub-a"]) + SEPARATOR


def test_load_bytes_errors(tmp_path):
    missing = tmp_path / "nope" / "data.txt"
    with pytest.raises(FileNotFoundError, match="nope/data.txt"):
        load_bytes([missing])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_bytes([tmp_path / "empty_dir"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_bytes([tmp_path / "empty.txt"])


def test_batches_shape_targets_and_determinism():
    data = TokenBatches(TOKENS, seq_len=16, batch_size=8, seed=3)
    batches = take(data, 5)
    x, y = batches[0]
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are next tokens
    again = take(TokenBatches(TOKENS, seq_len=16, batch_size=8, seed=3), 5)
    for (a, b), (c, d) in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    other = take(TokenBatches(TOKENS, seq_len=16, batch_size=8, seed=4), 1)[0][0]
    assert not np.array_equal(other, x)
    # Every row is a real window of the stream.
    stream = TOKENS.tobytes()
    for row in x:
        assert row.astype(np.uint8).tobytes() in stream


def test_epoch_visits_every_window_once():
    seq_len, batch = 16, 8
    data = TokenBatches(TOKENS, seq_len=seq_len, batch_size=batch, seed=0)
    windows = data.windows  # (5000 - 1) // 16 = 312 windows: 39 batches of 8
    assert windows == 312
    rows = np.concatenate([x for x, _ in take(data, windows // batch)])
    starts = {bytes(r.astype(np.uint8)) for r in rows}
    assert len(starts) == windows  # a permutation: no window repeated within the epoch
    nxt = np.concatenate([x for x, _ in take(data, windows // batch)])
    assert not np.array_equal(nxt, rows)  # next epoch is reshuffled


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_split_concatenates_to_global_batch(process_count):
    # batch 12 with 312 windows makes step 26 straddle an epoch boundary.
    kwargs = dict(seq_len=16, batch_size=12, seed=7)
    reference = TokenBatches(TOKENS, **kwargs)
    shards = [
        TokenBatches(TOKENS, **kwargs, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for step in (0, 1, 25, 26, 27, 100):
        x, y = reference.batch(step)
        parts = [s.batch(step) for s in shards]
        assert all(p[0].shape == (12 // process_count, 16) for p in parts)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)


def test_resume_from_state_matches_uninterrupted_run():
    kwargs = dict(seq_len=16, batch_size=8, seed=11)
    full = take(TokenBatches(TOKENS, **kwargs), 60)
    first = TokenBatches(TOKENS, **kwargs)
    take(first, 37)
    saved = json.loads(json.dumps(first.state()))  # must survive JSON
    assert saved["step"] == 37
    # Resume in a fresh object, even with a different process count.
    resumed = [
        TokenBatches(TOKENS, **kwargs, process_index=p, process_count=2).restore(saved)
        for p in range(2)
    ]
    for step in range(37, 60):
        parts = [next(r) for r in resumed]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), full[step][0])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), full[step][1])
    with pytest.raises(ValueError, match="'seed'"):
        TokenBatches(TOKENS, seq_len=16, batch_size=8, seed=12).restore(saved)


def test_bad_sizes():
    with pytest.raises(ValueError, match="not divisible by process_count 3"):
        TokenBatches(TOKENS, seq_len=16, batch_size=8, process_count=3)
    with pytest.raises(ValueError, match="process_index"):
        TokenBatches(TOKENS, seq_len=16, batch_size=8, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 17"):
        TokenBatches(TOKENS[:10], seq_len=16, batch_size=8)


def test_val_batches_fixed_and_split():
    train, val = split_tokens(TOKENS, 0.2)
    assert len(val) == 1000 and np.array_equal(np.concatenate([train, val]), TOKENS)
    batches = val_batches(val, seq_len=16, batch_size=4)
    assert len(batches) == (999 // 16) // 4
    x, y = batches[0]
    np.testing.assert_array_equal(x[0], val[:16])
    np.testing.assert_array_equal(y[1], val[17:33])
    halves = [val_batches(val, 16, 4, num_batches=3, process_index=p, process_count=2)
              for p in range(2)]
    for b in range(3):
        np.testing.assert_array_equal(
            np.concatenate([halves[0][b][0], halves[1][b][0]]), batches[b][0]
        )
    with pytest.raises(ValueError, match="num_batches"):
        val_batches(val, 16, 4, num_batches=100)
