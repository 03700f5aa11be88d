"""Model code's name for ``shardax.logical.with_logical_constraint``."""

from shardax.logical import current_logical_rules, use_logical_rules
from shardax.logical import with_logical_constraint as constrain

__all__ = ["constrain", "current_logical_rules", "use_logical_rules"]
