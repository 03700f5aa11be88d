"""Chat SFT: conversations rendered with the tokenizer's chat template give transformers'
``apply_chat_template`` ids (fixtures made by tests/reference/make_chat_fixtures.py) and a loss
mask on exactly the assistant turns; packed conversations are never split (truncated when
longer than a row); a packed-conversation batch's loss and gradients through the train step
equal each conversation computed alone, on one device and sharded; ``shardax train --data
chat.jsonl`` trains, and refuses chat data without a tokenizer that has a template.
"""

import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import run_cli
from _reference import documents_alone_loss, init_train_state
from test_pack import _KEEP_GRADS, CONFIG, _assert_matches

from shardax import layout
from shardax.data.chat_data import ChatBatches, ChatRows, chat_val_batches, pack_chats
from shardax.mesh import MeshShardingHelper
from shardax.rules import LogicalAxisRules
from shardax.train.step import eval_loss, train_step

pytest.importorskip("jinja2")  # chat templates: extra "hf"
pytest.importorskip("tokenizers")

from shardax.data.chat import ChatTemplate, read_chats, render_chat  # noqa: E402

CHAT = Path(__file__).parent / "fixtures" / "chat"
EXPECTED = json.loads((CHAT / "expected.json").read_text())
B, S = 8, 16


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_render_equals_apply_chat_template(name):
    chats = read_chats(CHAT / "chat.jsonl")
    template = ChatTemplate(CHAT / name)
    for chat, want in zip(chats, EXPECTED[name], strict=True):
        assert template.render(chat) == want["text"]
        ids, mask = render_chat(CHAT / name, chat)
        assert ids == want["ids"]
        assert [int(m) for m in mask] == want["mask"]  # exactly the assistant turns' tokens
        assert sum(mask) > 0
        ids_all, mask_all = render_chat(CHAT / name, chat, loss_on="all")
        assert ids_all == ids and all(mask_all)


def test_template_errors_name_the_problem(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((CHAT / "llama3" / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|eot_id|>"}')
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"content": "no role"}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'messages' must be"):
        read_chats(bad)


def test_pack_never_splits_and_truncates_long_conversations():
    template = ChatTemplate(CHAT / "llama3")
    chats = read_chats(CHAT / "chat.jsonl")
    lengths = [len(template.encode(c)[0]) for c in chats]
    seq_len = 40
    rows = pack_chats(chats, template, seq_len, pad_id=7)
    assert rows.truncated == sum(n > seq_len + 1 for n in lengths)
    # Every conversation sits whole (or truncated to a row) in one row, in one segment.
    found = []
    for tok, seg in zip(rows.tokens, rows.segments, strict=True):
        assert (np.diff(seg) >= 0).all()
        for s in np.unique(seg):
            found.append(tok[seg == s].tolist())
    for chat, n in zip(chats, lengths, strict=True):
        ids = template.encode(chat)[0][:seq_len + 1].tolist()
        assert ids in found, n


def test_chat_batches_are_a_function_of_seed_and_step():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 100, (5, S + 1)).astype(np.int32)
    rows = ChatRows(tokens, np.zeros_like(tokens), rng.random((5, S + 1)) < 0.5, 0)
    a, b = ChatBatches(rows, 4, seed=3), ChatBatches(rows, 4, seed=3)
    for step in (0, 7, 2):
        for x, y in zip(a.batch(step), b.batch(step), strict=True):
            np.testing.assert_array_equal(x, y)
    halves = [ChatBatches(rows, 4, seed=3, process_index=p, process_count=2).batch(5)
              for p in range(2)]
    for i, whole in enumerate(a.batch(5)):
        np.testing.assert_array_equal(np.concatenate([h[i] for h in halves]), whole)
    assert ChatBatches(rows, 4, seed=3).restore({**a.state(), "step": 9}).step == 9
    with pytest.raises(ValueError, match="num_rows"):
        a.restore({**a.state(), "num_rows": 6})
    val = chat_val_batches(rows, 4, num_batches=4)
    assert len(val) == 2 and not val[1][3][1:].any()  # the filler rows learn nothing


def _chat_rows(seed: int = 0) -> ChatRows:
    """[B, S + 1] rows of 1 to 3 random 'conversations' (ids 1..255) with random loss masks,
    the rest padding in a segment of its own (as `pack_chats` lays them out)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((B, S + 1), np.int32)
    segs = np.zeros((B, S + 1), np.int32)
    mask = np.zeros((B, S + 1), bool)
    for r in range(B):
        at, s = 0, 0
        while at < S - 2 and s < 3:
            n = int(rng.integers(2, S + 1 - at))
            tokens[r, at:at + n] = rng.integers(1, 256, n)
            segs[r, at:at + n] = s
            mask[r, at:at + n] = rng.random(n) < 0.6
            at, s = at + n, s + 1
        segs[r, at:] = s
    return ChatRows(tokens, segs, mask, 0)


def _conversations(rows: ChatRows) -> list:
    """Each conversation of each row as ``(inputs, targets, keep)``: its targets whose mask is
    set (conversations with none are left out)."""
    docs = []
    for tok, seg, mask in zip(rows.tokens, rows.segments, rows.mask, strict=True):
        for s in np.unique(seg):
            idx = np.flatnonzero(seg == s)
            if len(idx) >= 2 and mask[idx[1:]].any():
                docs.append((tok[idx[:-1]], tok[idx[1:]], mask[idx[1:]]))
    return docs


@pytest.fixture(scope="module")
def reference():
    graphdef, state = init_train_state(CONFIG, _KEEP_GRADS)
    rows = _chat_rows()
    loss, grads = jax.value_and_grad(documents_alone_loss)(state.params, state.rest, graphdef,
                                                           _conversations(rows), S)
    batch = tuple(jnp.asarray(a) for a in ChatBatches(rows, B).batch(0))
    # ChatBatches shuffles rows: the per-conversation mean does not depend on the order.
    return graphdef, state, batch, float(loss), grads


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_chat_step_equals_per_conversation_on_one_device(reference, grad_accum):
    graphdef, state, batch, loss, grads = reference
    step = jax.jit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, end_id=0,
                           grad_accum=grad_accum))
    new, metrics = step(state, batch)
    _assert_matches(metrics["loss"], new.opt_state, loss, grads)
    evaluated = jax.jit(partial(eval_loss, graphdef=graphdef, end_id=0))(state, batch)
    np.testing.assert_allclose(float(evaluated), loss, rtol=1e-5)


@pytest.mark.parametrize("mesh_spec,fsdp_mode", [("fsdp=4,tp=2", "xla"), ("fsdp=8", "explicit")])
def test_chat_step_equals_per_conversation_sharded(reference, mesh_spec, fsdp_mode):
    graphdef, state, batch, loss, grads = reference
    mesh = MeshShardingHelper.from_string(mesh_spec)
    rules = LogicalAxisRules(layout.presets.resolve(
        layout.PRESETS["fsdp_tp"], mesh.shape, heads=CONFIG.n_heads, kv_heads=CONFIG.n_kv_heads))
    batch_spec = rules.spec_for(("batch", "length"), mesh.mesh)
    step = mesh.sjit(partial(train_step, graphdef=graphdef, tx=_KEEP_GRADS, end_id=0,
                             param_rules=rules,
                             layout=layout.Layout(fsdp_mode=fsdp_mode)),
                     in_shardings=(rules, batch_spec), out_shardings=(rules, None))
    new, metrics = step(state, batch)
    _assert_matches(metrics["loss"], new.opt_state, loss, grads)


def test_cli_trains_on_chat_data(tmp_path):
    """As transformers 5 saves a tokenizer (its template in chat_template.jinja, none in
    tokenizer_config.json), with one conversation's content as OpenAI-style text parts."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((CHAT / "llama3" / "tokenizer.json").read_bytes())
    config = json.loads((CHAT / "llama3" / "tokenizer_config.json").read_text())
    (tok / "chat_template.jinja").write_text(config.pop("chat_template"))
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    records = [json.loads(line) for line in (CHAT / "chat.jsonl").read_text().splitlines()]
    first = records[0]["messages"][0]
    first["content"] = [{"type": "text", "text": first["content"]}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    r = run_cli("train", "--init-from", "hf:tests/fixtures/hf/llama_gqa", "--tokenizer",
                 str(tok), "--data", str(data), "--seq-len", "32",
                 "--batch-size", "8", "--steps", "2", "--eval-every", "2", "--out", str(out),
                 "--optimizer", "sgd", "--lr", "0.1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "tokenizer" / "chat_template.jinja").is_file()  # the run's copy keeps it
    assert "chat data: 4 conversations packed into" in r.stdout
    assert "longer than --seq-len truncated" in r.stdout
    assert "; pack: conversations (whole, into rows;" in r.stdout  # not end-of-text documents
    assert "loss on the assistant tokens)" in r.stdout
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(np.isfinite(m["loss"]) for m in losses if "loss" in m)
    r = run_cli("export", "--out", str(out), "--to", str(tmp_path / "x"), "--adapter-only")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "was not trained with LoRA" in r.stderr


def test_cli_chat_data_needs_a_template_tokenizer(tmp_path):
    r = run_cli("train", "--data", str(CHAT / "chat.jsonl"), "--steps", "1",
                 "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "chat template" in r.stderr
