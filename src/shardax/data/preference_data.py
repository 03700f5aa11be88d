"""Preference data (``prompt`` / ``chosen`` / ``rejected``) as token rows for DPO, SimPO and ORPO.

`read_preferences` reads a ``.jsonl`` file in either of TRL's preference formats (its "dataset
formats" guide): *standard*, where each field is a string (``{"prompt": "The sky is", "chosen":
" blue.", "rejected": " green."}``), or *conversational*, where ``prompt`` is the conversation so
far (a ``messages`` list) and ``chosen`` / ``rejected`` the assistant's reply (a list of
assistant messages, usually one, or a plain string). The implicit-prompt variant (no
``prompt``) is refused by name.

`encode_preferences` turns each record into two sequences, prompt + chosen and prompt +
rejected, as TRL's ``DPOTrainer`` does. A conversational record is rendered by the chat template
as ``maybe_apply_chat_template`` renders it: the completion is what prompt + reply adds to the
prompt rendered with the generation prompt (the reply and its end-of-turn tokens; assistant
turns inside the prompt are not completion). The whole text is tokenized once
(`ChatTemplate.encode`: the ids ``apply_chat_template(prompt + reply)`` gives, as chat SFT sees
them) where TRL tokenizes prompt and completion apart; the two differ only where a token would
straddle the generation prompt's end. A standard record's prompt is tokenized as a shardax
prompt (`Tokenizer.encode`: the tokenizer's prefix, e.g. BOS, then the text), its completion
apart and followed by the document end (`Tokenizer.end`: the eos id), as TRL appends eos. Rows are
``seq_len + 1`` tokens split into inputs and next-token labels; a longer sequence keeps its
*last* ``seq_len + 1`` tokens (TRL's default ``truncation_mode="keep_end"``): the prompt is cut
from the left first, the completion only when it alone is longer than a row.

Chosen and rejected are stacked so that one forward computes both: with ``N`` records every array
is ``[2N, seq_len]``, rows ``0..N-1`` the chosen and ``N..2N-1`` the rejected sequences (row ``i``
and row ``N + i`` share record ``i``'s prompt); `sequence_logps` of ``(logits, labels,
completion_mask)`` then gives the log-probabilities the preference losses take.

Example::

    records = read_preferences("prefs.jsonl")
    rows = encode_preferences(records, load_tokenizer("bytes"), seq_len=256)
    logps, counts = sequence_logps(model(rows.inputs), rows.labels, rows.completion_mask)
    chosen, rejected = logps[:len(records)], logps[len(records):]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardax.data.chat import ChatTemplate, chat_messages
from shardax.data.tokenizer import Tokenizer
from shardax.errors import DataError, UsageError
from shardax.filecheck import parse_json, read_regular

__all__ = ["MAX_PREFERENCE_BYTES", "PreferenceRows", "encode_preferences", "read_preferences"]

#: The most a preference ``.jsonl`` file may hold (it is read whole).
MAX_PREFERENCE_BYTES = 4 * 2**30
_FIELDS = ("prompt", "chosen", "rejected")


class PreferenceRows(NamedTuple):
    """Chosen and rejected sequences, stacked: each array ``[2N, seq_len]``, rows ``0..N-1``
    chosen, ``N..2N-1`` rejected. ``inputs`` int32 token ids (right-padded with the eos id),
    ``labels`` int32 the next token of each input, ``completion_mask`` bool: True where the
    label is a completion token (what `sequence_logps` sums); ``truncated``: sequences cut to
    fit a row."""

    inputs: np.ndarray
    labels: np.ndarray
    completion_mask: np.ndarray
    truncated: int


def read_preferences(path: str | Path, flag: str = "--data") -> list[dict]:
    """The records of a preference ``.jsonl`` file, each ``{"prompt", "chosen", "rejected",
    "where"}`` (``where``: ``"FILE:LINE"``), checked: a record that is not JSON, lacks a
    field, has a field of the wrong type or an empty completion is a one-line `DataError`
    starting with ``flag``, the file and line, and naming the field.

    Example::

        records = read_preferences("prefs.jsonl")
        records[0]["chosen"]     # ' blue.' or [{'role': 'assistant', 'content': 'Blue.'}]
    """
    try:
        raw = read_regular(path, MAX_PREFERENCE_BYTES)
    except ValueError as e:
        raise DataError(f"{flag} {e}") from None
    records = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{flag} {path}:{n}"
        try:
            record = parse_json(line, where)
        except ValueError as e:
            raise DataError(str(e)) from None
        records.append({**_check_record(record, where), "where": f"{path}:{n}"})
    if not records:
        raise DataError(f"{flag} {path}: no records (expected one JSON object per line with "
                        "'prompt', 'chosen' and 'rejected')")
    return records


def _check_record(record: Any, where: str) -> dict:
    """``record``'s three fields, a completion given as a string beside a conversational
    prompt made one assistant message; a `DataError` naming ``where`` and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object (expected 'prompt', 'chosen', 'rejected')")
    for name in _FIELDS:
        if name not in record:
            hint = (" (the implicit-prompt format is not supported: put the shared beginning "
                    "in 'prompt')" if name == "prompt" else "")
            raise DataError(f"{where}: no {name!r} field{hint}")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt = _messages(prompt, where, "prompt")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: field 'prompt' is a JSON {type(prompt).__name__}; expected a "
                        "string or a list of {'role': ..., 'content': ...} messages")
    out = {"prompt": prompt}
    for name in ("chosen", "rejected"):
        value = record[name]
        if isinstance(prompt, list) and isinstance(value, str):
            value = [{"role": "assistant", "content": value}]
        if isinstance(value, list) and isinstance(prompt, list):
            value = _messages(value, where, name)
            roles = [m["role"] for m in value]
            if any(r != "assistant" for r in roles):
                raise DataError(f"{where}: field {name!r} has roles {roles}; expected the "
                                "assistant's reply (messages with role 'assistant')")
            empty = all(_empty(m.get("content")) for m in value)
        elif isinstance(value, str) and isinstance(prompt, str):
            empty = not value
        else:
            expected = ("a string or a list of assistant messages" if isinstance(prompt, list)
                        else "a string (the prompt is a string)")
            raise DataError(f"{where}: field {name!r} is a JSON {type(value).__name__}; "
                            f"expected {expected}")
        if empty:
            raise DataError(f"{where}: field {name!r} is empty; a completion needs text")
        out[name] = value
    return out


def _messages(value: list, where: str, name: str) -> list[dict]:
    """``value`` checked as a ``messages`` list by `chat_messages`, as a `DataError`."""
    try:
        return chat_messages({"messages": value}, f"{where}: field {name!r}")
    except ValueError as e:
        raise DataError(str(e)) from None


def _empty(content: Any) -> bool:
    if isinstance(content, list):
        return all(not p.get("text") for p in content)
    return not content


def encode_preferences(records: Sequence[dict], tokenizer: Tokenizer, seq_len: int,
                       template: ChatTemplate | None = None) -> PreferenceRows:
    """Token rows of ``records`` (from `read_preferences`, or dicts with ``prompt``,
    ``chosen``, ``rejected`` of the same types): chosen rows first, then rejected rows, each
    prompt + completion truncated from the left to ``seq_len + 1`` tokens and right-padded
    (see the module's doc). Conversational records need the ``template`` of the tokenizer's
    directory.

    >>> from shardax.data.tokenizer import ByteTokenizer
    >>> rows = encode_preferences([{"prompt": "2+2=", "chosen": "4", "rejected": "5"}],
    ...                           ByteTokenizer(), seq_len=8)
    >>> rows.inputs.shape                          # chosen, then rejected
    (2, 8)
    >>> rows.labels[0][rows.completion_mask[0]].tolist()   # "4", then the eos id
    [52, 0]
    """
    if seq_len < 1:
        raise UsageError(f"seq_len {seq_len}: must be >= 1")
    width = seq_len + 1
    n = len(records)
    tokens = np.full((2 * n, width), tokenizer.eos_id, np.int32)
    mask = np.zeros((2 * n, width), bool)
    truncated = 0
    for k, record in enumerate(records):
        where = record.get("where", f"record {k}")
        for side, name in enumerate(("chosen", "rejected")):
            ids, learn = _encode(record["prompt"], record[name], tokenizer, template, where)
            if len(ids) > width:  # keep_end: the prompt goes first
                ids, learn, truncated = ids[-width:], learn[-width:], truncated + 1
            row = side * n + k
            tokens[row, :len(ids)] = ids
            mask[row, :len(ids)] = learn
    return PreferenceRows(tokens[:, :-1], tokens[:, 1:], mask[:, 1:], truncated)


def _encode(prompt: str | list, reply: str | list, tokenizer: Tokenizer,
            template: ChatTemplate | None, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, completion mask)`` of one sequence."""
    if isinstance(prompt, str):
        asked = tokenizer.encode(prompt)
        ids = np.concatenate([asked, tokenizer.encode_pieces([reply])[0],
                              tokenizer.end()]).astype(np.int32)
        return ids, np.arange(len(ids)) >= len(asked)
    if template is None:
        raise UsageError(f"--data {where}: a conversational record needs a tokenizer with a "
                         "chat template (--tokenizer DIR with chat_template)")
    if isinstance(reply, str):
        reply = [{"role": "assistant", "content": reply}]
    try:
        asked = template.render(prompt, add_generation_prompt=True)
        whole = template.render([*prompt, *reply])
        if not whole.startswith(asked):
            raise DataError(f"{template.where} does not render the prompt with the generation "
                            "prompt as a prefix of prompt + reply, so the reply's tokens cannot "
                            "be told apart")
        ids, mask = template.encode([*prompt, *reply])
        earlier = int(template.encode(prompt)[1].sum())  # the prompt's own assistant turns
    except ValueError as e:
        raise DataError(f"--data {where}: {e}") from None
    mask[np.flatnonzero(mask)[:earlier]] = False
    return ids, mask
