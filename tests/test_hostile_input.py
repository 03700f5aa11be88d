"""Hostile and damaged input, met the way users meet it (``shardax ...`` in a subprocess): each
case is one line on stderr naming the file or flag and what is wrong, exit 2, no run directory
written, nothing outside the model directory read, and no hang or large allocation (a case that
hangs or allocates runs into the subprocess time-out instead).

The Hugging Face cases damage copies of one tiny sharded directory (tests/fixtures/hf/llama_gqa:
six safetensors files and an index) and fail before anything is compiled; they run side by
side. The data cases train a few steps of llama-tiny.
"""

import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from _cli import (
    assert_one_line_error,
    cli_command,
    cli_env,
    committed_steps,
    run_cli,
    run_cli_batch,
)

from shardax import hf
from shardax.data.lm_data import _ID_CHECK_BLOCK, _ID_CHECK_BLOCKS, _ID_CHECK_HEAD
from shardax.hf.files import tensor_index, write_safetensors

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama_gqa"
SHARD = "model-{:05d}-of-00006.safetensors"
INDEX = "model.safetensors.index.json"
TIMEOUT_S = 240
TINY = ["--steps", "40", "--batch-size", "8", "--seq-len", "32", "--optimizer", "sgd",
        "--lr", "0.03", "--log-every", "1", "--eval-every", "100", "--devices", "2"]


def shardax(*args, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout)


one_line_error = assert_one_line_error  # the CLI's contract, tests/_cli.py


# ----------------------------------------------------------------------------- damage


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path: Path, change) -> None:
    """Rewrites a safetensors file's header through ``change(header)``, data unchanged."""
    header, data = _header(path)
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _outside_copy(d: Path) -> Path:
    """A valid safetensors file next to (outside) the model directory ``d``."""
    out = d.parent / f"{d.name}-elsewhere.safetensors"
    shutil.copy(d / SHARD.format(1), out)
    return out


def index_parent(d):
    _outside_copy(d)
    _edit_json(d / INDEX, lambda v: v["weight_map"].__setitem__(
        "model.embed_tokens.weight", f"../{d.name}-elsewhere.safetensors"))


def index_absolute(d):
    _edit_json(d / INDEX, lambda v: v["weight_map"].__setitem__("model.embed_tokens.weight",
                                                                "/etc/passwd"))


def symlink_out(d):
    outside = _outside_copy(d)
    (d / SHARD.format(1)).unlink()
    (d / SHARD.format(1)).symlink_to(outside)


def header_length_2_60(d):
    p = d / SHARD.format(1)
    p.write_bytes(struct.pack("<Q", 2**60) + p.read_bytes()[8:])


def overlapping_offsets(d):  # up_proj reads gate_proj's bytes (both [64, 32] F32)
    _rewrite(d / SHARD.format(4), lambda h: h["model.layers.1.mlp.up_proj.weight"].__setitem__(
        "data_offsets", h["model.layers.1.mlp.gate_proj.weight"]["data_offsets"]))


def dtype_disagrees(d):  # an F32 tensor's bytes announced as F16
    _rewrite(d / SHARD.format(1), lambda h: h["model.layers.0.self_attn.q_proj.weight"]
             .__setitem__("dtype", "F16"))


def offsets_past_end(d):
    p = d / SHARD.format(1)
    p.write_bytes(p.read_bytes()[:-100])


def weights_fifo(d):
    (d / SHARD.format(1)).unlink()
    os.mkfifo(d / SHARD.format(1))


def index_not_json(d):
    (d / INDEX).write_text("{not json")


def index_no_weight_map(d):
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}}))


def index_weight_map_list(d):
    (d / INDEX).write_text(json.dumps({"weight_map": ["model-00001-of-00006.safetensors"]}))


def extra_layer(d):  # the weights hold 2 layers, config.json says 1
    _edit_json(d / "config.json", _set("num_hidden_layers", 1))


def extra_tensor(d):
    p = d / SHARD.format(6)
    f = hf.SafetensorsFile(p)
    tensors = {n: f.read(n) for n in f.tensors}  # read before the file is rewritten
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(4, np.float32)
    write_safetensors(p, {n: (x.dtype, x.shape) for n, x in tensors.items()}, tensors.get)
    _edit_json(d / INDEX, lambda v: v["weight_map"].__setitem__(
        "model.layers.0.mlp.extra.weight", SHARD.format(6)))


def missing_tensor(d):
    _edit_json(d / INDEX, lambda v: v["weight_map"].pop("model.norm.weight"))


def layers_1e7(d):
    _edit_json(d / "config.json", _set("num_hidden_layers", 10**7))


def vocab_1e9(d):  # config.json and the header agree on 10**9 rows; the file holds 128
    _edit_json(d / "config.json", _set("vocab_size", 10**9))

    def claim(h):
        h["model.embed_tokens.weight"].update(shape=[10**9, 32],
                                              data_offsets=[0, 10**9 * 32 * 4])
    _rewrite(d / SHARD.format(1), claim)


def config_not_utf8(d):
    (d / "config.json").write_bytes(b'{"model_type": "llama\xff\xfe"}')


def config_fifo(d):
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")


def config_symlink_out(d):
    outside = d.parent / f"{d.name}-config.json"
    shutil.copy(d / "config.json", outside)
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(outside)


def config_array(d):
    (d / "config.json").write_text("[1, 2, 3]")


def config_no_hidden_size(d):
    _edit_json(d / "config.json", lambda c: c.pop("hidden_size"))


def config_string_hidden_size(d):
    _edit_json(d / "config.json", _set("hidden_size", "32"))


def config_zero_heads(d):
    _edit_json(d / "config.json", _set("num_attention_heads", 0))


def deepseek_grouped_routing(d):
    """Group-limited routing that cannot split the fixture's 4 experts (3 groups)."""
    cfg = json.loads((FIXTURE.parent / "deepseek_v3" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "n_group": 3, "topk_group": 1}))


# (damage, words the one line must contain; {d} is the damaged directory)
HF_CASES = [
    (index_parent, "{d}/model.safetensors.index.json: weight_map names '../", "outside"),
    (index_absolute, "weight_map names '/etc/passwd'", "outside the model directory"),
    (symlink_out, "weight_map names 'model-00001-of-00006.safetensors', which is a symlink to",
     "outside"),
    (header_length_2_60, "model-00001-of-00006.safetensors: damaged safetensors header",
     "length field says 1152921504606846976 bytes"),
    (overlapping_offsets, "model-00004-of-00006.safetensors", "overlap",
     "model.layers.1.mlp.gate_proj.weight"),
    (dtype_disagrees, "model.layers.0.self_attn.q_proj.weight", "F16[32, 32] takes 2048 bytes",
     "span 4096"),
    (offsets_past_end, "model-00001-of-00006.safetensors", "end past the data in the file"),
    (weights_fifo, "model-00001-of-00006.safetensors: is a FIFO, expected a regular file"),
    (index_not_json, "model.safetensors.index.json: not valid JSON"),
    (index_no_weight_map, "model.safetensors.index.json: no 'weight_map'"),
    (index_weight_map_list, "'weight_map' is a JSON list"),
    (extra_layer, "unexpected tensor 'model.layers.1.", "config.json says 1 layers"),
    (extra_tensor, "unexpected tensor 'model.layers.0.mlp.extra.weight'",
     "model-00006-of-00006.safetensors"),
    (missing_tensor, "Hugging Face tensor 'model.norm.weight' is missing"),
    (layers_1e7, "is missing from the checkpoint: config.json says 10000000 layers"),
    (vocab_1e9, "model.embed_tokens.weight", "data_offsets [0, 128000000000]",
     "end past the data in the file"),
    (config_not_utf8, "{d}/config.json: not UTF-8 text"),
    (config_fifo, "{d}/config.json: is a FIFO, expected a regular file"),
    (config_symlink_out, "{d}/config.json is a symlink to", "outside the model directory"),
    (config_array, "{d}/config.json: a JSON list, expected an object"),
    (config_no_hidden_size, "{d}/config.json: missing key 'hidden_size'"),
    (config_string_hidden_size, "{d}/config.json: hidden_size='32' must be a positive integer"),
    (config_zero_heads, "{d}/config.json: num_attention_heads=0 must be a positive integer"),
    (deepseek_grouped_routing, "n_group/topk_group=(3, 1) is not supported",
     "n_group must split the n_routed_experts=4 into groups"),
]


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    """Every `HF_CASES` damage applied to its own copy of the fixture directory, then
    ``shardax train --init-from hf:DIR`` run on each (one process for all, `run_cli_batch`):
    ``{name: (dir, run dir, result)}``."""
    root = tmp_path_factory.mktemp("hostile_hf")
    jobs = {}
    for damage, *_ in HF_CASES:
        d = root / damage.__name__
        shutil.copytree(FIXTURE, d)
        damage(d)
        jobs[damage.__name__] = (d, root / f"{damage.__name__}-run")
    results = run_cli_batch([["train", "--init-from", f"hf:{d}", "--out", run, "--steps", 1,
                              "--devices", 1] for d, run in jobs.values()], timeout=TIMEOUT_S)
    return {name: (*job, result) for (name, job), result in zip(jobs.items(), results)}


@pytest.mark.parametrize("damage, needles", [(c[0], c[1:]) for c in HF_CASES],
                         ids=[c[0].__name__ for c in HF_CASES])
def test_a_damaged_hf_dir_is_one_line_naming_it(damage, needles, hf_results):
    d, run, proc = hf_results[damage.__name__]
    one_line_error(proc, "train", f"--init-from hf:{d}: ",
                   *(n.format(d=d) for n in needles))
    assert not run.exists()


def test_generate_refuses_a_damaged_hf_dir_too(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    index_absolute(d)
    one_line_error(shardax("generate", "--from", f"hf:{d}", "--prompt", "x"), "generate",
                   f"--from hf:{d}: ", "'/etc/passwd'", "outside the model directory")


def test_a_tokenizer_json_fifo_is_refused_not_replaced_by_bytes(tmp_path):
    """A model directory whose tokenizer.json is a FIFO: train and generate refuse it in one
    line (they used to take it for absent and run on the byte tokenizer without a word)."""
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    os.mkfifo(d / "tokenizer.json")
    fifo = f"{d}/tokenizer.json: is a FIFO, expected a regular file"
    run = tmp_path / "run"
    one_line_error(shardax("train", "--init-from", f"hf:{d}", "--out", run, "--steps", 1,
                           "--seq-len", 32, "--devices", 1), "train", fifo)
    assert not run.exists()
    one_line_error(shardax("generate", "--from", f"hf:{d}", "--prompt", "x"), "generate", fifo)


def test_a_hub_cache_snapshot_of_symlinks_to_blobs_loads(tmp_path):
    """The Hugging Face hub cache links each snapshot file to ../../blobs/SHA: those symlinks
    leave the directory and are still followed (any other is refused, above)."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for k, p in enumerate(sorted(FIXTURE.glob("*.json")) + sorted(FIXTURE.glob("*.safetensors"))):
        shutil.copy(p, blobs / f"sha{k}")
        (snapshot / p.name).symlink_to(Path("..", "..", "blobs", f"sha{k}"))
    assert hf.load_config(snapshot) == hf.load_config(FIXTURE)
    assert set(tensor_index(snapshot)) == set(tensor_index(FIXTURE))


# ----------------------------------------------------------------------------- config files


BOMB = "\n".join([f'{chr(97)}: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'] + [
    f"{chr(97 + k)}: &{chr(97 + k)} [" + ", ".join([f"*{chr(96 + k)}"] * 9) + "]"
    for k in range(1, 12)]) + "\n"


def test_config_files_alias_bomb_fifo_and_yaml_1_2_numbers(tmp_path):
    """A billion-laughs YAML (9**11 strings once expanded) is refused at its first alias; a
    FIFO as --config is refused at once instead of waiting for a writer, a 2 MiB file unread;
    ``lr: 1e-3`` is a float (YAML 1.2), where YAML 1.1 (PyYAML's default) reads a string."""
    bomb, fifo, numbers = tmp_path / "bomb.yaml", tmp_path / "fifo.yaml", tmp_path / "lr.yaml"
    huge = tmp_path / "huge.json"
    bomb.write_text(BOMB)
    os.mkfifo(fifo)
    numbers.write_text("lr: 1e-3\nsteps: 3\nbatch_size: 8\n")
    huge.write_text('{"steps": 3, "x": "' + "x" * 2**21 + '"}')
    bombed, fifoed, printed, too_big = run_cli_batch(
        [["train", "--config", p, "--print-config"] for p in (bomb, fifo, numbers, huge)],
        timeout=120)
    one_line_error(bombed, "train", f"--config {bomb}: ", "YAML aliases", "line 2")
    one_line_error(fifoed, "train", f"--config {fifo}: is a FIFO, expected a regular file")
    one_line_error(too_big, "train", f"--config {huge}: ", "more than the 1048576 bytes")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = json.loads(printed.stdout)
    assert config["lr"] == 0.001 and isinstance(config["lr"], float) and config["steps"] == 3


# ----------------------------------------------------------------------------- data


def _clean_tokens(n: int) -> np.ndarray:
    return (np.arange(n) % 200).astype(np.uint16)  # byte tokenizer: ids < 256


def test_token_ids_past_the_vocabulary_after_the_first_batch(tmp_path):
    """Ids outside the vocabulary where the up-front sample does not look: found when a batch
    holds them, one line naming --data and the step, exit 2, earlier checkpoints kept."""
    n = _ID_CHECK_HEAD + 3 * _ID_CHECK_BLOCKS * _ID_CHECK_BLOCK
    tokens = _clean_tokens(n)
    sampled = np.zeros(n, bool)
    sampled[:_ID_CHECK_HEAD] = True
    starts = np.linspace(0, n - _ID_CHECK_BLOCK, _ID_CHECK_BLOCKS).astype(np.int64)
    for s in starts:
        sampled[s:s + _ID_CHECK_BLOCK] = True
    # one gap between sampled blocks, in the training split (the first 90%), poisoned
    gap = int(starts[np.searchsorted(starts, _ID_CHECK_HEAD) + 1]) + _ID_CHECK_BLOCK
    tokens[gap:gap + 3 * _ID_CHECK_BLOCK] = 300
    assert not sampled[gap:gap + 3 * _ID_CHECK_BLOCK].any() and gap < 0.85 * n
    data, run = tmp_path / "tokens.u16", tmp_path / "run"
    tokens.tofile(data)
    proc = shardax("train", *TINY, "--ckpt-every", 1, "--data", data, "--out", run)
    line = one_line_error(proc, "train", "--data: token id 300 at step ", "vocabulary of 256")
    step = int(line.split(" at step ")[1].split()[0])
    assert step >= 1, line  # past the first batch: the run trained before it met them
    assert committed_steps(run) and committed_steps(run)[-1] == step  # steps 1..step saved, kept


@pytest.fixture(scope="module")
def truncated_run(tmp_path_factory):
    """A run whose token file is truncated while it trains (after checkpoint 2 is committed):
    ``(run dir, process)``."""
    root = tmp_path_factory.mktemp("truncated")
    data, run = root / "tokens.u16", root / "run"
    _clean_tokens(1 << 19).tofile(data)
    proc = subprocess.Popen(cli_command("train", *TINY, "--ckpt-every", "2", "--data", data,
                                        "--out", run),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if (run / "checkpoints").exists() and committed_steps(run):
            break
        time.sleep(0.2)
    os.truncate(data, 1000)  # 500 tokens left of 524288
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return run, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_token_file_truncated_while_training(truncated_run):
    run, proc = truncated_run
    one_line_error(proc, "train", "tokens.u16: the file shrank while in use")
    assert committed_steps(run), "the checkpoints saved before are kept"


def test_export_over_an_earlier_sharded_export_removes_its_shards(truncated_run, tmp_path):
    """An export to a directory holding an earlier sharded export (six shards and an index)
    replaces it: the stale shards and index are removed, and what loads back is the new
    weights, equal to those of an export to an empty directory (from the truncated run's last
    checkpoint, which is thereby intact)."""
    run, _ = truncated_run
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    shutil.copytree(FIXTURE, stale)
    for to in (stale, fresh):
        proc = shardax("export", "--out", run, "--to", to)
        assert proc.returncode == 0, proc.stderr[-3000:]
    weights = [p.name for p in stale.iterdir() if "safetensors" in p.name]
    assert weights == ["model.safetensors"] and (stale / "reference.npz").exists()
    assert (stale / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    new, ref = tensor_index(stale), tensor_index(fresh)
    assert set(new) == set(ref)
    for name in new:
        np.testing.assert_array_equal(new[name].read(name), ref[name].read(name), err_msg=name)
    assert hf.load_config(stale) == hf.load_config(fresh)
