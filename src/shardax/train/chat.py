"""Chat conversations as token ids and a loss mask, rendered with the tokenizer's own template.

`render_chat` renders ``messages`` ([{role, content}], OpenAI / Hugging Face style) with the
``chat_template`` of the tokenizer directory's ``tokenizer_config.json`` the way transformers'
``apply_chat_template`` does (a sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception``, the special tokens as variables,
``add_generation_prompt=False``) and tokenizes the text without adding special tokens, so the
ids equal ``tokenizer.apply_chat_template(messages, tokenize=True)``. The loss mask marks the
tokens of each assistant turn as the template renders it (its content and end-of-turn
tokens), found by rendering the conversation up to each turn; ``loss_on='all'`` marks every
token. `read_chats` reads the ``messages`` of a ``.jsonl`` file.

Example::

    ids, mask = render_chat("models/llama", [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}])
    # mask[i] is True for the tokens of "hello<|eot_id|>"
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from shardax.filecheck import read_regular
from shardax.train.tokenizer import MAX_TOKENIZER_BYTES

__all__ = ["LOSS_ON", "ChatTemplate", "is_chat_file", "read_chats", "render_chat"]

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
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer  # optional: extra "hf"
        except ImportError as e:
            raise ValueError(f"chat data needs the '{e.name}' package: "
                             "pip install 'shardax[hf]'") from None
        self.directory = directory = Path(str(directory).removeprefix("hf:"))
        config_path = directory / "tokenizer_config.json"
        try:  # regular files only (never wait on a FIFO), of bounded size
            config = json.loads(read_regular(config_path, limit=MAX_TOKENIZER_BYTES))
            self._tok = Tokenizer.from_str(read_regular(
                directory / "tokenizer.json", limit=MAX_TOKENIZER_BYTES).decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception types for bad JSON
            raise ValueError(f"chat template of {directory}: cannot read "
                             f"tokenizer_config.json and tokenizer.json ({e})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses 'default'
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{config_path} has no chat_template: chat data (records with "
                             "'messages') needs a tokenizer with a chat template")
        self.specials = {k: _content(config[k]) for k in _SPECIALS if config.get(k) is not None}

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template of {directory}: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation's text, as ``apply_chat_template(tokenize=False)`` renders it."""
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **self.specials)

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


def _content(token: Any) -> str:
    """A special token of tokenizer_config.json: a string, or a dict with its 'content'."""
    return token.get("content", "") if isinstance(token, dict) else str(token)


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


def is_chat_file(path: str | Path) -> bool:
    """Whether ``path`` is a ``.jsonl`` file whose first record has a ``messages`` list."""
    path = Path(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return False
                return isinstance(record, dict) and isinstance(record.get("messages"), list)
    return False


def read_chats(path: str | Path) -> list[list[dict]]:
    """The ``messages`` of every record of a ``.jsonl`` file, checked to be lists of
    ``{role, content}`` dicts (a ValueError names the file and line otherwise)."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line).get("messages")
            except (ValueError, AttributeError):
                raise ValueError(f"--data {path}:{n}: not a JSON object") from None
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
                raise ValueError(f"--data {path}:{n}: 'messages' must be a non-empty list of "
                                 "{'role': ..., 'content': ...} objects")
            out.append(messages)
    return out
