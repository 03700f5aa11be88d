"""``shardax eval`` (issue 37, perplexity on a file): the summed next-token NLL of a file equals
the model's own per-token log-probabilities computed here from ``model(inputs)`` on one device,
on the default mesh and on fsdp=4,tp=2; the command prints loss, perplexity = exp(loss) and
bits per byte; a missing file is one line, exit 2. Uses conftest's shared ``observed_run``
(llama-tiny, byte tokenizer)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import assert_one_line_error, run_cli
from flax import nnx

from shardax.train.evaluate import evaluate, windows
from shardax.train.generate import restore_model
from shardax.train.rundir import check_run

SEQ_LEN = 32
TEXT = "Grüße aus Köln: the quick brown fox jumps over the lazy dog, näive café. " * 2


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "held_out.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(observed_run, held_out):
    """The file's summed NLL from the model's own logits on one device: the byte tokenizer
    packs the file as its bytes then eos (0); each window of up to SEQ_LEN inputs predicts
    the next tokens, so every token but the first counts once."""
    _, out, _ = observed_run
    _, model, _ = restore_model(check_run(str(out)))  # replicated: moved to one device
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
    tokens = np.array([*TEXT.encode("utf-8"), 0], np.int32)
    nll = 0.0
    for start in range(0, len(tokens) - 1, SEQ_LEN):
        inputs = tokens[start:start + SEQ_LEN]
        targets = tokens[start + 1:start + SEQ_LEN + 1]
        logits = model(jnp.asarray(inputs[None]))[0, :len(targets)]
        logps = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll -= float(np.asarray(logps)[np.arange(len(targets)), targets].sum(dtype=np.float64))
    return nll, len(tokens) - 1


def test_eval_nll_is_the_models_own_log_probabilities(observed_run, held_out, reference):
    _, out, _ = observed_run
    nll, tokens = reference
    results = [evaluate(str(out), [str(held_out)], seq_len=SEQ_LEN, batch_size=3, mesh=mesh)[0]
               for mesh in (None, "fsdp=4,tp=2")]  # dp=8, then FSDP x TP
    for r in results:
        assert r["tokens"] == tokens
        np.testing.assert_allclose(r["nll"], nll, rtol=1e-5)
        assert r["loss"] == pytest.approx(r["nll"] / tokens, rel=1e-12)
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
        assert r["bytes"] == len(TEXT.encode("utf-8")) > len(TEXT)  # UTF-8 bytes, not chars
        assert r["bits_per_byte"] == pytest.approx(r["nll"] / math.log(2) / r["bytes"],
                                                   rel=1e-12)
    np.testing.assert_allclose(results[0]["nll"], results[1]["nll"], rtol=1e-5)


def test_windows_score_every_token_but_the_first_once():
    rows, mask = windows(np.arange(1, 9), 3)
    assert rows.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 8, 0, 0]]
    assert mask.sum() == 7 and rows[:, 1:][mask > 0].tolist() == list(range(2, 9))
    rows, mask = windows(np.arange(1, 9), 3, first=2, count=2)  # one batch, padded
    assert rows.tolist() == [[7, 8, 0, 0], [0, 0, 0, 0]] and mask.tolist() == [[1, 0, 0], [0] * 3]


def test_eval_command_prints_loss_perplexity_bits_per_byte(observed_run, held_out, reference):
    _, out, _ = observed_run
    proc = run_cli("eval", "--out", out, "--data", held_out, "--seq-len", SEQ_LEN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    found = re.fullmatch(rf"{re.escape(str(held_out))}: (\d+) tokens, loss ([\d.]+), perplexity "
                         r"([\d.]+), bits per byte ([\d.]+)", line)
    assert found, line
    tokens, loss, perplexity, bpb = int(found[1]), *map(float, found.groups()[1:])
    nll, want_tokens = reference
    assert tokens == want_tokens
    assert loss == pytest.approx(nll / tokens, abs=1e-4)
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-3)
    assert bpb == pytest.approx(nll / math.log(2) / len(TEXT.encode("utf-8")), abs=1e-4)


def test_eval_missing_file_is_one_line(tmp_path):
    proc = run_cli("eval", "--out", tmp_path / "run", "--data", tmp_path / "missing.txt")
    assert_one_line_error(proc, "eval", "--data", "missing.txt", "no such file")
