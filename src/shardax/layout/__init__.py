"""How a model runs: a frozen `Layout` (tensor, sequence and pipeline parallelism, FSDP mode,
remat, attention implementation), the rule presets and mesh-axis names, and one forward
(`shardax.layout.forward`) that runs any model of `shardax.models` on any layout with
``shardax.parallel``.

Example::

    from shardax import layout
    rules = LogicalAxisRules(layout.PRESETS["fsdp_tp"])
    objective, ce = layout.forward.training_loss(model, layout.Layout(tp_mode="sync"),
                                                 tokens[:, :-1], tokens[:, 1:])
"""

from shardax.layout import forward, presets
from shardax.layout.presets import PRESETS
from shardax.layout.spec import (
    FSDP_MODES,
    PP_SCHEDULES,
    TP_MODES,
    Layout,
    check_mesh,
    pipeline_layouts,
)

__all__ = ["FSDP_MODES", "PP_SCHEDULES", "PRESETS", "TP_MODES", "Layout", "check_mesh",
           "forward", "pipeline_layouts", "presets"]
