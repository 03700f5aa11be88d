"""The scalax-compatible face of shardax: ``from shardax.sharding import ...``.

>>> from shardax.sharding import MeshShardingHelper, PartitionSpec, FSDPShardingRule
>>> mesh = MeshShardingHelper([-1], ["fsdp"])
"""

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.constraints import with_sharding_annotation, with_sharding_constraint
from shardax.context import ShardingContext
from shardax.inspect import ShardingPlan
from shardax.jit import ShardedFunction, SJITCompiledFunction, sjit
from shardax.logical import use_logical_rules, with_logical_constraint
from shardax.mesh import (
    MeshShardingHelper,
    get_global_annotation_shardings,
    get_global_mesh,
    get_global_mesh_helper,
)
from shardax.rulecheck import ReplicationWarning
from shardax.rules import (
    FSDPShardingRule,
    LogicalAxisRules,
    PolicyShardingRule,
    ShardingRule,
    TreePathShardingRule,
    match_specs,
)
from shardax.utils import named_tree_map

MeshShardingContext = ShardingContext  # scalax's name

__all__ = [
    "Mesh",
    "NamedSharding",
    "PartitionSpec",
    "MeshShardingHelper",
    "ShardingContext",
    "MeshShardingContext",
    "ShardedFunction",
    "SJITCompiledFunction",
    "ShardingPlan",
    "sjit",
    "ShardingRule",
    "FSDPShardingRule",
    "TreePathShardingRule",
    "PolicyShardingRule",
    "LogicalAxisRules",
    "match_specs",
    "ReplicationWarning",
    "with_sharding_constraint",
    "with_sharding_annotation",
    "with_logical_constraint",
    "use_logical_rules",
    "get_global_mesh_helper",
    "get_global_mesh",
    "get_global_annotation_shardings",
    "named_tree_map",
]
