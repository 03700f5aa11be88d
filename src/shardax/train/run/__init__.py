"""The machinery around a run: checkpoints and their fingerprints, the run lock, stopping,
non-finite steps, profiling, progress and metrics, MFU, the compilation cache.

Imports of `shardax.train` go only down, to `shardax.train.data`.
"""
