"""Hostile and unlucky chat templates, chat messages, text encodings and tokenizer configs.

Met as users meet them (``shardax train`` / ``shardax generate`` command lines, all run by the
CLI's ``main`` in one subprocess, as tests/test_cli_errors.py does): one line on stderr naming
the file (and line, field or template line), exit 2, no traceback, no run directory, nothing
executed. The variants of each case run in process, on the functions the CLI calls. The chat
template of a tokenizer saved by transformers 5 (``chat_template.jinja``) and content given as
OpenAI-style text parts are trained on in tests/test_chat.py's CLI run.
"""

import json
import shutil
from pathlib import Path

import pytest
from _cli import run_cli_batch
from test_hostile_input import FIXTURE, one_line_error

pytest.importorskip("jinja2")  # chat templates: extra "hf"
pytest.importorskip("tokenizers")

from shardax.data import readers  # noqa: E402
from shardax.data.chat import ChatTemplate, read_chats  # noqa: E402
from shardax.data.tokenizer import load_tokenizer  # noqa: E402
from shardax.errors import UsageError  # noqa: E402
from shardax.filecheck import parse_json  # noqa: E402
from shardax.train.configfile import load_file  # noqa: E402
from shardax.train.rundir import load_run_config  # noqa: E402

CHAT = Path(__file__).parent / "fixtures" / "chat"
LLAMA3 = CHAT / "llama3"
CONFIG = json.loads((LLAMA3 / "tokenizer_config.json").read_text())
TEMPLATE = CONFIG["chat_template"]
TRAIN = ["--init-from", f"hf:{FIXTURE}", "--seq-len", "32", "--batch-size", "8", "--steps", "1",
         "--devices", "1"]
# The classic escape from a Jinja2 template to os.popen, through a global's function globals.
POPEN = "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}"
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}


def tokenizer_dir(path: Path, template: str | None = TEMPLATE, **config) -> Path:
    """A copy of the llama3 fixture tokenizer whose tokenizer_config.json holds ``template``
    (none: left out) and ``config``."""
    path.mkdir(parents=True)
    shutil.copy(LLAMA3 / "tokenizer.json", path)
    values = {**CONFIG, "chat_template": template, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in values.items() if v is not None}))
    return path


def jsonl(path: Path, *records) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                              for r in records))
    return path


def _chat(*messages) -> dict:
    return {"messages": [USER, *messages] if messages else [USER, ASSISTANT]}


# ------------------------------------------------------------ as users meet them


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Each case's command and what it must say, run side by side."""
    t = tmp_path_factory.mktemp("cli")
    marker = t / "pwned"
    good = jsonl(t / "chat.jsonl", _chat(), _chat())
    cases = {
        "template": (["train", *TRAIN, "--data", good, "--out", t / "run-template",
                      "--tokenizer", tokenizer_dir(t / "tok-popen", POPEN % marker)],
                     [f"--data {good}:1: chat template of {t / 'tok-popen'} "
                      "(tokenizer_config.json): line 1: the sandbox refused it"]),
        "content": (["train", *TRAIN, "--tokenizer", LLAMA3, "--out", t / "run-content",
                     "--data", jsonl(t / "image.jsonl", _chat(), _chat({
                         "role": "assistant", "content": [
                             {"type": "text", "text": "look"},
                             {"type": "image", "url": "x.png"}]}))],
                    [f"{t / 'image.jsonl'}:2: messages[1].content[1]: 'image' part not "
                     "supported"]),
        "bytes": (["train", *TRAIN, "--tokenizer", LLAMA3, "--out", t / "run-bytes",
                   "--data", jsonl(t / "bytes.jsonl", _chat(),
                                   b'{"messages": [{"role": "user", "content": "\xff"}]}')],
                  [f"--data {t / 'bytes.jsonl'}:2: not UTF-8 text (byte 0xff at offset"]),
        "surrogate": (["train", "--model", "llama-tiny", "--seq-len", "32", "--steps", "1",
                       "--devices", "1", "--out", t / "run-surrogate",
                       "--data", jsonl(t / "text.jsonl", {"text": "fine"},
                                       b'{"text": "half \\ud800 a pair"}')],
                      [f"--data {t / 'text.jsonl'} line 2: a lone UTF-16 surrogate escape"]),
    }
    model = t / "model"
    shutil.copytree(FIXTURE, model)
    shutil.copy(LLAMA3 / "tokenizer.json", model)
    (model / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["tokenizer_config"] = (
        ["generate", "--from", f"hf:{model}", "--prompt", "x"],
        [f"{model}/tokenizer_config.json: not valid JSON (nested too deeply)"])
    results = run_cli_batch([argv for argv, _ in cases.values()])  # a traceback fails it
    return {name: (proc, cases[name]) for name, proc in zip(cases, results)}, t, marker


@pytest.mark.parametrize("case", ["template", "content", "bytes", "surrogate",
                                  "tokenizer_config"])
def test_each_case_is_one_line_naming_the_file(case, cli):
    results, t, marker = cli
    proc, (args, needles) = results[case]
    one_line_error(proc, args[0], *needles)
    assert "Traceback" not in proc.stderr
    assert not (t / f"run-{case}").exists()  # nothing written
    assert not marker.exists()  # the template ran nothing


# ------------------------------------------------------------ chat templates


@pytest.mark.parametrize("template, needles", [
    ("{% for m in messages %}\n{{ m.content }}", ["line 2: Unexpected end of template"]),
    ("{{ bos_token }}\n\n{% include 'other.jinja' %}", ["line 3: {% include %} is not allowed"]),
    ("{% import 'macros' as m %}", ["line 1: {% import %} is not allowed"]),
    ("{% from 'macros' import x %}", ["{% from ... import %} is not allowed"]),
    ("{% extends 'base' %}", ["{% extends %} is not allowed"]),
])
def test_a_template_that_cannot_run_is_refused_when_read(tmp_path, template, needles):
    with pytest.raises(ValueError) as info:
        ChatTemplate(tokenizer_dir(tmp_path / "tok", template))
    message = str(info.value)
    assert message.startswith(f"chat template of {tmp_path / 'tok'} (tokenizer_config.json): ")
    assert all(n in message for n in needles), message
    assert "\n" not in message


@pytest.mark.parametrize("template, needles", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ["line 1: the sandbox refused it",
                                                         "__class__"]),
    ("ok\n{{ messages.append(1) }}", ["line 2: the sandbox refused it"]),  # immutable
    ("{{ messages[0].content | trim }}\n{{ 1 // 0 }}",
     ["line 2: cannot render a conversation (ZeroDivisionError"]),
    ("{{ raise_exception('roles must alternate') }}",
     ["refuses the conversation: roles must alternate"]),
])
def test_a_template_failing_on_a_conversation_names_it(tmp_path, template, needles):
    chat = ChatTemplate(tokenizer_dir(tmp_path / "tok", template))
    with pytest.raises(ValueError) as info:
        chat.encode([USER, ASSISTANT])
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_chat_template_jinja_is_found_as_transformers_finds_it(tmp_path):
    """transformers 5 saves the template to chat_template.jinja (none in tokenizer_config.json);
    the file wins over the config's; named ones sit in additional_chat_templates/; a processor's
    chat_template.json is the last resort. Copies and exports keep the file."""
    d = tokenizer_dir(tmp_path / "v5", None)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    want = ChatTemplate(LLAMA3).encode([USER, ASSISTANT])
    got = ChatTemplate(d).encode([USER, ASSISTANT])
    assert all((a == b).all() for a, b in zip(got, want))
    assert "(chat_template.jinja)" in ChatTemplate(d).where

    tok = load_tokenizer(d)
    tok.save(tmp_path / "copy")  # a run's copy of its tokenizer
    tok.export(tmp_path / "export", model_max_length=64)
    for out in (tmp_path / "copy", tmp_path / "export"):
        assert (out / "chat_template.jinja").read_text() == TEMPLATE
        assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
        assert ChatTemplate(out).render([USER, ASSISTANT]) == ChatTemplate(d).render(
            [USER, ASSISTANT])

    load_tokenizer(LLAMA3).export(tmp_path / "export", model_max_length=64)  # over it
    assert not (tmp_path / "export" / "chat_template.jinja").exists()  # would win over the
    assert ChatTemplate(tmp_path / "export").where.endswith("(tokenizer_config.json)")  # config

    first = tokenizer_dir(tmp_path / "both", "{{ 'from the config' }}")
    (first / "chat_template.jinja").write_text("{{ 'from the file' }}")
    assert ChatTemplate(first).render([USER]) == "from the file"

    named = tokenizer_dir(tmp_path / "named", None)
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    with pytest.raises(ValueError, match=r"\['tool_use'\] .* no default one"):
        ChatTemplate(named)
    (named / "chat_template.jinja").write_text("{{ 'default' }}")
    assert ChatTemplate(named).render([USER]) == "default"
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "named-copy").mkdir()  # links planted in the target are replaced, not followed
    (tmp_path / "named-copy/additional_chat_templates").symlink_to(outside)
    (tmp_path / "named-copy/chat_template.jinja").symlink_to(outside / "bashrc")
    load_tokenizer(named).save(tmp_path / "named-copy")
    assert (tmp_path / "named-copy/additional_chat_templates/tool_use.jinja").is_file()
    assert (tmp_path / "named-copy/chat_template.jinja").read_text() == "{{ 'default' }}"
    assert list(outside.iterdir()) == []

    listed = tokenizer_dir(tmp_path / "list", [{"name": "rag", "template": "r"},
                                               {"name": "default", "template": "d"}])
    assert ChatTemplate(listed).render([USER]) == "d"
    legacy = tokenizer_dir(tmp_path / "legacy", None)
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": "legacy"}))
    assert ChatTemplate(legacy).render([USER]) == "legacy"
    with pytest.raises(ValueError, match="chat_template is a JSON int, expected a string"):
        ChatTemplate(tokenizer_dir(tmp_path / "int", 7))


# ------------------------------------------------------------ chat messages


@pytest.mark.parametrize("message, needles", [
    ({"role": "user"}, ["messages[0].content is missing"]),
    ({"role": "user", "content": None}, ["messages[0].content is null"]),
    ({"role": "user", "content": 3}, ["messages[0].content is a JSON int"]),
    ({"role": "user", "content": {"text": "x"}}, ["messages[0].content is a JSON dict"]),
    ({"role": "user", "content": ["x"]}, ["messages[0].content[0] is not a text part"]),
    ({"role": "user", "content": [{"type": "text", "text": 5}]},
     ["messages[0].content[0] is not a text part"]),
    ({"role": "user", "content": [{"type": "input_audio"}]},
     ["messages[0].content[0]: 'input_audio' part not supported"]),
    ({"content": "x"}, ["'messages' must be", "messages[0] has no string 'role'"]),
])
def test_message_content_must_be_text(tmp_path, message, needles):
    path = jsonl(tmp_path / "c.jsonl", _chat(), {"messages": [message, ASSISTANT]})
    with pytest.raises(ValueError) as info:
        read_chats(path)
    assert str(info.value).startswith(f"--data {path}:2: "), str(info.value)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_text_parts_are_joined_unless_the_template_loops_over_them(tmp_path):
    parts = {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}
    path = jsonl(tmp_path / "c.jsonl", {"messages": [parts, ASSISTANT]},
                 {"messages": [USER, tool_call]})
    chats = read_chats(path)  # text parts and a tool call without content are accepted
    joined = {**parts, "content": "a\nb"}
    llama = ChatTemplate(LLAMA3)  # renders content as a string: the parts' texts, joined
    assert llama.render(chats[0]) == llama.render([joined, ASSISTANT])
    loops = ChatTemplate(tokenizer_dir(tmp_path / "loops", (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endif %}"
        "{% endfor %}")))
    assert loops.render(chats[0]) == "[a][b]hello"  # given the parts as they are


# ------------------------------------------------------------ encodings and JSON reads


def test_text_files_are_utf8_with_the_bad_byte_named(tmp_path, monkeypatch):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"fine\n" * 3000 + b"caf\xe9\n")  # past the 8 KiB sniffed
    (file,) = readers.list_data_files([path])
    with pytest.raises(readers.DataError, match=rf"--data {path}: not UTF-8 text \(byte 0xe9 "
                                                r"on line 3001, offset 15003\)"):
        list(readers.read_pieces(file))
    monkeypatch.setattr(readers, "PIECE_BYTES", 4)  # pieces cut inside lines: never in a char
    path.write_text("€€€€€€\n😀x")
    pieces = list(readers.read_pieces(readers.DataFile(path, "text")))
    assert len(pieces) > 3  # each piece whole characters, so each decodes on its own
    assert "".join(p.text.decode() for p in pieces) == "€€€€€€\n😀x"


@pytest.mark.parametrize("content, needle", [
    ("[" * 100_000, "not valid JSON (nested too deeply)"),
    ("[1, 2]", "a JSON list, expected an object"),
    ('{"eos_token": ["</s>"]}', "eos_token is a JSON list, expected a string"),
    ('{"eos_token": 2}', "eos_token is a JSON int, expected a string"),
    ('{"eos_token": {"content": null}}', "eos_token is an object without a string 'content'"),
    ('{"bos_token": "\\udfff"}', "a lone UTF-16 surrogate escape ('\\\\udfff')"),
    (b'{"eos_token": "\xc3"}', "not UTF-8 text (byte 0xc3 at offset 15)"),
])
def test_a_hostile_tokenizer_config_is_named(tmp_path, content, needle):
    d = tokenizer_dir(tmp_path / "tok")
    config = d / "tokenizer_config.json"
    (config.write_bytes if isinstance(content, bytes) else config.write_text)(content)
    for read in (load_tokenizer, ChatTemplate):
        with pytest.raises(ValueError) as info:
            read(d)
        assert f"{config}: {needle}" in str(info.value), str(info.value)


def test_config_files_are_read_bounded(tmp_path):
    """--config JSON and a run's config.json (read on --resume and by generate)."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"steps": ' + "[" * 100_000)
    with pytest.raises(UsageError, match=f"--config {deep}: not valid JSON .nested too deeply"):
        load_file(deep)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(b'{\n"model": "\xff"}')
    with pytest.raises(UsageError, match=f"{run / 'config.json'}: not UTF-8 text .byte 0xff "
                                         "on line 2"):
        load_run_config(run)
    assert parse_json('{"emoji": "\\ud83d\\ude00", "slash": "\\\\ud800"}', "x") == {
        "emoji": "😀", "slash": "\\ud800"}  # a pair, and an escaped backslash, are text
