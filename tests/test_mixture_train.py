"""Weighted ``--data`` mixtures as training reads them (`shardax.data.mixture_data`): each
source's share of the tokens follows its weight, the batch of a step is the same on 1 and 2
processes and across a resume, a resume with other weights keeps every source's position, and
``data/tokens/<source>`` is in every metrics record. The schedule itself is tested in
test_mixture.py; bad ``--data`` entries and a resume that drops a source in
test_cli_errors.py."""

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from _cli import committed_steps, read_metrics, stopped_at
from _reference import TINY_TRAIN

from shardax.data.lm_data import TokenStream
from shardax.data.mixture import Mixture
from shardax.data.mixture_data import MixtureBatches
from shardax.train.config import check
from shardax.train.loop import TrainConfig, prepare, train
from shardax.train.rundir import RunDir

TINY = {**TINY_TRAIN, "eval_every": 100}  # val_loss at the last step

# Source "low" holds tokens 1..99, "high" 150..249: a token says which source it came from.
LOW, HIGH = (np.random.default_rng(0).integers(1, 100, 5_000).astype(np.uint16),
             np.random.default_rng(1).integers(150, 250, 3_000).astype(np.uint16))


def _batches(weights=(0.7, 0.3), **kw) -> MixtureBatches:
    args = dict(seq_len=4, batch_size=8, seed=5)
    return MixtureBatches([("low/", TokenStream([LOW])), ("high.u16", TokenStream([HIGH]))],
                          list(weights), **{**args, **kw})


def test_token_shares_follow_the_weights_over_2000_steps():
    data = _batches(batch_size=2)  # each window read costs a grain index shuffle: keep it small
    inputs = np.stack([data.batch(t)[0] for t in range(2000)])
    low = int((inputs < 100).sum())
    shares = np.array([low, inputs.size - low]) / inputs.size
    np.testing.assert_allclose(shares, [0.7, 0.3], atol=0.02)
    # the counts the metrics log are the tokens the batches held
    assert data.tokens_taken(2000) == {"data/tokens/low": low,
                                       "data/tokens/high.u16": inputs.size - low}


def test_the_batch_is_the_same_on_1_and_2_processes():
    one = _batches()
    two = [_batches(process_index=p, process_count=2) for p in range(2)]
    for step in (0, 3, 700):
        whole = one.batch(step)
        for field in range(2):
            np.testing.assert_array_equal(
                np.concatenate([part.batch(step)[field] for part in two]), whole[field])


def test_restore_continues_or_reweights_from_every_source_position():
    straight = _batches()
    saved = json.loads(json.dumps(straight.state(100)))
    assert saved["positions"] == {"low": 560, "high.u16": 240}
    same = _batches().restore(saved)
    for step in (100, 101, 250):
        np.testing.assert_array_equal(same.batch(step)[0], straight.batch(step)[0])
    said = []
    changed = _batches((0.2, 0.8), log=said.append).restore(saved)
    assert len(said) == 1 and "low 0.2 (was 0.7), high.u16 0.8 (was 0.3)" in said[0], said
    # each source goes on from its saved position: nothing it gave before step 100 again
    sources, positions = np.concatenate(
        [np.stack(changed.mixture.rows(t, 8)) for t in range(100, 200)], axis=1)
    for s, name in enumerate(("low", "high.u16")):
        mine = np.sort(positions[sources == s])
        np.testing.assert_array_equal(mine, saved["positions"][name] + np.arange(len(mine)))
    assert changed.positions(200) == {"low": 560 + 160, "high.u16": 240 + 640}
    with pytest.raises(ValueError, match="--data: the mixture's sources"):
        MixtureBatches([("low/", TokenStream([LOW]))], [1.0], 4, 8, seed=5).restore(saved)


# ----------------------------------------------------------------------------- training


def _text(path: Path, alphabet: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    path.write_text("".join(rng.choice(list(alphabet), 12_000)))
    return str(path)


def _data_state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / str(step) / "extra" / "metadata").read_text())["data"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step run on a 0.7/0.3 mixture (checkpoints at 2 and 4), the same stopped at step 2
    and resumed, and resumed with weights 0.2/0.8."""
    root = tmp_path_factory.mktemp("mixture_train")
    a, b = _text(root / "web.txt", "abcdefgh ", 0), _text(root / "code.txt", "XYZ0123\n", 1)
    config = dict(TINY, mesh="fsdp=-1")
    straight = root / "straight"
    train(TrainConfig(out=str(straight), data=[f"{a}:0.7,{b}:0.3"], **config))
    resumed = stopped_at(straight, root / "resumed", 2)
    train(TrainConfig(out=str(resumed), resume=True, data=[f"{a}:0.7,{b}:0.3"], **config))
    reweighted, said = stopped_at(straight, root / "reweighted", 2), io.StringIO()
    with contextlib.redirect_stdout(said):
        train(TrainConfig(out=str(reweighted), resume=True, data=[f"{a}:0.2", f"{b}:0.8"],
                          **config))
    return straight, resumed, reweighted, said.getvalue()


@pytest.fixture(scope="module")
def revalidated(runs):
    """The straight run stopped at step 2 and resumed with ``--val-data`` it did not have (it
    held out each source's last tenth): two files of 2 and 1 full batches (8 x 32 tokens;
    the byte tokenizer adds an end-of-text token), in the sources' alphabets."""
    straight = runs[0]
    root = straight.parent
    val = [_text(root / "web_val.txt", "abcdefgh ", 2),
           _text(root / "code_val.txt", "XYZ0123\n", 3)]
    for path, n in zip(val, (2, 1)):  # n batches of windows of 32 (+1) tokens exactly
        Path(path).write_text(Path(path).read_text()[:n * 8 * 32])
    out = stopped_at(straight, root / "revalidated", 2)
    train(TrainConfig(out=str(out), resume=True, data=[f"{root}/web.txt:0.7,{root}/code.txt:0.3"],
                      val_data=val, **dict(TINY, mesh="fsdp=-1")))
    return out, val


def test_resume_with_new_val_data_trains_the_same_batches(runs, revalidated):
    """--val-data added on resume (issue 37): the training batches and losses are those of the
    straight run, bit for bit; the val loss is on the new files, per file too, each equal to
    ``shardax eval`` of that file alone on the checkpoint, their token-weighted mean val_loss."""
    from shardax.train.evaluate import evaluate

    straight, (out, val) = runs[0], revalidated
    want, got = read_metrics(straight), read_metrics(out)
    for key in ("data_hash", "loss", "grad_norm", "data/tokens/web.txt"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert _data_state(out, 4) == _data_state(straight, 4)
    last = got[-1]
    assert last["val_loss"] != want[-1]["val_loss"]  # held-out tenths before, new files now
    alone = evaluate(str(out), val, seq_len=32)
    assert [r["tokens"] for r in alone] == [2 * 8 * 32, 8 * 32]
    for name, r in zip(("web_val.txt", "code_val.txt"), alone):
        np.testing.assert_allclose(last[f"val_loss/{name}"], r["loss"], rtol=2e-6)
    weighted = (2 * last["val_loss/web_val.txt"] + last["val_loss/code_val.txt"]) / 3
    np.testing.assert_allclose(last["val_loss"], weighted, rtol=1e-12)
    assert not any(k.startswith("val_loss/") for r in want for k in r)  # one source: none


def test_val_data_changed_on_resume_keeps_a_plain_runs_training_data(tmp_path):
    """Without weights too: the run that held out the last tenth of --data keeps training on
    the rest when resumed with --val-data, and the run started with --val-data keeps training
    on all of --data when resumed without it (each once refused as 'data state mismatch for
    'num_tokens''); the new validation batches are those of the new --val-data."""
    data, val = _text(tmp_path / "web.txt", "abcdefgh ", 0), _text(tmp_path / "v.txt", "xy", 1)
    held = check(TrainConfig(out=str(tmp_path / "a"), data=[data], **TINY))
    given = dataclasses.replace(held, val_data=[val])
    for started, resumed in ((held, given), (given, dataclasses.replace(given, val_data=[]))):
        fresh = prepare(started, RunDir(Path(started.out)))
        again = prepare(dataclasses.replace(resumed, resume=True),
                        RunDir(Path(started.out), saved=started))
        assert again.inputs.train.state() == fresh.inputs.train.state()
        np.testing.assert_array_equal(again.inputs.train.batch(3)[0],
                                      fresh.inputs.train.batch(3)[0])
    assert len(fresh.inputs.val) == 4 and not again.inputs.val  # none held out: no val loss
    first = prepare(given, RunDir(Path(given.out))).inputs.val[0][0]
    assert set(np.unique(first)) <= set(b"xy")  # from v.txt


def test_resume_is_bit_identical_and_logs_each_source_tokens(runs):
    straight, resumed, _, _ = runs
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and committed_steps(resumed) == [2, 4]
    for key in ("data_hash", "loss", "val_loss", "data/tokens/web.txt",
                "data/tokens/code.txt"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert len({r["data_hash"] for r in want}) == 4  # the hash tells steps apart
    tokens = [(r["data/tokens/web.txt"], r["data/tokens/code.txt"]) for r in want]
    assert tokens[0] == (6 * 32, 2 * 32)  # 8 rows of 32 tokens, 0.7 / 0.3 rounded per step
    assert sum(tokens[-1]) == 4 * 8 * 32
    assert _data_state(resumed, 4) == _data_state(straight, 4)


def test_resume_with_other_weights_keeps_every_source_position(runs):
    straight, _, reweighted, said = runs
    assert "mixture weights from step 2: web.txt 0.2 (was 0.7), code.txt 0.8 (was 0.3)" in said
    before, after = _data_state(straight, 2), _data_state(reweighted, 4)
    assert after["weights"] == {"web.txt": 0.2, "code.txt": 0.8}
    # the steps before the change keep their schedule; after it, each source starts from its
    # position at step 2 (its samples there are not read again)
    segments = after["mixture"]["segments"]
    assert segments[0] == before["mixture"]["segments"][0]
    assert segments[1]["start_row"] == 2 * 8
    assert segments[1]["counts"] == list(before["positions"].values()) == [12, 4]
    sources, positions = np.concatenate(
        [np.stack(Mixture.from_state(after["mixture"]).rows(t, 8)) for t in (2, 3)], axis=1)
    for s, start in enumerate(segments[1]["counts"]):
        np.testing.assert_array_equal(np.sort(positions[sources == s]),
                                      start + np.arange((sources == s).sum()))
    assert after["positions"] == {"web.txt": 12 + 4, "code.txt": 4 + 12}
    logged = read_metrics(reweighted)
    assert [(r["data/tokens/web.txt"], r["data/tokens/code.txt"]) for r in logged][1:] == [
        (12 * 32, 4 * 32), (14 * 32, 10 * 32), (16 * 32, 16 * 32)]
