"""The machinery around a run: checkpoints and their fingerprints, the run lock, stopping,
non-finite steps, profiling, progress and metrics, MFU, the compilation cache.

The bottom of the training wing: it imports nothing else of `shardax.train` (below it,
`shardax.data` for the cache root).
"""
