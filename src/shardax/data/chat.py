"""Chat conversations as token ids and a loss mask, rendered with the tokenizer's own template.

`render_chat` renders ``messages`` ([{role, content}], OpenAI / Hugging Face style) with the
tokenizer directory's chat template (``chat_template.jinja``, or the ``chat_template`` of its
``tokenizer_config.json``: `shardax.data.chat_source`) the way transformers'
``apply_chat_template`` does (a sandboxed Jinja2 environment with no loader, ``trim_blocks``
and ``lstrip_blocks``, ``raise_exception``, the special tokens as variables,
``add_generation_prompt=False``) and tokenizes the text without adding special tokens, so the
ids equal ``tokenizer.apply_chat_template(messages, tokenize=True)``. The loss mask marks the
tokens of each assistant turn as the template renders it (its content and end-of-turn
tokens), found by rendering the conversation up to each turn; ``loss_on='all'`` marks every
token. `read_chats` reads the ``messages`` of a ``.jsonl`` file.

A message's ``content`` is a string or a list of OpenAI-style text parts
(``[{"type": "text", "text": ...}]``; other parts, such as images, are refused by name). A
template that loops over a message's content gets the parts as they are (as transformers
passes them); any other template gets the parts' texts joined by newlines (as vLLM does), since
it expects a string. A template that does not parse, loads other templates (``include``,
``import``, ``extends``) or trips the sandbox is a one-line ValueError naming the tokenizer
directory, the template's file and line.

Example::

    ids, mask = render_chat("models/llama", [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}])
    # mask[i] is True for the tokens of "hello<|eot_id|>"
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from shardax.data.chat_source import find_template
from shardax.data.dataset_dirs import find_dataset
from shardax.data.readers import DataFile, columns, list_data_files, read_records
from shardax.data.tokenizer import MAX_TOKENIZER_BYTES, read_tokenizer_config, special_token
from shardax.filecheck import parse_json, read_text

__all__ = ["LOSS_ON", "ChatTemplate", "chat_messages", "chat_records", "is_chat_file",
           "read_chats", "render_chat"]

#: values of ``--loss-on``: the assistant turns only, or every token of a conversation
LOSS_ON = ("assistant", "all")
_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
             "mask_token")


class ChatTemplate:
    """The chat template and tokenizer of a Hugging Face tokenizer directory.

    Example::

        template = ChatTemplate("models/qwen")
        template.render(messages)          # the text apply_chat_template(tokenize=False) gives
        template.encode(messages)          # (ids, loss mask) as int32 / bool arrays
    """

    def __init__(self, directory: str | Path):
        try:
            import jinja2.ext  # optional: extra "hf" (chat templates)
            from jinja2 import nodes
            from jinja2.exceptions import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer  # optional: extra "hf"
        except ImportError as e:
            raise ValueError(f"chat data needs the '{e.name}' package: "
                             "pip install 'shardax[hf]'") from None
        self.directory = directory = Path(str(directory).removeprefix("hf:"))
        # Regular files only (never wait on a FIFO), of bounded size, strict UTF-8 and JSON.
        config_path = directory / "tokenizer_config.json"
        config = read_tokenizer_config(directory)
        self.specials = {k: text for k in _SPECIALS
                         if (text := special_token(config, k, config_path)) is not None}
        template, source = find_template(directory, config)
        text = read_text(directory / "tokenizer.json", MAX_TOKENIZER_BYTES)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own Exception types for bad JSON
            raise ValueError(f"chat template of {directory}: cannot read tokenizer.json "
                             f"({_one_line(e)})") from None
        self.where = where = f"chat template of {directory} ({source})"

        def raise_exception(message: str) -> None:
            raise _Refused(f"{where} refuses the conversation: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        loads = {nodes.Include: "include", nodes.Import: "import",
                 nodes.FromImport: "from ... import", nodes.Extends: "extends"}
        try:
            tree = env.parse(template)
            for node in tree.find_all(tuple(loads)):  # without a loader they could only fail
                raise ValueError(f"{where}: line {node.lineno}: {{% {loads[type(node)]} %}} is "
                                 "not allowed (a chat template cannot load other templates)")
            self._template = env.from_string(tree)
        except TemplateSyntaxError as e:
            raise ValueError(f"{where}: line {e.lineno}: {_one_line(e.message)}") from None
        self.content_parts = _iterates_content(nodes, tree)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation's text, as ``apply_chat_template(tokenize=False)`` renders it
        (text parts joined unless the template loops over them, see the module's doc)."""
        from jinja2.exceptions import SecurityError

        if not self.content_parts:
            messages = [_joined(m) for m in messages]
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.specials)
        except _Refused:
            raise
        except SecurityError as e:
            raise ValueError(f"{self.where}: {_template_line(e)}the sandbox refused it: "
                             f"{_one_line(e)}") from None
        except Exception as e:  # the template's own error (a template is a program)
            raise ValueError(f"{self.where}: {_template_line(e)}cannot render a conversation "
                             f"({type(e).__name__}: {_one_line(e)})") from None

    def encode(self, messages: Sequence[dict], loss_on: str = "assistant"
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)``: int32 token ids of the rendered conversation and a bool mask of
        the tokens to learn (the assistant turns, or all with ``loss_on='all'``)."""
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
        text = self.render(messages)
        enc = self._tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        if loss_on == "all":
            return ids, np.ones(len(ids), bool)
        starts = np.asarray([a for a, _ in enc.offsets], np.int64)
        mask = np.zeros(len(ids), bool)
        for lo, hi in self._assistant_spans(messages, text):
            mask |= (starts >= lo) & (starts < hi)
        return ids, mask

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids that ask the model for the next assistant turn: the conversation rendered
        with ``add_generation_prompt=True``, without special tokens added (the template writes
        its own), as ``apply_chat_template(messages, add_generation_prompt=True)``."""
        text = self.render(messages, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False).ids

    def end_of_turn(self) -> list[int]:
        """The special token ids the template writes after an assistant turn's content (Llama
        3's ``<|eot_id|>``, ChatML's ``<|im_end|>``): where a generated reply ends. Empty when
        the template writes none or refuses a plain user/assistant exchange."""
        mark = "SHARDAXENDOFTURNMARK"
        try:
            text = self.render([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": mark}])
        except ValueError:
            return []
        if mark not in text:
            return []
        after = self._tok.encode(text[text.rindex(mark) + len(mark):],
                                 add_special_tokens=False).ids
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return [i for i in after if i in special]

    def _assistant_spans(self, messages: Sequence[dict], text: str) -> list[tuple[int, int]]:
        """Character ranges of ``text`` that each assistant turn adds: from the end of the
        conversation before it (with the generation prompt) to the end of the turn."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"chat template of {self.directory}: the conversation up to assistant turn "
                    f"{i} does not render as a prefix of the whole conversation, so its tokens "
                    "cannot be found; train with --loss-on all")
            spans.append((len(before), len(through)))
        return spans


class _Refused(ValueError):
    """The template's own ``raise_exception``: it refuses a conversation."""


def _one_line(e: object) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _template_line(e: BaseException) -> str:
    """``'line N: '`` of the template line an error was raised on (Jinja2 rewrites the
    traceback to show template lines), or ``''``."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if f.filename == "<template>"]
    return f"line {lines[-1]}: " if lines else ""


def _iterates_content(nodes: Any, tree: Any) -> bool:
    """Whether the template loops over a message's content (``{% for part in
    message['content'] %}``, directly or through a ``{% set %}`` name), as templates that
    take content parts do."""

    def is_content(n: Any) -> bool:
        return ((isinstance(n, nodes.Getattr) and n.attr == "content")
                or (isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const)
                    and n.arg.value == "content"))

    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(n) or (isinstance(n, nodes.Name) and n.name in names)
               for loop in tree.find_all(nodes.For)
               for n in (loop.iter, *loop.iter.find_all(nodes.Node)))


def _joined(message: dict) -> dict:
    """``message`` with a list of text parts as content replaced by their texts joined."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(p.get("text", "") for p in content
                                             if isinstance(p, dict))}


@lru_cache(maxsize=8)
def _template(directory: str) -> ChatTemplate:
    return ChatTemplate(directory)


def render_chat(tokenizer_dir: str | Path, messages: Sequence[dict],
                loss_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """``(ids, loss_mask)`` of one conversation under the chat template of the Hugging Face
    tokenizer in ``tokenizer_dir`` (``tokenizer.json`` + ``tokenizer_config.json``): the ids
    ``apply_chat_template(messages, tokenize=True)`` gives, and a mask that is True exactly on
    the assistant turns' tokens (every token with ``loss_on='all'``).

    Example::

        ids, mask = render_chat("models/qwen", [{"role": "user", "content": "2+2?"},
                                                {"role": "assistant", "content": "4"}])
        [i for i, m in zip(ids, mask) if m]    # the ids of "4<|im_end|>\\n"
    """
    ids, mask = _template(str(tokenizer_dir)).encode(messages, loss_on)
    return ids.tolist(), mask.tolist()


def is_chat_file(path: str | Path, split: str = "train") -> bool:
    """Whether ``path`` is a ``.jsonl`` file whose first record has a ``messages`` list (a
    first line that is not JSON says no: reading the file as text data then names it), or a
    ``datasets`` folder whose ``split`` has a ``messages`` column."""
    path = Path(path)
    if path.is_dir():
        found = find_dataset(path, split)
        return bool(found) and "messages" in columns(DataFile(found.files[0], found.kind))
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = parse_json(line, str(path))
                except ValueError:
                    return False
                return isinstance(record, dict) and isinstance(record.get("messages"), list)
    return False


def chat_records(path: str | Path, flag: str = "--data", split: str = "train"
                 ) -> Iterator[tuple[str, list[dict]]]:
    """``("FILE:LINE", messages)`` of every record of a ``.jsonl`` file, or ``("FILE:ROW",
    messages)`` of a ``datasets`` folder's ``split``, each checked by `chat_messages`
    (errors start with ``flag``).

    Example::

        for where, messages in chat_records("chat.jsonl"): ...   # where: 'chat.jsonl:1'
    """
    if Path(path).is_dir():
        for file in list_data_files([path], split=split):
            for n, record in enumerate(read_records(file, ["messages"]), 1):
                where = f"{file.path}:{n}"
                yield where, chat_messages(record, f"{flag} {where}")
        return
    with Path(path).open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{flag} {path}:{n}"
            yield f"{path}:{n}", chat_messages(parse_json(line, where), where)


def chat_messages(record: Any, where: str) -> list[dict]:
    """The ``messages`` of a JSON record, each message checked to have a string ``role`` and
    a ``content`` that is a string or a list of text parts; a ValueError starting with
    ``where`` names the field otherwise.

    >>> chat_messages({"messages": [{"role": "user", "content": "hi"}]}, "chat.json")
    [{'role': 'user', 'content': 'hi'}]
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    messages = record.get("messages")
    if not (isinstance(messages, list) and messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                         "{'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        _check_message(message, where, i)
    return messages


def read_chats(path: str | Path) -> list[list[dict]]:
    """The ``messages`` of every record of a ``.jsonl`` file, checked as in `chat_records`."""
    return [messages for _, messages in chat_records(path)]


def _check_message(message: Any, where: str, i: int) -> None:
    """A ValueError naming ``where`` and ``messages[i]`` unless ``message`` has a string role
    and a content that is a string, a list of text parts, or null/absent beside
    ``tool_calls``."""
    at = f"{where}: messages[{i}]"
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        problem = ("has no string 'role'" if isinstance(message, dict) else
                   f"is a JSON {type(message).__name__}")
        raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                         f"{{'role': ..., 'content': ...}} objects (messages[{i}] {problem})")
    content = message.get("content")
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return
    expected = 'expected a string or a list of {"type": "text", "text": ...} parts'
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"{at}.content[{j}]: {kind!r} part not supported: only text "
                                 "parts can be trained on")
            raise ValueError(f"{at}.content[{j}] is not a text part: expected "
                             '{"type": "text", "text": string}')
        return
    got = ("missing" if "content" not in message else "null" if content is None
           else f"a JSON {type(content).__name__}")
    raise ValueError(f"{at}.content is {got}; {expected}")
