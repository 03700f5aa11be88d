"""`shardax train --init-from hf:DIR`, `shardax export` and `shardax generate --from hf:DIR`
as subprocesses: the happy path end to end, and one bad input each (exit 2, one line)."""

import json
from pathlib import Path

import numpy as np
import pytest
from _cli import assert_one_line_error, run_cli, run_cli_batch
from flax import nnx

from shardax import hf, models
from shardax.hf.configs import config_from_hf
from shardax.hf.files import tensor_index


def shardax(*args, timeout=300):
    return run_cli(*args, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A Hugging Face llama (byte vocabulary) fine-tuned for 2 SGD steps on fsdp=4,tp=2 with
    a vanishing learning rate, then exported: (base dir, run dir, export dir)."""
    root = tmp_path_factory.mktemp("hfcli")
    base, run, exp = root / "base", root / "run", root / "export"
    model = models.create(models.get_config("llama-tiny", n_layers=2, max_seq_len=64),
                          nnx.Rngs(7))
    hf.save_model(model, base)
    ok(shardax("train", "--init-from", f"hf:{base}", "--mesh", "fsdp=4,tp=2", "--steps", 2,
               "--batch-size", 8, "--seq-len", 32, "--optimizer", "sgd", "--lr", 1e-9,
               "--ckpt-every", 2, "--eval-every", 2, "--out", run, "--devices", 8))
    ok(shardax("export", "--out", run, "--to", exp, "--max-shard-mb", 1))  # 0.6 MB: one file
    return base, run, exp


def test_finetune_on_a_mesh_and_export_round_trips(finetuned):
    """The run started from the HF weights (after 2 steps at lr 1e-9 the export still equals
    them to 1e-6, while a fresh init would differ by ~0.02) and the export has the same tensor
    names, shapes and config as the model it came from."""
    base, _, exp = finetuned
    theirs, ours = tensor_index(base), tensor_index(exp)
    assert set(ours) == set(theirs)
    assert sorted(p.name for p in exp.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]  # a byte-level tokenizer.json
    for name in ours:
        np.testing.assert_allclose(ours[name].read(name), theirs[name].read(name), atol=1e-6,
                                   rtol=0, err_msg=name)
    assert hf.load_config(exp) == hf.load_config(base)


def test_generate_from_an_hf_dir_and_from_the_run(finetuned):
    _, run, exp = finetuned
    proc = ok(shardax("generate", "--from", f"hf:{exp}", "--prompt", "def ", "--prompts",
                      "class ", "import ", "--max-tokens", 6, "--temperature", 0))
    texts = proc.stdout.rstrip("\n").split("\n\n")
    assert [t[:4] for t in texts] == ["def ", "clas", "impo"], proc.stdout
    assert "18 tokens for 3 prompt(s)" in proc.stderr and "tokens/s" in proc.stderr
    again = ok(shardax("generate", "--out", run, "--prompt", "def ", "--max-tokens", 6,
                       "--temperature", 0))
    assert again.stdout.rstrip("\n") == texts[0]  # same weights (to 1e-6), same greedy


def test_bad_inputs_are_one_line_with_exit_2(tmp_path, finetuned):
    _, run, _ = finetuned
    cases = [
        (["train", "--init-from", f"hf:{tmp_path}", "--out", tmp_path / "r"],
         "--init-from", "no config.json"),
        (["export", "--out", tmp_path, "--to", tmp_path / "x"], "--out"),
        (["export", "--out", run, "--to", run], "--to"),
        (["generate", "--from", "llama", "--prompt", "x"], "--from", "hf:DIR"),
        (["generate", "--from", f"hf:{tmp_path}", "--out", run], "exactly one of --out"),
    ]
    for (argv, *needles), proc in zip(cases, run_cli_batch([c[0] for c in cases])):
        assert_one_line_error(proc, argv[0], *needles)


@pytest.mark.parametrize("arch,mesh", [("gemma2", "fsdp=4,tp=2"), ("mixtral", "ep=2,fsdp=4")])
def test_gemma_and_mixtral_finetune_and_export(tmp_path, arch, mesh):
    """A Gemma 2 (mixed sliding/global layers: XLA FSDP, list layers) and a Mixtral (dropless
    MoE, experts over 'ep') with a byte vocabulary train 2 steps from hf:DIR at a vanishing
    learning rate and export the same tensors and config; a 'pp' axis, which needs stacked
    layers, is a one-line error for Gemma."""
    fixture = Path(__file__).parent / "fixtures" / "hf" / arch
    # The fixture's architecture with a byte vocabulary (not its weights: no tensor check).
    config = config_from_hf(json.loads((fixture / "config.json").read_text()), vocab_size=256)
    base, run, exp = tmp_path / "base", tmp_path / "run", tmp_path / "export"
    hf.save_model(models.create(config, nnx.Rngs(0)), base)
    ok(shardax("train", "--init-from", f"hf:{base}", "--mesh", mesh, "--steps", 2,
               "--batch-size", 8, "--seq-len", 32, "--optimizer", "sgd", "--lr", 1e-9,
               "--ckpt-every", 2, "--eval-every", 2, "--out", run, "--devices", 8))
    ok(shardax("export", "--out", run, "--to", exp))
    theirs, ours = tensor_index(base), tensor_index(exp)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_allclose(ours[name].read(name), theirs[name].read(name), atol=1e-6,
                                   rtol=0, err_msg=name)
    assert hf.load_config(exp) == hf.load_config(base)
    if arch == "gemma2":
        assert_one_line_error(shardax("train", "--init-from", f"hf:{base}", "--mesh",
                                      "pp=2,fsdp=4", "--steps", 1, "--seq-len", 32, "--out",
                                      tmp_path / "pp", "--devices", 8),
                              "train", "global_every=2 mixes sliding-window and global")
