"""Public face of shardax's data helpers for users and tests: chat rendering.

>>> from shardax.data import render_chat
>>> ids, loss_mask = render_chat("tests/fixtures/chat/llama3",
...                              [{"role": "user", "content": "hello there!"},
...                               {"role": "assistant", "content": "red"}])  # doctest: +SKIP
"""

from shardax.train.data.chat import render_chat

__all__ = ["render_chat"]
