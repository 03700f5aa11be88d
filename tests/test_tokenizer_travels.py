"""The tokenizer travels with the model (issue 23), as subprocesses of the ``shardax`` CLI:
``--init-from hf:DIR`` trains with DIR's tokenizer (the banner names it and the model), the run
keeps it, ``shardax export`` writes the tokenizer files, ``generation_config.json`` and the
special ids, ``generate --from hf:EXPORT`` decodes with them, a resumed run says where it
resumed from, and the byte fallback is one note."""

import json
import shutil

import numpy as np
import pytest
from flax import nnx
from test_data import _train_tokenizer
from test_hf_cli import ok, shardax

from shardax import hf, models

CHAT = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A Hugging Face llama directory with its own BPE tokenizer (Llama style: ``<s>`` first,
    ``</s>`` ends, a chat template, pad ``<unk>``), fine-tuned 2 steps without --tokenizer
    and resumed to step 3, then exported: (base, run, export, train stdout, resume stdout)."""
    root = tmp_path_factory.mktemp("travels")
    base, run, exp = root / "base", root / "run", root / "export"
    _train_tokenizer(base, "llama")
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<unk>", "chat_template": CHAT}))
    model = models.create(models.get_config("llama-tiny", n_layers=1, max_seq_len=64),
                          nnx.Rngs(3))
    hf.save_model(model, base)
    data = root / "data.txt"
    data.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)))
    common = ("--data", data, "--mesh", "fsdp=4,tp=2", "--batch-size", 8, "--seq-len", 32,
              "--eval-every", 0, "--ckpt-every", 1, "--out", run, "--devices", 8)
    first = ok(shardax("train", "--init-from", f"hf:{base}", "--steps", 2, *common))
    again = ok(shardax("train", "--init-from", f"hf:{base}", "--steps", 3, "--lr", "1e-5",
                       "--resume", *common))  # the schedule may change on resume
    ok(shardax("export", "--out", run, "--to", exp))
    return base, run, exp, first.stdout, again.stdout


def test_init_from_trains_with_the_models_tokenizer_and_the_banner_names_both(tuned):
    base, run, _, stdout, _ = tuned
    assert json.loads((run / "config.json").read_text())["tokenizer"] == str(base)
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == \
        (base / "tokenizer.json").read_bytes()
    assert f"shardax train: llama from hf:{base} (" in stdout, stdout
    assert "float32 weights" in stdout and "llama-tiny" not in stdout, stdout
    assert f"tokenizer: {base} (the --init-from model's own): vocabulary 200" in stdout, stdout
    # the fine-tuning default lr, and step 1 already trains (warm-up from lr / 2)
    assert "optimizer: adamw, lr 2e-05 (warm-up 1 steps from 1e-05, cosine to 2e-06 at step " \
        "2), weight decay 0.01, clip grad norm 1.0" in stdout, stdout


def test_a_resumed_run_says_from_which_step_and_checkpoint(tuned):
    _, run, _, first, again = tuned
    assert "resumed from" not in first
    assert f"shardax train: resumed from step 2 (checkpoint {run / 'checkpoints' / '2'})" \
        in again, again
    # a lower --lr (what a non-finite loss's message advises) and a cosine that now ends at
    # step 3, not 2: the run says what its lr becomes
    assert "shardax train: --lr 1e-05 (was 2e-05), --steps 3 (was 2) changes the " \
        "learning-rate schedule: the lr at step 2 is " in again, again


def test_export_writes_the_tokenizer_and_its_special_ids(tuned):
    from tokenizers import Tokenizer

    base, _, exp, _, _ = tuned
    config = json.loads((exp / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == \
        ("<s>", "</s>", "<unk>")
    assert config["chat_template"] == CHAT and config["model_max_length"] == 64
    assert json.loads((exp / "special_tokens_map.json").read_text()) == {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # <unk> <s> </s> trained
    assert json.loads((exp / "generation_config.json").read_text()) == ids
    model_config = json.loads((exp / "config.json").read_text())
    assert {k: model_config[k] for k in ids} == ids
    text = "def f(x):\n    return x + 1\n"
    theirs, ours = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (base, exp))
    assert ours.encode(text).ids == theirs.encode(text).ids
    assert ours.encode(text).ids[0] == 1  # <s> first, as the base's post-processor puts it


def test_generate_from_the_export_uses_its_tokenizer(tuned, tmp_path):
    _, run, exp, _, _ = tuned
    flags = ("--prompt", "def f(x):", "--max-tokens", 8, "--temperature", 0)
    exported = ok(shardax("generate", "--from", f"hf:{exp}", *flags))
    from_run = ok(shardax("generate", "--out", run, *flags))
    assert exported.stdout == from_run.stdout and exported.stdout.startswith("def f(x):")
    assert "\ufffd" not in exported.stdout and "note" not in exported.stderr, exported.stderr
    # without a tokenizer anywhere: bytes, said in one note line
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(exp / name, bare / name)
    proc = ok(shardax("generate", "--from", f"hf:{bare}", *flags))
    notes = [line for line in proc.stderr.splitlines() if "note" in line]
    assert len(notes) == 1 and "no tokenizer.json" in notes[0] and "raw UTF-8 bytes" in \
        notes[0], proc.stderr


def test_a_byte_level_export_has_a_byte_level_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from shardax.data.tokenizer import ByteTokenizer

    assert ByteTokenizer().export(tmp_path, 128) == {"eos_token_id": 0}
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "héllo\n\tworld ✓"
    assert tok.encode(text).ids == list(text.encode())  # id = byte, as in training
    assert tok.decode([*np.frombuffer(text.encode(), np.uint8).tolist(), 0]) == text
