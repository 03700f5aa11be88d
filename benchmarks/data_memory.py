"""Host memory of the data pipeline against corpus size (peak RSS, read from /proc).

    python benchmarks/data_memory.py                         # 2 GB token file, 1 GB jsonl
    python benchmarks/data_memory.py --token-mb 320 --jsonl-mb 160 --json out.json
    python benchmarks/data_memory.py --dataset-mb 20 80      # datasets folders of 20, 80 MB

Measurements in this process, each from a fresh peak (``/proc/self/clear_refs``), as the
rise of the peak RSS (``VmHWM``) over the RSS before it:

- **token file**: `open_data` on a ``.u16`` token file (its ids sampled against the
  vocabulary), 50 training batches of 32 x 1024 tokens from windows spread over the whole
  file, and the validation batches;
- **encode**: `open_data` on a ``.jsonl`` corpus: read, tokenized by 2 worker threads and
  written to the token cache, then sampled as above;
- **memory map** (why shardax reads windows with ``pread``): the same windows read through
  ``np.memmap``; with large page-cache folios each window maps up to 2 MiB into the process;
- **control**: the first quarter of the token file read into memory: must rise by about a
  quarter of the file, which shows the measurement sees a pipeline that holds the corpus;
- **datasets folders**, at each ``--dataset-mb`` size: a ``save_to_disk`` ``DatasetDict``
  (Arrow stream shards, read with pyarrow) and a hub-layout folder of Parquet shards, each
  tokenized into the cache as the jsonl corpus is, then sampled: the rise must not grow with
  the size.

Files go to a temporary directory (``--dir`` to choose), the token cache too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_BLOCK = 1 << 22  # tokens per write while generating files (8 MiB of uint16)


def _status() -> dict[str, float]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) / 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def _peak_rise(fn) -> tuple[float, float, object]:
    """(peak RSS rise in MB, seconds, result) of ``fn()``."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current RSS
    before = _status()["VmRSS"]
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return _status()["VmHWM"] - before, seconds, result


def _write_token_file(path: Path, mb: int) -> None:
    block = (np.arange(_BLOCK, dtype=np.uint32) * 7919 % 251).astype(np.uint16)
    with open(path, "wb") as f:
        for _ in range(mb * (1 << 20) // block.nbytes):
            f.write(block.tobytes())


def _write_jsonl(path: Path, mb: int) -> None:
    words = "the data pipeline reads windows of tokens from a memory map".split()
    doc = " ".join(words[i % len(words)] for i in range(11_000))  # ~64 KB
    line = (json.dumps({"text": doc, "id": 0}) + "\n").encode()
    with open(path, "wb") as f:
        for _ in range(-(-mb * (1 << 20) // len(line))):  # at least mb MiB
            f.write(line)


def _documents(mb: int, rows: int = 16):
    """Lists of ``rows`` documents of ~64 KB, at least ``mb`` MiB in all."""
    words = "the data pipeline reads record batches of a datasets folder".split()
    doc = " ".join(words[i % len(words)] for i in range(11_000))
    for _ in range(-(-mb * (1 << 20) // (len(doc) * rows))):
        yield [doc] * rows


def _write_dataset_folders(directory: Path, mb: int) -> tuple[Path, Path]:
    """A save_to_disk DatasetDict (train split in 4 Arrow stream shards) and a hub-layout
    Parquet-shard folder (4 train shards), each about ``mb`` MiB, written batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    saved, hub = directory / f"saved_{mb}", directory / f"hub_{mb}"
    (saved / "train").mkdir(parents=True)
    (hub / "data").mkdir(parents=True)
    schema = pa.schema([("text", pa.string())])
    batches = list(_documents(mb))
    shards = [batches[i::4] for i in range(4)]
    names = [f"data-{i:05d}-of-00004.arrow" for i in range(4)]
    for name, shard in zip(names, shards):
        with pa.OSFile(str(saved / "train" / name), "wb") as sink, \
                pa.ipc.new_stream(sink, schema) as writer:
            for docs in shard:
                writer.write_batch(pa.record_batch([pa.array(docs)], schema=schema))
    (saved / "train" / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n in names], "_split": None}))
    (saved / "train" / "dataset_info.json").write_text(json.dumps(
        {"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    for i, shard in enumerate(shards):
        with pq.ParquetWriter(hub / "data" / f"train-{i:05d}-of-00004.parquet", schema,
                              compression="none", use_dictionary=False) as w:  # MB = text MB
            for docs in shard:
                w.write_batch(pa.record_batch([pa.array(docs)], schema=schema))
    return saved, hub


def _folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def _sample(stream, data) -> int:
    batches = data.TokenBatches(stream, seq_len=1024, batch_size=32, seed=0)
    steps = np.linspace(0, max(batches.windows // 32 - 1, 0), 50).astype(int)
    total = sum(int(batches.batch(int(s))[0][0, 0]) for s in steps)
    _, val = data.split_tokens(stream)
    return total + len(data.val_batches(val, 1024, 32, num_batches=4))


def _memmap_windows(path: Path) -> int:
    """The windows `_sample` reads (50 x 32 spread over the file), through a memory map."""
    tokens = np.memmap(path, np.uint16, mode="r")
    starts = np.linspace(0, len(tokens) - 1025, 50 * 32).astype(np.int64)
    return sum(int(tokens[s:s + 1025].max()) for s in starts)


def measure(directory: Path, token_mb: int, jsonl_mb: int, dataset_mb: list[int] = ()) -> dict:
    os.environ["SHARDAX_CACHE_DIR"] = str(directory / "cache")
    from shardax.data import lm_data as data

    tokens, jsonl = directory / "corpus.u16", directory / "corpus.jsonl"
    _write_token_file(tokens, token_mb)
    _write_jsonl(jsonl, jsonl_mb)
    # Warm up: imports, the thread pool, numpy's and grain's first calls.
    (directory / "warm.txt").write_text("warm up " * 400_000)  # 3 MB: enough for val
    _sample(data.open_data([directory / "warm.txt"]), data)
    baseline = _status()["VmRSS"]

    token_rise, token_s, _ = _peak_rise(lambda: _sample(data.open_data([tokens]), data))
    encode_rise, encode_s, _ = _peak_rise(
        lambda: _sample(_encode(jsonl), data))
    memmap_rise, _, _ = _peak_rise(lambda: _memmap_windows(tokens))
    file = data.open_data([tokens]).segments[0]
    control_rise, _, _ = _peak_rise(lambda: int(file[: len(file) // 4].sum(dtype=np.int64)))
    token_bytes, jsonl_bytes = tokens.stat().st_size, jsonl.stat().st_size
    datasets = []
    for mb in dataset_mb:
        for kind, folder in zip(("save_to_disk", "parquet shards"),
                                _write_dataset_folders(directory, mb)):
            rise, seconds, _ = _peak_rise(lambda f=folder: _sample(_encode(f), data))
            datasets.append({"kind": kind, "mb": _folder_mb(folder), "peak_rise_mb": rise,
                             "mb_per_s": _folder_mb(folder) / seconds})
    return {
        "datasets": datasets,
        "token_file_mb": token_bytes / 2**20,
        "jsonl_mb": jsonl_bytes / 2**20,
        "token_file_peak_rise_mb": token_rise,
        "encode_peak_rise_mb": encode_rise,
        "memmap_peak_rise_mb": memmap_rise,
        "control_peak_rise_mb": control_rise,
        "control_expected_mb": token_bytes / 4 / 2**20,
        "encode_s": encode_s,
        "encode_mb_per_s": jsonl_bytes / 2**20 / encode_s,
        "token_file_s": token_s,
        "baseline_rss_mb": baseline,
    }


def _encode(jsonl: Path):
    """`open_data` of a jsonl file (or a datasets folder's train split) with 2 encoding
    threads (whatever the core count)."""
    from shardax.data.encode import encode_files
    from shardax.data.lm_data import TokenStream
    from shardax.data.readers import list_data_files
    from shardax.data.tokenizer import ByteTokenizer

    return TokenStream([encode_files(list_data_files([jsonl]), ByteTokenizer(), workers=2)])


def render(r: dict) -> str:
    """Section 7 of RESULTS.md."""
    rows = [
        ("token file, 50 batches of 32 x 1,024 spread over it + validation",
         r["token_file_mb"], r["token_file_peak_rise_mb"]),
        (f"jsonl tokenized into the cache ({r['encode_mb_per_s']:.0f} MB/s, 2 threads), "
         "then sampled", r["jsonl_mb"], r["encode_peak_rise_mb"]),
        ("the same windows as row 1 through np.memmap (avoided, see below)", r["token_file_mb"],
         r["memmap_peak_rise_mb"]),
        ("control: a quarter of the token file read into memory", r["token_file_mb"],
         r["control_peak_rise_mb"]),
        *((f"datasets {d['kind']} folder tokenized into the cache ({d['mb_per_s']:.0f} MB/s, "
           "2 threads), then sampled", d["mb"], d["peak_rise_mb"])
          for d in r.get("datasets", [])),
    ]
    return "\n".join([
        "## 8. Data pipeline: host memory against corpus size",
        "",
        "`benchmarks/data_memory.py`: rise of the peak RSS (`VmHWM`, reset through "
        "`/proc/self/clear_refs`) over the RSS before each step, in one process "
        f"(baseline {r['baseline_rss_mb']:.0f} MB after imports). Goal: a corpus 10x larger "
        "than the memory a run is allowed must not raise RSS, i.e. rise / corpus <= 0.1.",
        "",
        "| what | corpus MB | peak RSS rise MB | rise / corpus |",
        "|---|---|---|---|",
        *(f"| {what} | {size:,.0f} | {rise:,.1f} | {rise / size:.4f} |"
          for what, size, rise in rows),
        "",
        "Shardax reads windows with `os.pread`; through a memory map each touched window maps "
        "a large page-cache folio (up to 2 MiB) into the process, so RSS grows with the part "
        "of the corpus training has visited (row 3). The control shows the measurement sees "
        "memory that holds the corpus. Hugging Face `datasets` folders (the last rows, one per "
        "kind and size) are read a record batch at a time (Parquet without pyarrow's "
        "pre-buffering, which holds a file's column data): the rise does not grow with the "
        "size.",
        "",
    ])


def summary(r: dict) -> list[dict]:
    from _common import goal_row

    return [goal_row("8 data memory", f"peak RSS rise / {what} size", rise / size, "≤ 0.1",
                     rise / size <= 0.1)
            for what, size, rise in (("token file", r["token_file_mb"],
                                      r["token_file_peak_rise_mb"]),
                                     ("jsonl corpus (tokenizing)", r["jsonl_mb"],
                                      r["encode_peak_rise_mb"]))] + _flat_rows(r)


def _flat_rows(r: dict) -> list[dict]:
    """Per datasets folder kind: the peak RSS rise's growth over the corpus's growth from the
    smallest to the largest size (flat: ~0)."""
    from _common import goal_row

    rows = []
    for kind in dict.fromkeys(d["kind"] for d in r.get("datasets", [])):
        sizes = sorted((d for d in r["datasets"] if d["kind"] == kind), key=lambda d: d["mb"])
        if len(sizes) >= 2:
            small, large = sizes[0], sizes[-1]
            growth = (large["peak_rise_mb"] - small["peak_rise_mb"]) / (large["mb"] - small["mb"])
            rows.append(goal_row("8 data memory", f"peak RSS rise growth / corpus growth, "
                                 f"datasets {kind} folder ({small['mb']:.0f} to "
                                 f"{large['mb']:.0f} MB)", growth, "≤ 0.1", growth <= 0.1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--token-mb", type=int, default=2048)
    parser.add_argument("--jsonl-mb", type=int, default=1024)
    parser.add_argument("--dataset-mb", type=int, nargs="*", default=[20, 80],
                        help="sizes of the datasets folders (none: no datasets rows)")
    parser.add_argument("--dir", default=None, help="where to write the generated corpus")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="shardax-data-memory-") as tmp:
        result = measure(Path(tmp), args.token_mb, args.jsonl_mb, args.dataset_mb)
    for key, value in result.items():
        print(f"{key:>26}: {value:,.1f}" if key != "datasets" else
              "\n".join(f"{d['kind']:>17} {d['mb']:6,.0f} MB: {d['peak_rise_mb']:,.1f}"
                        for d in value))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
