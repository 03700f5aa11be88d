"""Chat SFT batches: rendered conversations packed whole into rows, sampled by step.

Each conversation (`shardax.data.chat`) becomes ids and a loss mask; conversations are packed
in file order into rows of ``seq_len + 1`` tokens, first fit, never split: one longer than a
row is truncated to it (and counted). The rest of a row is padding (the tokenizer's eos id,
out of the loss, a segment of its own). A batch is ``(inputs, targets, segment_ids,
loss_mask)``, each [rows, seq_len]: the segment ids number the conversations of a row, so
attention and RoPE positions stay within one (`shardax.train.step`), and the mask is true on
the targets to learn (an assistant token of the same conversation). Like
`shardax.data.lm_data.TokenBatches`, the batch at step ``k`` is a pure function of
``(seed, k)``: each epoch visits every row once in an order drawn from ``(seed, epoch)``.

Example::

    rows = pack_chats(chats, template, seq_len=128, pad_id=tok.eos_id)
    data = ChatBatches(rows, batch_size=8, seed=0)
    inputs, targets, segment_ids, loss_mask = data.batch(0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from shardax.data.chat import ChatTemplate
from shardax.data.lm_data import EpochOrder, check_same

__all__ = ["ChatBatches", "ChatRows", "chat_val_batches", "pack_chats"]


class ChatRows(NamedTuple):
    """Packed conversations: ``tokens`` int32, ``segments`` int32 and ``mask`` bool, each
    [rows, seq_len + 1]; ``truncated``: conversations cut to fit a row."""

    tokens: np.ndarray
    segments: np.ndarray
    mask: np.ndarray
    truncated: int


def pack_chats(chats: Sequence[Sequence[dict]], template: ChatTemplate, seq_len: int,
               pad_id: int, loss_on: str = "assistant",
               where: Sequence[str] | None = None) -> ChatRows:
    """Renders and packs ``chats`` into rows of ``seq_len + 1`` tokens (first fit, in order);
    ``where``: each conversation's ``FILE:LINE``, named when the template fails on it.

    Example::

        rows = pack_chats([[{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}]], template, 32, 0)
        rows.tokens.shape          # (1, 33)
    """
    width = seq_len + 1
    bins: list[list[tuple[np.ndarray, np.ndarray]]] = []
    room: list[int] = []
    truncated = 0
    for k, chat in enumerate(chats):
        try:
            ids, mask = template.encode(chat, loss_on)
        except ValueError as e:
            if where is None:
                raise
            raise ValueError(f"--data {where[k]}: {e}") from None
        if len(ids) > width:
            ids, mask, truncated = ids[:width], mask[:width], truncated + 1
        for b, free in enumerate(room):
            if free >= len(ids):
                bins[b].append((ids, mask))
                room[b] -= len(ids)
                break
        else:
            bins.append([(ids, mask)])
            room.append(width - len(ids))
    tokens = np.full((len(bins), width), pad_id, np.int32)
    segments = np.zeros((len(bins), width), np.int32)
    masks = np.zeros((len(bins), width), bool)
    for r, items in enumerate(bins):
        at = 0
        for s, (ids, mask) in enumerate(items):
            tokens[r, at:at + len(ids)] = ids
            segments[r, at:at + len(ids)] = s
            masks[r, at:at + len(ids)] = mask
            at += len(ids)
        segments[r, at:] = len(items)  # the padding: a segment of its own, never learnt
    return ChatRows(tokens, segments, masks, truncated)


def _split(rows: ChatRows, index: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(inputs, targets, segment_ids, loss_mask)`` of the rows ``index``: a target is learnt
    where the mask says so and it belongs to its input's conversation."""
    tok, seg, mask = rows.tokens[index], rows.segments[index], rows.mask[index]
    learn = mask[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    return tok[:, :-1], tok[:, 1:], seg[:, :-1], learn


class ChatBatches:
    """Deterministic, resumable batches of packed conversations (rows split over processes
    as in `shardax.data.lm_data.TokenBatches`).

    Example::

        data = ChatBatches(rows, batch_size=8, seed=0)
        inputs, targets, segment_ids, loss_mask = data.batch(3)
    """

    def __init__(self, rows: ChatRows, batch_size: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1):
        if len(rows.tokens) < 1:
            raise ValueError("no conversations to train on")
        if batch_size % process_count:
            raise ValueError(f"batch size {batch_size} is not divisible by {process_count} "
                             "processes")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = batch_size // process_count
        self.seq_len = rows.tokens.shape[1] - 1
        self.step = 0
        self._order = EpochOrder(len(rows.tokens), seed)

    def batch(self, step: int) -> tuple[np.ndarray, ...]:
        """This process's ``(inputs, targets, segment_ids, loss_mask)`` for ``step``."""
        first = step * self.batch_size + self.process_index * self.local_batch_size
        index = self._order(range(first, first + self.local_batch_size))
        return _split(self.rows, index)

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: the next step, plus the settings it depends on."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_rows": len(self.rows.tokens)}

    def restore(self, state: dict[str, Any]) -> ChatBatches:
        """Continues from ``state()``; the process count may differ from the saving run."""
        check_same(state, self.state(), ("seed", "seq_len", "batch_size", "num_rows"))
        self.step = int(state["step"])
        return self


def chat_val_batches(rows: ChatRows, batch_size: int, num_batches: int, process_index: int = 0,
                     process_count: int = 1) -> list[tuple[np.ndarray, ...]]:
    """Up to ``num_batches`` fixed evaluation batches of the rows in order; a last partial
    batch is filled with rows that have no learnt token (so the mean is over real tokens)."""
    n = len(rows.tokens)
    count = min(num_batches, -(-n // batch_size))
    local = batch_size // process_count
    out = []
    for b in range(count):
        index = np.arange(b * batch_size + process_index * local,
                          b * batch_size + (process_index + 1) * local)
        inputs, targets, segs, mask = _split(rows, np.minimum(index, n - 1))
        mask = mask & (index < n)[:, None]
        out.append((inputs, targets, segs, mask))
    return out
