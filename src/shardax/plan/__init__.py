"""Plan before you spend: compile a training configuration from abstract shapes, estimate its
memory and step time on a target accelerator, and search the parallel layouts for the fastest
one that fits (``shardax plan [--search]``)."""

from shardax.plan.estimate import Compiled, Estimate, compile_config, estimate, plan_config
from shardax.plan.search import SearchResult, candidates, search

__all__ = ["Compiled", "Estimate", "SearchResult", "candidates", "compile_config", "estimate",
           "plan_config", "search"]
