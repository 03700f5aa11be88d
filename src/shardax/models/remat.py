"""Rematerialisation by name: the activation names the models mark, and the policy string
(``shardax.layout.Layout.remat``) turned into a ``jax.checkpoint`` policy.

Policies: ``'none'`` (no remat), ``'full'`` (save nothing, recompute each layer),
``'dots'`` (alias ``'save_dots'``: save matmul outputs without batch dims), ``'offload'``
(those matmul outputs go to host memory), ``'names:q,k,v'`` (save just the named
activations), ``'offload:q,k'`` (the named activations go to host memory, where the backend
has a ``pinned_host`` memory kind; else they are saved on the device).

Example::

    policy = remat_policy('names:q,k,v,attn_out')
    layer = jax.checkpoint(layer, policy=policy)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["CHECKPOINT_NAMES", "REMAT_POLICIES", "check_remat", "checkpoint_name",
           "remat_policy"]

REMAT_POLICIES = ("none", "full", "dots", "save_dots", "offload")
# Activations the models name (per layer): attention's projections and output, the MLP's.
CHECKPOINT_NAMES = ("q", "k", "v", "attn_out", "attn_proj", "mlp_gate", "mlp_up",
                    "mlp_hidden", "mlp_out")
_FORMS = "'none', 'full', 'dots', 'save_dots', 'offload', 'names:a,b,...' or 'offload:a,b,...'"


def _names(policy: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in policy.split(":", 1)[1].split(",") if n.strip())
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    if not names or unknown:
        raise ValueError(f"remat {policy!r}: names must be some of {CHECKPOINT_NAMES}"
                         + (f"; unknown {unknown}" if unknown else ""))
    return names


def check_remat(policy: str) -> None:
    """Raises ``ValueError`` (listing the accepted forms) unless ``policy`` is a remat policy.

    Example::

        check_remat('names:q,k,v')
    """
    if not isinstance(policy, str):
        raise ValueError(f"remat must be a string ({_FORMS}), got {policy!r}")
    if policy.startswith(("names:", "offload:")):
        _names(policy)
    elif policy not in REMAT_POLICIES:
        raise ValueError(f"remat must be {_FORMS}, got {policy!r}")


def _host_offload() -> bool:
    """Whether the default device has a ``pinned_host`` memory to offload to."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return "pinned_host" in kinds


def remat_policy(policy: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy for a remat policy string (``'none'`` gives ``None``).

    Example::

        remat_policy('offload:q,k')   # q and k to pinned host memory, the rest recomputed
    """
    check_remat(policy)
    cp = jax.checkpoint_policies
    if policy == "none":
        return None
    if policy == "full":
        return cp.nothing_saveable
    if policy in ("dots", "save_dots"):
        return cp.dots_with_no_batch_dims_saveable
    if policy == "offload":
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    names = _names(policy)
    if policy.startswith("offload:") and _host_offload():
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
            offload_src="device", offload_dst="pinned_host")
    return cp.save_only_these_names(*names)
