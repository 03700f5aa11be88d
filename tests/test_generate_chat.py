"""Chat generation and models by Hub name (issue 34), as users meet them: ``shardax generate
--chat`` renders the prompt with the tokenizer's chat template and stops at its end-of-turn
token, from a model named ``hf:ORG/NAME`` in a pre-filled Hugging Face cache
(``HF_HUB_OFFLINE=1``); ``--interactive`` keeps the conversation across lines of stdin; an
unknown name is one line; top-k 1 is greedy; top-p keeps what a hand computation keeps;
sampling with top-k/top-p is the same on a mesh as on one device. Together about 35 s of CPU
(three subprocesses, two compiled samplers)."""

import json
import os
import re
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from _cli import assert_one_line_error, cli_command, cli_env
from flax import nnx
from test_hf import FIXTURES, reference
from test_hf_cli import ok, shardax

from shardax import hf, models
from shardax.mesh import MeshShardingHelper
from shardax.models import decode
from shardax.train.config import GenerateConfig, UsageError, check_generate

pytest.importorskip("jinja2")
pytest.importorskip("huggingface_hub")
tokenizers = pytest.importorskip("tokenizers")

LLAMA3 = FIXTURES.parent / "chat" / "llama3"  # Llama 3 chat template, eos <|eot_id|>
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPLY = ["▁two", "▁th", "ree"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """``(HF_HOME, tokenizer)``: a Hugging Face cache holding ``org/chat`` at ``main``: the
    Llama 3 fixture tokenizer and a one-layer llama whose greedy next token depends only on
    the current one (blocks zeroed, one-hot embeddings, lm_head a lookup table): after the
    generation prompt's last token it says "two three", then <|eot_id|>, then goes on."""
    tok = tokenizers.Tokenizer.from_file(str(LLAMA3 / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = models.get_config("llama-tiny", vocab_size=vocab, dim=128, n_layers=1,
                               max_seq_len=128)  # a two-turn chat fits whole
    model = models.create(config, nnx.Rngs(0))
    ids = tok.token_to_id
    chain = ["\n", *REPLY, "<|eot_id|>", "▁o", "ne"]  # each token -> the next
    table = np.zeros((config.dim, vocab), np.float32)
    for a, b in zip(chain, chain[1:]):
        table[ids(a), ids(b)] = 1.0
    model.embed[...] = jnp.eye(vocab, config.dim)
    model.lm_head[...] = jnp.asarray(table)
    model.layers.attn.wo[...] = 0.0  # the stack of its one layer
    model.layers.mlp.w_down[...] = 0.0
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--org--chat"
    snapshot = repo / "snapshots" / COMMIT
    hf.save_model(model, snapshot)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(LLAMA3 / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home, tok


def cached(*args, home):
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return shardax(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def test_chat_generate_from_a_hub_name_stops_at_end_of_turn(hub):
    """Two prompts, each sent as a user message after a system message: each reply ends at
    <|eot_id|> (shown), not with the "one" the model says after it; top-k 1 samples the
    greedy chain (at temperature 2 without it, each step leaves the chain with p ~ 0.3)."""
    home, tok = hub
    reply = tok.decode([tok.token_to_id(t) for t in REPLY]) + "<|eot_id|>"
    proc = ok(cached("generate", "--from", f"hf:org/chat@{COMMIT}", "--chat", "--prompt",
                     "count", "--prompts", "again", "--system", "be brief", "--top-k", 1,
                     "--temperature", 2, "--max-tokens", 12, "--show-special-tokens",
                     home=home))
    assert proc.stdout == f"{reply}\n\n{reply}\n", proc.stdout
    for i in (1, 2):
        assert f"prompt {i}: stopped at end of turn '<|eot_id|>' after 4 tokens" in proc.stderr
    assert "generated 8 tokens for 2 prompt(s)" in proc.stderr, proc.stderr


def test_interactive_chat_replies_to_each_line_with_the_whole_conversation(hub):
    """Lines piped to ``--interactive``: each gets a reply ending at <|eot_id|>, and the second
    turn's prompt is the template's rendering of the whole conversation (system message, first
    exchange, second message: 71 tokens, where the second message alone would give 45);
    ``/reset`` starts again from the system message; the empty line ends the chat (the line
    after it is never read)."""
    from shardax.data.chat import ChatTemplate

    home, tok = hub
    proc = ok(subprocess.run(
        cli_command("generate", "--from", f"hf:org/chat@{COMMIT}", "--interactive", "--system",
                    "be brief", "--top-k", 1, "--temperature", 2, "--max-tokens", 12),
        input="count\nagain\n/reset\nagain\n\nnever read\n", capture_output=True, text=True,
        timeout=300, env=cli_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")))
    reply = tok.decode([tok.token_to_id(t) for t in REPLY])
    assert proc.stdout == f"{reply}\n" * 3, proc.stdout
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "count"}]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    template = ChatTemplate(LLAMA3)
    turns = re.findall(r"^turn (\d): (\d+) prompt tokens, stopped at end of turn '<\|eot_id\|>' "
                       r"after 4 tokens", proc.stderr, re.M)
    assert turns == [("1", str(len(template.prompt(first)))),
                     ("2", str(len(template.prompt(second)))),
                     ("1", str(len(template.prompt([system, second[-1]]))))], proc.stderr
    assert "you>" not in proc.stderr  # stdin is no terminal: no prompt


def test_unknown_hub_names_are_one_line_and_chat_flags_are_checked(hub, tmp_path):
    home, _ = hub
    assert_one_line_error(cached("train", "--init-from", "hf:org/missing", "--out",
                                 tmp_path / "r", home=home),
                          "train", "--init-from hf:org/missing: ", "not in the Hugging Face cache",
                          "HF_HUB_OFFLINE")
    run = str(tmp_path)  # check_generate does not read it
    for flags, needle in [(dict(system="x"), "--system needs --chat"),
                          (dict(top_p=0.0), "--top-p 0.0"), (dict(top_k=-1), "--top-k -1"),
                          (dict(messages="m.txt"), "expected a .json or .jsonl"),
                          (dict(messages="m.json", prompt="x"), "--messages replaces"),
                          (dict(interactive=True, prompts=["x"]), "--interactive reads the "
                           "messages from stdin: leave out --prompt")]:
        with pytest.raises(UsageError, match=needle):
            check_generate(GenerateConfig(out=run, **flags))


def test_filter_logits_equals_a_hand_computed_nucleus():
    probs = np.array([[0.05, 0.4, 0.1, 0.25, 0.2], [0.9, 0.02, 0.03, 0.04, 0.01]])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    # Sorted: 0.4, 0.25, 0.2, 0.1, 0.05; mass before each: 0, .4, .65, .85, .95.
    kept = np.isfinite(decode.filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[False, True, False, True, True], [True] + [False] * 4]
    kept = np.isfinite(decode.filter_logits(logits, top_p=0.39))  # 0.4 alone is enough
    assert kept.tolist() == [[False, True, False, False, False], [True] + [False] * 4]
    kept = np.isfinite(decode.filter_logits(logits, top_k=2, top_p=0.99))
    assert kept.tolist() == [[False, True, False, True, False], [True, False, False, True,
                                                                 False]]
    np.testing.assert_array_equal(decode.filter_logits(logits), logits)  # no limit: as is


def test_top_k_top_p_sampling_is_mesh_invariant_and_stops_per_row():
    """On fsdp=4,tp=2 (vocabulary split over 'tp'), top-k/top-p sampling gives each row the
    tokens of one device (and not transformers' greedy ones); a stop id ends the rows that
    emit it, after it. (Top-k 1 is greedy: the chat test samples at temperature 2.)"""
    ref = reference("llama_gqa")
    prompts = ref["tokens"].tolist()
    greedy = ref["greedy"][:, len(prompts[0]):][:, :8].tolist()
    mesh = MeshShardingHelper.from_string("fsdp=4,tp=2")
    config = hf.load_config(FIXTURES / "llama_gqa")
    rules = hf.default_rules(config, mesh.mesh)
    model = nnx.merge(*hf.load_params(FIXTURES / "llama_gqa", config, mesh, rules))
    kw = dict(temperature=1.5, top_k=20, top_p=0.9, seed=4)
    sampled = decode.generate(model, prompts, 8, mesh=mesh, rules=rules, **kw).tokens
    single = hf.load_model(FIXTURES / "llama_gqa")
    assert sampled == decode.generate(single, prompts, 8, **kw).tokens and sampled != greedy
    stop = sampled[0][2]  # a stop id ends its row there and leaves the others alone
    got = decode.generate(model, prompts, 8, mesh=mesh, rules=rules, stop_ids=[stop], **kw)
    for row, new, ended in zip(sampled, got.tokens, got.stopped):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert (new, ended) == (row[:cut], stop in row)


def test_messages_files_system_message_and_end_of_turn_tokens(tmp_path):
    from shardax.data.chat import ChatTemplate
    from shardax.train.generate import _conversations

    chat = [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}]
    (tmp_path / "one.json").write_text(json.dumps({"messages": chat}))
    (tmp_path / "many.jsonl").write_text(f"{json.dumps({'messages': chat[1:]})}\n\n"
                                         f"{json.dumps({'messages': chat})}\n")
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"content": "no role"}]}\n')
    got = _conversations(check_generate(GenerateConfig(out="r", messages=str(
        tmp_path / "one.json"), system="new")))
    assert got == [[{"role": "system", "content": "new"}, chat[1]]]  # --system replaces it
    assert _conversations(check_generate(GenerateConfig(
        out="r", messages=str(tmp_path / "many.jsonl")))) == [chat[1:], chat]
    with pytest.raises(UsageError, match=r"^--messages .*bad.jsonl:1: 'messages' must be"):
        _conversations(check_generate(GenerateConfig(out="r", messages=str(
            tmp_path / "bad.jsonl"))))
    with pytest.raises(UsageError, match=r"^--messages .*none.json: no such file"):
        _conversations(GenerateConfig(out="r", messages=str(tmp_path / "none.json")))
    for name, eot in [("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>")]:
        template = ChatTemplate(FIXTURES.parent / "chat" / name)
        assert [template._tok.id_to_token(i) for i in template.end_of_turn()] == [eot]
