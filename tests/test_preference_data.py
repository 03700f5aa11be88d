"""Preference data: standard (string) and conversational (chat ``messages``) records become
stacked chosen / rejected token rows whose completion mask is exactly the completion's tokens
(the chat template's rendering for conversations), truncation keeps the completion, the rows
give `sequence_logps` the completion's log-probabilities, and bad records are one line naming
the file, line and field."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.data.preference_data import encode_preferences, read_preferences
from shardax.data.tokenizer import ByteTokenizer, load_tokenizer
from shardax.errors import DataError
from shardax.train.post.objectives import sequence_logps

CHAT = Path(__file__).parent / "fixtures" / "chat"
STANDARD = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green, surely."},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def _completion(rows, row: int) -> list[int]:
    return rows.labels[row][rows.completion_mask[row]].tolist()


def test_standard_records_are_prompt_then_completion(tmp_path):
    records = read_preferences(_write(tmp_path / "p.jsonl", ["", *STANDARD]))
    assert [r["where"] for r in records] == [f"{tmp_path}/p.jsonl:2", f"{tmp_path}/p.jsonl:3"]
    rows = encode_preferences(records, ByteTokenizer(), seq_len=32)
    n = len(STANDARD)
    assert rows.inputs.shape == rows.labels.shape == rows.completion_mask.shape == (2 * n, 32)
    assert rows.truncated == 0
    for k, record in enumerate(STANDARD):
        for side, name in enumerate(("chosen", "rejected")):
            row = side * n + k  # chosen rows first, then rejected
            text = (record["prompt"] + record[name]).encode()
            assert rows.inputs[row, :len(text)].tobytes() == np.frombuffer(
                text, np.uint8).astype(np.int32).tobytes()
            assert (rows.labels[row, :-1] == rows.inputs[row, 1:]).all()  # the next token
            # The mask covers exactly the completion's bytes and the eos id after them.
            assert _completion(rows, row) == [*record[name].encode(), 0]
            start = len(record["prompt"]) - 1  # the label of this input is the first reply byte
            assert np.flatnonzero(rows.completion_mask[row]).tolist() == list(
                range(start, start + len(record[name]) + 1))


def test_truncation_cuts_the_prompt_from_the_left():
    record = {"prompt": "a long prompt that cannot fit", "chosen": "yes", "rejected": "no!"}
    rows = encode_preferences([record], ByteTokenizer(), seq_len=8)
    assert rows.truncated == 2
    assert _completion(rows, 0) == [*b"yes", 0] and _completion(rows, 1) == [*b"no!", 0]
    # keep_end: the row holds the last 9 tokens of prompt + completion + eos
    whole = [*b"a long prompt that cannot fit", *b"yes", 0][-9:]
    assert rows.inputs[0].tolist() == whole[:-1] and rows.labels[0].tolist() == whole[1:]


def test_one_hot_logits_give_zero_completion_logps():
    """Ties the rows to the loss: a model that predicts every label with certainty has log-prob
    0 on the completion, and the counts are the completion lengths; shifting the labels by one
    (inputs in their place) makes the log-prob very negative."""
    rows = encode_preferences(STANDARD, ByteTokenizer(), seq_len=32)
    logits = 1e4 * jax.nn.one_hot(rows.labels, 256)
    logps, counts = sequence_logps(logits, jnp.asarray(rows.labels),
                                   jnp.asarray(rows.completion_mask))
    assert logps.tolist() == [0.0] * 4
    want = [len(r[k]) + 1 for k in ("chosen", "rejected") for r in STANDARD]
    assert counts.tolist() == want
    wrong, _ = sequence_logps(1e4 * jax.nn.one_hot(rows.inputs, 256), jnp.asarray(rows.labels),
                              jnp.asarray(rows.completion_mask))
    assert (wrong < -1e3).all()


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_chat_records_render_with_the_template(tmp_path, name):
    """A chosen row is the conversation of tests/fixtures/chat/chat.jsonl as transformers'
    ``apply_chat_template`` tokenizes it (fixtures/chat/expected.json), its mask exactly the
    last assistant turn (the reply; earlier turns are prompt); a string reply is rendered as
    an assistant message, as ChatTemplate renders prompt + reply."""
    pytest.importorskip("jinja2")
    pytest.importorskip("tokenizers")
    from shardax.data.chat import ChatTemplate

    template, tok = ChatTemplate(CHAT / name), load_tokenizer(CHAT / name)
    conversations = [json.loads(line)["messages"]
                     for line in (CHAT / "chat.jsonl").read_text().splitlines()[:2]]
    assert [m["role"] for m in conversations[1]].count("assistant") == 2  # a multi-turn prompt
    path = _write(tmp_path / "c.jsonl", [{"prompt": c[:-1], "chosen": c[-1:], "rejected": "five."}
                                         for c in conversations])
    records = read_preferences(path)
    rejected = [{"role": "assistant", "content": "five."}]
    assert records[0]["rejected"] == rejected
    rows = encode_preferences(records, tok, seq_len=96, template=template)
    assert rows.truncated == 0
    for k, want in enumerate(json.loads((CHAT / "expected.json").read_text())[name][:2]):
        n = len(want["ids"])
        assert [rows.inputs[k, 0], *rows.labels[k, :n - 1]] == want["ids"]
        reply = np.asarray(want["mask"], bool)
        first_of_last_turn = np.flatnonzero(reply & ~np.roll(reply, 1))[-1]
        reply[:first_of_last_turn] = False
        assert rows.completion_mask[k, :n - 1].tolist() == reply[1:].tolist()
        assert not rows.completion_mask[k, n - 1:].any()
        ids, mask = template.encode(conversations[k][:-1] + rejected)
        row = len(records) + k
        assert [rows.inputs[row, 0], *rows.labels[row, :len(ids) - 1]] == ids.tolist()
        assert tok.decode(_completion(rows, row)).strip() == "five."
        # the prompt's own assistant turn (record 1) is not completion
        assert (int(rows.completion_mask[row].sum()) < int(mask.sum())) == (k == 1)
    with pytest.raises(ValueError, match=r"c.jsonl:1: a conversational record needs"):
        encode_preferences(records, tok, seq_len=64)


BAD = [
    ("not json", r"p.jsonl:2: not valid JSON"),
    ('["a list"]', r"p.jsonl:2: not a JSON object"),
    ({"chosen": "a", "rejected": "b"}, r"p.jsonl:2: no 'prompt' field"),
    ({"prompt": "p", "rejected": "b"}, r"p.jsonl:2: no 'chosen' field"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, r"p.jsonl:2: field 'prompt' is a JSON int"),
    ({"prompt": "p", "chosen": "a", "rejected": ["b"]},
     r"p.jsonl:2: field 'rejected' is a JSON list; expected a string"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, r"p.jsonl:2: field 'chosen' is empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [],
      "rejected": "b"}, r"p.jsonl:2: field 'chosen': 'messages' must be a non-empty list"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "chosen": [{"role": "assistant", "content": ""}], "rejected": "b"},
     r"p.jsonl:2: field 'chosen' is empty"),
    ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
     r"p.jsonl:2: field 'prompt': messages\[0\].content is missing"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": "a",
      "rejected": [{"role": "user", "content": "b"}]},
     r"p.jsonl:2: field 'rejected' has roles \['user'\]"),
]


@pytest.mark.parametrize("record, message", BAD, ids=[m.split(": ", 1)[1] for _, m in BAD])
def test_bad_records_are_one_line_naming_file_line_and_field(tmp_path, record, message):
    path = _write(tmp_path / "p.jsonl", [STANDARD[0], record])
    with pytest.raises(DataError, match=r"^--data .*" + message) as e:
        read_preferences(path)
    assert "\n" not in str(e.value)


def test_an_empty_file_or_a_fifo_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"^--data .*e.jsonl: no records"):
        read_preferences(_write(tmp_path / "e.jsonl", [""]))
    os.mkfifo(tmp_path / "f.jsonl")
    with pytest.raises(DataError, match=r"^--data .*f.jsonl: is a FIFO"):
        read_preferences(tmp_path / "f.jsonl")
