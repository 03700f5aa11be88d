"""What turns ``--data`` files into batches: readers, tokenizers, the token cache, chat
templates, packing with document masks, weighted mixtures and preference pairs.

The bottom of the training wing: imports nothing else of `shardax.train`.
"""
