"""Evaluation control for small fine-tuning sets: ``--eval-every 0`` turns evaluation off,
``--val-data`` is a separate validation set, and an automatic split too small for one batch is
resized to one batch or skipped, with a one-line note, instead of refusing the run."""

import json
from pathlib import Path

import pytest
from _reference import TINY_TRAIN

from shardax.errors import UsageError
from shardax.train.config import TrainConfig, check
from shardax.train.loop import prepare, train

TINY = {**TINY_TRAIN, "steps": 2, "eval_every": 1}  # 8 x 32 tokens a batch


def _text(path: Path, size: int, offset: int = 0) -> Path:
    lines, n = [], 0
    while n < size:
        lines.append(f"def f{offset + len(lines)}(x):\n    return x * {len(lines) % 7}\n")
        n += len(lines[-1])
    path.write_text("".join(lines)[:size])
    return path


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4,000-token (byte) fine-tuning set and a 1,000-token validation file."""
    root = tmp_path_factory.mktemp("small")
    return _text(root / "train.txt", 3999), _text(root / "val.txt", 999, offset=500)


def test_a_small_dataset_trains_with_eval_every_0(tmp_path, small):
    out = tmp_path / "run"
    config = TrainConfig(**{**TINY, "eval_every": 0, "out": str(out), "data": [str(small[0])]})
    prepared = prepare(config)
    assert prepared.inputs.val == [] and len(prepared.inputs.train.tokens) == 4000  # all of it
    records = train(config, prepared)
    assert [r["step"] for r in records] == [1, 2]
    assert not any("val_loss" in r for r in _records(out))
    assert records[0]["lr"] > 0  # step 1 trains


def test_a_small_dataset_trains_with_val_data(tmp_path, small):
    out = tmp_path / "run"
    config = TrainConfig(**{**TINY, "out": str(out), "data": [str(small[0])],
                            "val_data": [str(small[1])]})
    prepared = prepare(config)
    assert len(prepared.inputs.train.tokens) == 4000 and len(prepared.inputs.val) == 3
    train(config, prepared)
    assert [r["step"] for r in _records(out) if "val_loss" in r] == [1, 2]


@pytest.mark.parametrize("size, val_tokens, note", [
    (2000, 257, "validation: the last 257 of the 2,000 tokens of --data (one batch"),
    (800, None, "validation: skipped: --data holds 800 tokens"),
])
def test_a_short_automatic_split_is_resized_or_skipped_with_a_note(tmp_path, capsys, size,
                                                                   val_tokens, note):
    data = _text(tmp_path / "d.txt", size - 1)
    inputs = prepare(TrainConfig(**{**TINY, "out": str(tmp_path / "run"),
                                    "data": [str(data)]})).inputs
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "validation:" in line]
    assert len(notes) == 1 and notes[0].startswith("shardax train: note: " + note), err
    assert len(inputs.val) == (1 if val_tokens else 0)
    assert len(inputs.train.tokens) == size - (val_tokens or 0)


def test_bad_eval_flags_name_the_flag(tmp_path, small):
    """(The command-line forms, one line and exit 2: tests/test_cli_errors.py.)"""
    with pytest.raises(UsageError, match="--eval-every -1: must be >= 0"):
        check(TrainConfig(eval_every=-1))
    with pytest.raises(UsageError, match="--val-data .*fewer than one batch"):
        prepare(TrainConfig(**{**TINY, "out": str(tmp_path / "a"), "data": [str(small[0])],
                               "val_data": [str(_text(tmp_path / "v.txt", 100))]}))
