"""shardax: write JAX training code for one device, run it on many.

>>> import shardax
>>> mesh = shardax.MeshShardingHelper.from_string("fsdp=-1")
"""

from shardax.sharding import *  # noqa: F403 - the public face is sharding.py
from shardax.sharding import __all__ as _sharding_all

__version__ = "0.1.0"
__all__ = list(_sharding_all)
