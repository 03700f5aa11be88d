"""Hugging Face ``datasets`` folders as ``--data`` entries (`shardax.data.dataset_dirs`,
read by `shardax.data.readers`): the records of a save_to_disk folder (one ``Dataset``, a
``DatasetDict`` with two splits) and of a folder of Parquet shards equal what was written, in
order; the split and the field are in the token cache's key; a tiny ``shardax train`` runs on
a save_to_disk folder; a folder in neither layout, a missing split and a missing field are
one line, exit 2. Fixtures are written with pyarrow in save_to_disk's exact layout (and, when
``datasets`` is installed, by ``save_to_disk`` itself)."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _cli import assert_one_line_error, read_metrics, run_cli
from _reference import TINY_TRAIN

from shardax.data.chat import chat_records, is_chat_file
from shardax.data.lm_data import open_data
from shardax.data.readers import DataError, list_data_files, read_pieces, read_records
from shardax.train.loop import TrainConfig, train

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TRAIN = [f"train document {i} " * (i % 5 + 1) for i in range(60)]
VALID = [f"held-out document {i} " * 3 for i in range(9)]


def _save_to_disk(folder: Path, texts: list[str], shards: int = 1, batch: int = 7,
                  extra: dict | None = None) -> Path:
    """A folder as ``Dataset.save_to_disk`` writes it: Arrow IPC stream shards
    ``data-0000i-of-0000n.arrow`` (record batches of ``batch`` rows), ``state.json`` listing
    them, ``dataset_info.json``."""
    folder.mkdir(parents=True)
    table = pa.table({"text": texts, "id": list(range(len(texts))), **(extra or {})})
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    cuts = np.linspace(0, len(texts), shards + 1).astype(int)
    for name, a, b in zip(names, cuts[:-1], cuts[1:]):
        with pa.OSFile(str(folder / name), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            for record_batch in table.slice(a, b - a).to_batches(max_chunksize=batch):
                writer.write_batch(record_batch)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    features = {k: {"dtype": "string" if k == "text" else "int64", "_type": "Value"}
                for k in table.column_names}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A save_to_disk Dataset (2 shards), a DatasetDict (train, validation) and a hub-layout
    Parquet-shard folder (2 train shards, 1 validation shard, README.md)."""
    root = tmp_path_factory.mktemp("datasets_on_disk")
    single = _save_to_disk(root / "single", TRAIN, shards=2)
    ddict = root / "ddict"
    _save_to_disk(ddict / "train", TRAIN)
    _save_to_disk(ddict / "validation", VALID)
    (ddict / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    hub = root / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nconfigs: []\n---\n# a dataset card, not data\n")
    for name, texts in (("train-00000-of-00002", TRAIN[:25]), ("train-00001-of-00002",
                        TRAIN[25:]), ("validation-00000-of-00001", VALID)):
        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}),
                       hub / "data" / f"{name}.parquet", row_group_size=10)
    return single, ddict, hub


def _texts(path, split="train", field="text") -> list[str]:
    return [p.text for f in list_data_files([path], split=split) for p in read_pieces(f, field)]


def test_save_to_disk_folders_read_as_written_in_order(folders):
    single, ddict, _ = folders
    assert _texts(single) == TRAIN and _texts(single, "test") == TRAIN  # one split: whole
    assert [f.path.name for f in list_data_files([single])] == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert _texts(ddict) == TRAIN and _texts(ddict, "validation") == VALID
    assert _texts(ddict / "validation") == VALID  # a DatasetDict's split folder is a Dataset
    assert [r["id"] for f in list_data_files([ddict]) for r in read_records(f, ["id"])] == \
        list(range(len(TRAIN)))


def test_parquet_shard_folders_split_as_datasets_names_them(folders, tmp_path):
    _, _, hub = folders
    assert _texts(hub) == TRAIN and _texts(hub, "validation") == VALID  # README.md skipped
    # <split>/ folders and keywords in file names, as datasets' default patterns
    for layout in ({"train/0.parquet": TRAIN[:30], "train/1.parquet": TRAIN[30:],
                    "dev/0.parquet": VALID},
                   {"wiki-train-0.parquet": TRAIN[:30], "wiki-train-1.parquet": TRAIN[30:],
                    "wiki_val.parquet": VALID}):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, texts in layout.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"text": texts}), folder / name)
        assert _texts(folder) == TRAIN and _texts(folder, "validation") == VALID
        with pytest.raises(DataError, match=r"no split 'test' \(its splits: train, "
                                            r"validation\); choose one with --data-split"):
            list_data_files([folder], split="test")
    # no file named for a split: one split, read whole (as before datasets folders)
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(pa.table({"text": TRAIN}), plain / "part-0.parquet")
    assert _texts(plain, "validation") == TRAIN


def test_the_split_and_the_field_are_in_the_token_cache_key(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDAX_CACHE_DIR", str(tmp_path))
    _, ddict, hub = folders
    train, valid = open_data([ddict]), open_data([ddict], split="validation")
    assert len(train) == sum(len(t) + 1 for t in map(str.encode, TRAIN))  # + eos each
    assert len(valid) == sum(len(t) + 1 for t in map(str.encode, VALID))
    assert len(open_data([hub])) == len(train)
    assert len(list((tmp_path / "tokens").iterdir())) == 3  # ddict train, validation; hub
    open_data([ddict])  # the same split again: no new cache
    assert len(list((tmp_path / "tokens").iterdir())) == 3
    single = _save_to_disk(tmp_path / "two_fields", TRAIN,
                           extra={"other": [t + "!" for t in TRAIN]})
    assert len(open_data([single], text_field="other")) != len(open_data([single]))
    assert len(list((tmp_path / "tokens").iterdir())) == 5


def test_chat_records_from_a_datasets_folder(tmp_path):
    chats = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]
             for i in range(3)]
    folder = _save_to_disk(tmp_path / "chat", ["unused"] * 3, extra={"messages": chats})
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not chat")
    assert is_chat_file(folder) and not is_chat_file(tmp_path / "plain")
    got = list(chat_records(folder))
    assert [m for _, m in got] == chats
    assert got[1][0] == f"{folder / 'data-00000-of-00001.arrow'}:2"


def test_what_save_to_disk_itself_writes_reads_the_same(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": TRAIN, "id": list(range(len(TRAIN)))})
    ds.save_to_disk(str(tmp_path / "single"), num_shards=2)
    datasets.DatasetDict({"train": ds, "validation": datasets.Dataset.from_dict(
        {"text": VALID})}).save_to_disk(str(tmp_path / "ddict"))
    assert _texts(tmp_path / "single") == TRAIN
    assert _texts(tmp_path / "ddict") == TRAIN
    assert _texts(tmp_path / "ddict", "validation") == VALID


def test_train_on_a_save_to_disk_folder(folders, tmp_path):
    _, ddict, _ = folders
    out = tmp_path / "run"
    # TINY_TRAIN's programs: the persistent compilation cache holds them from other tests
    # docs/data.md: --data reads the train split, --val-data the validation split
    train(TrainConfig(out=str(out), data=[str(ddict)], val_data=[str(ddict)],
                      **{**TINY_TRAIN, "steps": 2, "eval_every": 100}))
    records = read_metrics(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert np.isfinite([r["loss"] for r in records if "loss" in r]).all()
    assert np.isfinite([r["val_loss"] for r in records if "val_loss" in r]).all()
    assert any("val_loss" in r for r in records)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["data_split"], saved["val_split"]) == ("train", "validation")


def test_bad_datasets_folders_are_one_line_exit_2(folders, tmp_path, monkeypatch, capsys):
    """One case as users meet it, in a subprocess (before JAX starts); the others through the
    same ``main`` in this process (each subprocess pays the CLI's start-up)."""
    from shardax.cli import main

    _, ddict, hub = folders
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "wiki-train.arrow").write_bytes(b"\xff" * 64)  # datasets' cache, not save_to_disk
    (cache / "dataset_info.json").write_text("{}")
    garbled = _save_to_disk(tmp_path / "garbled_dataset", TRAIN[:3])
    (garbled / "data-00000-of-00001.arrow").write_bytes(b"\x00" * 64)
    proc = run_cli("train", "--steps", "1", "--out", tmp_path / "run", "--data", ddict,
                   "--data-split", "test")
    assert_one_line_error(proc, "train", f"--data {ddict}: ", "no split 'test'",
                          "(its splits: train, validation)", "--data-split")
    cases = {
        "neither": (["--data", cache], [f"--data {cache}: ", "wiki-train.arrow",
                                        "neither a datasets save_to_disk folder nor a folder "
                                        "of Parquet shards"]),
        "val_split": (["--data", hub, "--val-data", hub, "--val-split", "dev"],
                      [f"--val-data {hub}: ", "no split 'dev'", "train, validation"]),
        "field": (["--data", f"{ddict}:0.5,{hub}:0.5", "--text-field", "body"],
                  [f"--data {ddict}: ", "no column 'body' in its split 'train'",
                   "['text', 'id']", "--text-field"]),
        "garbled": (["--data", garbled], [f"--data {garbled}/data-00000-of-00001.arrow: ",
                                          "not a readable Arrow stream file"]),
    }
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() rewrites it
    for name, (args, needles) in cases.items():
        code = main(["train", "--steps", "1", "--out", str(tmp_path / name), *map(str, args)])
        err = capsys.readouterr().err
        assert_one_line_error(subprocess.CompletedProcess([], code, "", err), "train",
                              *needles)
        assert not (tmp_path / name).exists()
    assert not (tmp_path / "run").exists()


def test_eval_data_split_of_a_save_to_disk_folder(folders, observed_run, tmp_path,
                                                  monkeypatch, capsys):
    """``shardax eval --data FOLDER --data-split SPLIT`` scores that split (validation by
    default) exactly as a .jsonl file of its records; a split the folder lacks is one line
    naming the folder and its splits, exit 2."""
    from shardax.cli import main
    from shardax.train.evaluate import evaluate

    _, ddict, _ = folders
    _, out, _ = observed_run
    same = tmp_path / "validation.jsonl"
    same.write_text("".join(json.dumps({"text": t}) + "\n" for t in VALID))
    split, plain = evaluate(str(out), [str(ddict), str(same)], seq_len=32)  # one load
    assert split["tokens"] == sum(len(t.encode()) + 1 for t in VALID) - 1  # + eos each
    assert split["nll"] == plain["nll"] and split["tokens"] == plain["tokens"]
    assert split["bytes"] == plain["bytes"] == sum(len(t.encode()) for t in VALID)
    # as users meet it, through the CLI's main in this process (a subprocess pays its start-up)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() rewrites it
    code = main(["eval", "--out", str(out), "--data", str(ddict), "--data-split", "test"])
    proc = subprocess.CompletedProcess([], code, "", capsys.readouterr().err)
    assert_one_line_error(proc, "eval", f"--data {ddict}: ", "no split 'test'",
                          "(its splits: train, validation)", "--data-split")
