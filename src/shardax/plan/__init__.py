"""Plan before you spend: compile a training configuration from abstract shapes, estimate its
memory and step time on a target accelerator's hardware model, search the parallel layouts for
the fastest one that fits (``shardax plan [--search] [--calibrate RUN_DIR...]``), and check that
a layout computes what one device computes (``shardax verify``, `shardax.plan.verify`)."""

from shardax.plan.estimate import Compiled, Estimate, compile_config, estimate, plan_config
from shardax.plan.search import SearchResult, candidates, search

__all__ = ["Compiled", "Estimate", "SearchResult", "candidates", "compile_config", "estimate",
           "plan_config", "search"]
