"""What turns ``--data`` files into batches: readers (files, datasets on disk), tokenizers,
the token cache, chat templates, packing with document masks, weighted mixtures and
preference pairs. Below the training wing: it imports nothing of `shardax.train`, the
models or the planner.

Its public face is chat rendering:

>>> from shardax.data import render_chat
>>> ids, loss_mask = render_chat("tests/fixtures/chat/llama3",
...                              [{"role": "user", "content": "hello there!"},
...                               {"role": "assistant", "content": "red"}])  # doctest: +SKIP
"""

from shardax.data.chat import render_chat

__all__ = ["render_chat"]
