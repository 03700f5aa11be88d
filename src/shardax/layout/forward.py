"""One forward that runs any model (the protocol of `shardax.models.protocol`) on any layout.

It reads the mesh and the `Layout` and picks, from ``shardax.parallel``: the layer stack as a
scan or loop (``layout.scan_layers``), a pipeline over 'pp' (gpipe, circular, 1f1b), or
explicit FSDP's gathered stack (`fsdp_value_and_grad`); tensor-parallel blocks over 'tp' and
the mixture of experts over 'ep' (`shardax.layout.blocks`); ring attention over 'cp' (else
``layout.attention``'s implementation); each layer under ``layout.remat``. The model itself
stays the one-device architecture, as torchtitan's ``parallelize_*`` applies parallelism from
outside the model.

On a 'pp' mesh the final norm, head and cross-entropy run on the pipeline's output stage only
(``pipeline(loss_fn=...)``): the outputs never leave it and just the two scalars are reduced
over 'pp'. Without a mesh every path computes the plain single-device math.

Example::

    objective, ce = training_loss(model, Layout(pp_schedule="1f1b", pp_microbatches=4),
                                  tokens[:, :-1], tokens[:, 1:])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shardax.constraints import with_sharding_constraint
from shardax.layout.axes import CONTEXT_AXIS, FSDP_AXIS, PIPELINE_AXIS
from shardax.layout.blocks import block_fn
from shardax.layout.spec import Layout
from shardax.logical import (
    auto_mesh_axes,
    current_logical_rules,
    use_logical_rules,
    with_logical_constraint,
)
from shardax.models import embedding
from shardax.models.attention import attention
from shardax.models.loss import RowGroups, chunked_cross_entropy
from shardax.models.protocol import LanguageModel, MoEStats, aux_loss, run_blocks, split_stack
from shardax.models.remat import remat_policy
from shardax.parallel import fsdp, to_microbatches
from shardax.parallel.axes import axis_size, manual_axes
from shardax.parallel.context import ring_attention
from shardax.parallel.pipeline import pipeline, to_stage_layout
from shardax.precision import Policy

__all__ = ["fsdp_value_and_grad", "logits", "loss", "params_loss", "per_data_shard",
           "ring_attend", "training_loss", "value_and_grad"]


def _identity(logits: jax.Array) -> jax.Array:
    return logits


def logits(model: LanguageModel, layout: Layout, tokens: jax.Array,
           positions: jax.Array | None = None, *, segment_ids: jax.Array | None = None,
           load_balanced: bool = False, return_aux: bool = False):
    """Logits ``[b, s, vocab]`` (float32) of ``model`` under ``layout`` on the active mesh
    (``(logits, aux)`` with ``return_aux``). ``load_balanced``: ``tokens``, ``positions`` and
    ``segment_ids`` are in ``load_balance(., cp)`` order (then the logits are too).

    Example::

        out = logits(model, Layout(tp_mode="sync"), tokens)
    """
    run = _Run(model, layout, load_balanced)
    x, extras = model.embed_inputs(tokens, positions, segment_ids)
    if axis_size(PIPELINE_AXIS) > 1:
        x, aux = run.pipeline(x, extras)
    else:
        x, aux = run.stack(x, extras)
    out = model.head(x, *model.head_params())
    return (out, aux) if return_aux else out


def loss(model: LanguageModel, layout: Layout, tokens: jax.Array, targets: jax.Array,
         positions: jax.Array | None = None, *, segment_ids: jax.Array | None = None,
         load_balanced: bool = False, cast: Callable[[jax.Array], jax.Array] = _identity,
         loss_weights: jax.Array | None = None, stack: Callable | None = None,
         lookup: Callable | None = None, head_after_pipeline: bool = False,
         stats: bool = False) -> tuple[jax.Array, Any]:
    """``(cross-entropy, aux)``: the mean token cross-entropy of ``targets`` under
    ``cast(logits)`` and the model's auxiliary loss (an MoE's load balancing; 0 without one).
    ``stats``: ``aux`` is the stack's `MoEStats` (with the expert load) where the layers run
    unpipelined in the plain scan or loop; the loss alone elsewhere.
    ``loss_weights`` [b, s]: each token's cross-entropy is multiplied by its weight before the
    mean (``shardax.models.loss.chunked_cross_entropy``).

    Explicit FSDP's hooks: ``stack(layer_fn, x)`` runs the layers instead of the scan or loop
    (``layer_fn(layer_state, h)``, ``layer_state`` one slice of ``nnx.state(model.layers)``
    when stacked, one item when listed); ``lookup(table, tokens)`` looks up the token
    embeddings; ``head_after_pipeline``: on a 'pp' mesh the pipeline returns its outputs and
    the head and cross-entropy run after it (explicit FSDP: a loss region over 'pp' nested in
    FSDP's does not lower under differentiation in JAX 0.10:
    https://github.com/jax-ml/jax/pull/26588).

    Example::

        ce, aux = loss(model, Layout(), tokens[:, :-1], tokens[:, 1:])
    """
    run = _Run(model, layout, load_balanced, cast)
    x, extras = model.embed_inputs(tokens, positions, segment_ids, lookup=lookup)
    piped = axis_size(PIPELINE_AXIS) > 1
    if stack is not None and piped:
        raise ValueError("a custom layer stack (explicit FSDP) cannot run as a 'pp' "
                         "pipeline")
    if not piped or head_after_pipeline:
        if piped:
            x, aux = run.pipeline(x, extras)
        else:
            x, aux = run.stack(x, extras, stack, stats=stats)
        return run.cross_entropy(x, targets, *model.head_params(), weights=loss_weights), aux
    labels = _labels(targets, loss_weights)

    def ce(out, labels, *head):
        targets, weights = _unlabel(labels)
        return run.cross_entropy(out[0], targets, *head, gather=False, weights=weights)

    head = dict(loss_batch_args=(labels,), loss_args=model.head_params())
    if layout.pp_schedule == "1f1b":  # it differentiates one scalar per microbatch
        if model.has_aux:
            raise ValueError(
                "under the 1f1b pipeline schedule the gradient is taken inside the pipeline, "
                "of one scalar: use training_loss (cross-entropy + aux weight x aux) for a "
                "model with an auxiliary loss (a mixture of experts)")
        return run.pipeline(x, extras, loss_fn=ce, **head), jnp.zeros((), jnp.float32)

    def stage_loss(out, labels, *head):
        aux = run.aux(out) if model.has_aux else jnp.float32(0)
        return jnp.stack([ce(out, labels, *head), aux])

    both = run.pipeline(x, extras, loss_fn=stage_loss, **head)
    return both[0], both[1]


def training_loss(model: LanguageModel, layout: Layout, tokens: jax.Array, targets: jax.Array,
                  positions: jax.Array | None = None, **kwargs: Any
                  ) -> tuple[jax.Array, Any]:
    """``(objective, cross-entropy)``: what training differentiates, the cross-entropy plus
    ``model.aux_weight`` times the auxiliary loss (the cross-entropy alone without one), and
    the cross-entropy, to report. Arguments as for `loss`; with ``stats=True`` the second is
    ``(cross-entropy, MoEStats or None)``: the stack's expert load where `loss` has it.

    Under the '1f1b' schedule a model with an auxiliary loss needs this form: the pipeline
    takes the gradient of one scalar per microbatch (the objective) and reports the
    cross-entropy beside it, without gradient.

    Example::

        objective, ce = training_loss(model, Layout(), tokens[:, :-1], tokens[:, 1:])
    """
    stats = kwargs.pop("stats", False)
    if not (model.has_aux and axis_size(PIPELINE_AXIS) > 1 and layout.pp_schedule == "1f1b"
            and not kwargs.get("head_after_pipeline")):
        ce, aux = loss(model, layout, tokens, targets, positions, stats=stats, **kwargs)
        load = aux if isinstance(aux, MoEStats) else None
        objective = ce + model.aux_weight * aux_loss(aux) if model.has_aux else ce
        return objective, ((ce, load) if stats else ce)
    if stats:
        objective, ce = training_loss(model, layout, tokens, targets, positions, **kwargs)
        return objective, (ce, None)
    run = _Run(model, layout, kwargs.get("load_balanced", False), kwargs.get("cast", _identity))

    def objective(out, labels, *head):
        targets, weights = _unlabel(labels)
        ce = run.cross_entropy(out[0], targets, *head, gather=False, weights=weights)
        return ce + model.aux_weight * run.aux(out), ce

    x, extras = model.embed_inputs(tokens, positions, kwargs.get("segment_ids"),
                                   lookup=kwargs.get("lookup"))
    return run.pipeline(x, extras, loss_fn=objective,
                        loss_batch_args=(_labels(targets, kwargs.get("loss_weights")),),
                        loss_args=model.head_params(), loss_has_aux=True)


class _Run:
    """One forward's choices: the block (tensor-parallel or the model's), the attention
    (ring over 'cp', or the layout's implementation) and the output cast."""

    def __init__(self, model: LanguageModel, layout: Layout, load_balanced: bool,
                 cast: Callable = _identity):
        self.model, self.layout, self.cast = model, layout, cast
        self.block = block_fn(model, layout)
        self.attend = (ring_attend(load_balanced) if axis_size(CONTEXT_AXIS) > 1
                       else per_data_shard(partial(attention, implementation=layout.attention)))

    def cross_entropy(self, x, targets, *head, gather=True, weights=None):
        """Mean token cross-entropy from the final hidden states (times ``weights``), in
        sequence chunks (never the whole [b, s, vocab] logits; see ``shardax.models.loss``)."""
        return chunked_cross_entropy(lambda h, *p: self.cast(self.model.head(h, *p)), x,
                                     targets, weights=weights, gather=gather, params=head,
                                     groups=_data_groups() if gather else None)

    def aux(self, out):
        """The auxiliary loss from the pipeline's outputs (summed over layers per row)."""
        return jnp.mean(out[2]) / self.model.config.n_layers

    def stack(self, x, extras, stack=None, stats=False):
        """The layer stack without a pipeline (through ``stack`` when given): ``(x, aux)``,
        ``aux`` the stack's `MoEStats` with ``stats`` (plain scan or loop only)."""
        model, c = self.model, self.model.config
        if stack is None:
            return run_blocks(model, x, extras, self.block, self.attend, self.layout.remat,
                              stats=stats, scan=self.layout.scan_layers)
        if getattr(c, "mixed_layers", False):
            raise ValueError("a custom layer stack (explicit FSDP) needs identical layers "
                             "(no global_every)")
        graphdef = nnx.graphdef(model.layers)

        def layer_fn(state, h):
            return self.block(nnx.merge(graphdef, state), h, extras, self.attend)[0]

        if not model.has_aux:
            return stack(layer_fn, x), jnp.zeros((), jnp.float32)

        def aux_layer_fn(state, h):  # h: (x, the auxiliary losses so far)
            y, a = self.block(nnx.merge(graphdef, state), h[0], extras, self.attend)
            return y, h[1] + aux_loss(a)

        x, aux = stack(aux_layer_fn, (x, jnp.zeros((), jnp.float32)))
        return x, aux / c.n_layers

    def pipeline(self, x, extras, loss_fn=None, loss_batch_args=(), loss_args=(),
                 loss_has_aux=False):
        """The layer stack as a pipeline over 'pp'. Returns ``(x, aux)`` (outputs on every
        stage), or with ``loss_fn`` what ``pipeline(loss_fn=...)`` returns, computed on the
        output stage alone. Without ``loss_fn`` (logits only) '1f1b' runs as 'gpipe', the same
        forward pass. The parameters stay in the sequential layer order (portable
        checkpoints); ``to_stage_layout`` reorders them per step, which is free for gpipe and
        ``V = 1`` and moves part of the stack between stages for circular ``V > 1``.

        The auxiliary loss travels through the pipeline as one value per row (every row of a
        microbatch holds that microbatch's loss), so ``aux`` is the mean over microbatches:
        equal to the unpipelined loss when ``pp_microbatches == 1``."""
        model, lay = self.model, self.layout
        if not model.stacked:
            raise ValueError("a 'pp' mesh axis needs identical (stacked) layers")
        v = lay.virtual_stages
        graphdef, state = nnx.split(model.layers)
        state = to_stage_layout(state, axis_size(PIPELINE_AXIS), v)
        schedule = lay.pp_schedule if loss_fn is not None else ("circular" if v > 1 else "gpipe")
        # 1f1b carries floating-point activations only (ids < 2**24 are exact in float32).
        ints = {k for k, a in extras.items() if schedule == "1f1b" and isinstance(a, jax.Array)
                and jnp.issubdtype(a.dtype, jnp.integer)}

        def layer_fn(params, h):
            ex = {k: a.astype(jnp.int32) if k in ints else a for k, a in h[1].items()}
            y, aux = self.block(nnx.merge(graphdef, params), h[0], ex, self.attend)
            return (y, h[1], h[2] + aux_loss(aux))

        carried = {k: a.astype(jnp.float32) if k in ints else a for k, a in extras.items()}
        h = (x, carried, jnp.zeros(x.shape[:1], jnp.float32))
        # Every schedule stores each layer's input and recomputes the layer in the backward
        # pass (what remat='full' asks for). A policy that saves more (save_dots, offload)
        # applies on top; under 1f1b it can only save within one layer's recomputation.
        policy = remat_policy(lay.remat)
        if schedule == "1f1b" and lay.remat in ("none", "full"):
            policy = None
        out = pipeline(layer_fn, state, h, num_microbatches=lay.pp_microbatches,
                       schedule=schedule, virtual_stages=v, remat=True,
                       remat_policy=policy, loss_fn=loss_fn,
                       loss_batch_args=loss_batch_args, loss_args=loss_args,
                       loss_has_aux=loss_has_aux)
        if loss_fn is not None:
            return out
        aux = self.aux(out) if model.has_aux else jnp.zeros((), jnp.float32)
        return out[0], aux


def _data_shards() -> tuple[tuple[str, ...], int]:
    """``(axes, count)``: the mesh axes over which the partitioner splits the batch's rows, and
    the number of shards they make; ``((), 1)`` where it splits none (no rules, or inside
    explicit FSDP's region, where those axes are manual)."""
    axes = auto_mesh_axes("batch")
    return axes, math.prod(axis_size(a) for a in axes)


def _data_groups() -> RowGroups | None:
    """The batch's data shards where the partitioner places it, as `chunked_cross_entropy`'s
    row blocks; None inside explicit FSDP's region (they are manual there) or without rules.
    Without them the partitioner gathers a head sharded over those devices, and all-reduces its
    gradient, in every chunk of the loss (llama-8b at sequence 8192 on fsdp=8: 256 chunks,
    1,002 GiB a step instead of 4). Within a block the rows are one device's: the logical
    'batch' axis maps to no mesh axis there, and the block dim to the data shards' axes."""
    axes, count = _data_shards()
    if count == 1:
        return None
    rules = current_logical_rules()

    def place(a: jax.Array) -> jax.Array:
        rest = (PartitionSpec.UNCONSTRAINED,) * (a.ndim - 1)
        return jax.lax.with_sharding_constraint(a, PartitionSpec(axes, *rest))

    def vmap(f: Callable) -> Callable:
        def in_block(*args):
            with use_logical_rules(_RowsLocal(rules)):
                return f(*args)
        return jax.vmap(in_block, spmd_axis_name=axes)

    return RowGroups(count, place, vmap)


class _RowsLocal:
    """Logical rules under which the 'batch' axis is one device's (within a row block)."""

    def __init__(self, rules: Any):
        self.rules = rules

    def spec_for(self, names, *args):
        return self.rules.spec_for(tuple(None if n == "batch" else n for n in names), *args)


def per_data_shard(attend: Callable) -> Callable:
    """``attend`` run on each data shard's rows where the partitioner places the batch: a
    ``shard_map`` over the batch's mesh axes (the others, e.g. 'tp' on the heads, left to the
    partitioner); ``attend`` itself elsewhere (inside explicit FSDP's or a pipeline's region,
    without rules, or for a batch that does not split evenly). Attention never mixes rows, so
    this is exact; it keeps the blockwise kernel's block skipping on each device, which the
    partitioner otherwise decides for all rows with one all-reduce per key block (24,576 a
    step at llama-8b, sequence 8192).

    Example::

        attend = per_data_shard(partial(attention, implementation="blockwise"))
    """
    axes, shards = _data_shards()
    if shards == 1 or manual_axes() or axis_size(PIPELINE_AXIS) > 1:
        return attend
    rows, whole = PartitionSpec(axes), PartitionSpec()

    def run(q, k, v, **kwargs):
        if q.shape[0] % shards:
            return attend(q, k, v, **kwargs)
        arrays = {n: a for n, a in kwargs.items() if a is not None and not _static(a)}
        static = {n: a for n, a in kwargs.items() if n not in arrays}
        # [b, ...] inputs split by rows; 1-D ones ([s] positions, [heads] sinks) whole
        specs = jax.tree.map(lambda a: rows if jnp.ndim(a) >= 2 else whole, (q, k, v, arrays))
        body = jax.shard_map(lambda q, k, v, kw: attend(q, k, v, **kw, **static),
                             in_specs=specs, out_specs=rows, axis_names=frozenset(axes))
        return body(q, k, v, arrays)

    return run


def _static(value: Any) -> bool:
    """A keyword of `attention` that is not an array (flags, sizes, the window)."""
    return not any(isinstance(x, jax.Array) for x in jax.tree.leaves(value))


def ring_attend(load_balanced: bool) -> Callable:
    """The models' attention function (``shardax.models.attention.attention``'s arguments)
    as ring attention over 'cp'; ``load_balanced``: the sequence is in ``load_balance`` order.

    Example::

        attend = ring_attend(True)
        out = attend(q, k, v, window=8, segment_ids=segs)
    """

    def ring(q, k, v, *, implementation=None, kv_mask=None, sinks=None, **masks):
        del implementation  # the ring steps run the blockwise kernel
        if sinks is not None:
            raise ValueError("attention sinks (gpt-oss) have no ring attention form over "
                             "'cp'; use a mesh without 'cp'")
        if kv_mask is not None:
            raise ValueError("a kv_mask (decode padding) cannot run as ring attention over "
                             "'cp'; decode without a 'cp' axis")
        return ring_attention(q, k, v, load_balanced=load_balanced, **masks)

    return ring


def _labels(targets: jax.Array, weights: jax.Array | None) -> Any:
    """What a pipeline stage's loss takes per row: the targets, with the loss weights if
    any."""
    return targets if weights is None else (targets, weights)


def _unlabel(labels: Any) -> tuple:
    """``(targets, weights)`` of `_labels`' result (weights None without them)."""
    return labels if isinstance(labels, tuple) else (labels, None)


def fsdp_value_and_grad(graphdef: Any, params: Any, rest: Any, layout: Layout,
                        inputs: jax.Array, targets: jax.Array, kwargs: dict[str, Any], *,
                        param_rules: Any, policy: Policy, grad_accum: int = 1
                        ) -> tuple[jax.Array, Any]:
    """``(training loss, grads)`` of the model ``nnx.merge(graphdef, params, rest)`` under
    explicit ZeRO-3 FSDP over 'fsdp' (HSDP over 'dp'): the stacked layers are gathered one at
    a time (in the compute dtype) and their gradients reduce-scattered in float32; the other
    parameters (embedding, head, final norm) are gathered once. ``kwargs``: the rest of
    `training_loss`'s arguments for ``inputs`` and ``targets`` (positions, segment ids, loss
    weights, ``load_balanced``), computed on the whole sequence. With a 'cp' axis the region
    is manual over it too: each device holds its load-balanced piece of the sequence and ring
    attention runs its body directly. With an 'ep' axis it splits the rows (experts' tokens)
    too. ``layout.fsdp_recompute``: each layer is recomputed in the backward pass (that is
    what frees its gathered parameters); a remat policy that saves more applies within it.

    Example::

        loss, grads = fsdp_value_and_grad(graphdef, params, rest, Layout(fsdp_mode="explicit"),
                                          inputs, targets, {}, param_rules=rules,
                                          policy=Policy())
    """
    if param_rules is None:
        raise ValueError("fsdp_mode='explicit' needs param_rules (the parameters' sharding)")
    model = nnx.merge(graphdef, params, rest)
    if not isinstance(model, LanguageModel):
        raise ValueError("fsdp_mode='explicit' needs a shardax language model "
                         "(shardax.models.protocol)")
    # An untied embedding table stays sharded: each device looks up its own columns of the
    # tokens of its FSDP group and the rows move (embedding.lookup_manual), not the table. A
    # tied one is gathered for the head anyway.
    table = model.lookup_table
    local = ("layers", table) if table else ("layers",)
    # On a 'pp' mesh each device gathers its stage's layers once, before the pipeline, and
    # keeps them for the step (torchtitan's reshard_after_forward=False under pipelining): a
    # gather inside the pipeline would repeat at every pipeline step, and inside the stages'
    # vmap the partitioner keeps the stage dim whole around it (every device gathering every
    # stage's layers).
    piped = axis_size(PIPELINE_AXIS) > 1
    table_dim = fsdp.fsdp_dim(param_rules.spec_for(("vocab", "embed")))
    kwargs = dict(kwargs)
    load_balanced = kwargs.pop("load_balanced", False)
    names = tuple(kwargs)
    # A remat policy that saves more than the layer's input (dots) applies within it.
    remat = layout.remat
    keep = dict(policy=remat_policy(remat) if remat not in ("none", "full") else None,
                reshard_after_forward=layout.fsdp_recompute or remat != "none")

    def lookup(table, tokens):
        if policy.compute is not None:
            table = table.astype(policy.compute)
        return embedding.lookup_manual(table, tokens, FSDP_AXIS, table_dim)

    def loss_fn(gather, params, inputs, targets, *extras):
        top = jax.tree_util.tree_map_with_path(
            lambda path, leaf: (gather.local(leaf) if _key(path) in local and not
                                (piped and _key(path) == "layers") else gather(leaf)),
            params, is_leaf=lambda x: not isinstance(x, (dict, nnx.State)))
        model = nnx.merge(graphdef, top, rest)
        layers = params["layers"]

        def stack(layer_fn, x):
            if layout.scan_layers:
                return fsdp.scan_layers(gather, layer_fn, layers, x, **keep)
            return fsdp.loop_layers(gather, layer_fn, split_stack(layers), x, **keep)

        hooks = dict(head_after_pipeline=True) if piped else dict(stack=stack)
        return training_loss(model, layout, inputs, targets, cast=policy.cast_to_output,
                             lookup=lookup if table else None, load_balanced=load_balanced,
                             **dict(zip(names, extras)), **hooks)[0]

    return fsdp.value_and_grad(
        loss_fn, params, param_rules.apply(params), inputs, targets, *kwargs.values(),
        batch_axes=("ep", "dp"), seq_axes=(CONTEXT_AXIS,) if axis_size(CONTEXT_AXIS) > 1 else (),
        grad_accum=grad_accum, dtype=policy.compute, reduce_dtype=jnp.float32)


def params_loss(params: Any, rest: Any, graphdef: Any, layout: Layout, policy: Policy,
                inputs: jax.Array, targets: jax.Array, kwargs: dict[str, Any]
                ) -> tuple[jax.Array, jax.Array]:
    """`training_loss` of the model ``nnx.merge(graphdef, params, rest)`` with ``params`` cast
    to ``policy``'s compute dtype and the logits to its output dtype; ``kwargs``: the rest of
    `training_loss`'s arguments. What `value_and_grad` differentiates.

    Example::

        objective, ce = params_loss(params, rest, graphdef, Layout(), Policy(), x, y, {})
    """
    # Fresh Variables for the non-differentiated state (LoRA's frozen base) at this trace
    # level, as the differentiated ones are (nnx transforms refuse Variables of an outer trace).
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
    return training_loss(model, layout, inputs, targets, cast=policy.cast_to_output, **kwargs)


def value_and_grad(graphdef: Any, params: Any, rest: Any, layout: Layout,
                   batch: tuple[jax.Array, ...], with_kwargs: Callable[..., tuple], *,
                   policy: Policy, param_rules: Any = None, grad_accum: int = 1,
                   stats: bool = False) -> tuple:
    """``(training loss, grads)`` of `params_loss` under ``layout``: explicit FSDP's
    (`fsdp_value_and_grad`) or ``jax.value_and_grad``'s, in ``grad_accum`` microbatches
    summed in the parameter dtype (sharded by ``param_rules`` when given). ``stats``:
    ``(training loss, grads, MoEStats or None)``, the batch's expert load (tokens summed over
    the microbatches, losses and dropped fractions their mean); None where the layers run in
    a pipeline or explicit FSDP's stack. ``batch`` is
    ``(inputs, targets, *extra)``; ``with_kwargs(*rows)`` turns rows of it into ``(inputs,
    targets, kwargs)`` (positions, segments, loss weights): per microbatch, and under explicit
    FSDP once on the whole sequence, outside its region (with 'cp' it splits the sequence,
    and RoPE and ring attention need each token's global position).

    Example::

        loss, grads = value_and_grad(graphdef, params, rest, Layout(), (x, y),
                                     lambda x, y: (x, y, {}), policy=Policy())
    """
    if layout.fsdp_mode == "explicit":
        inputs, targets, kwargs = with_kwargs(*batch)
        out = fsdp_value_and_grad(graphdef, params, rest, layout, inputs, targets, kwargs,
                                  param_rules=param_rules, policy=policy,
                                  grad_accum=grad_accum)
        return (*out, None) if stats else out

    def objective(params, *rows):
        inputs, targets, kwargs = with_kwargs(*rows)
        return params_loss(params, rest, graphdef, layout, policy, inputs, targets,
                           dict(kwargs, stats=True) if stats else kwargs)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if grad_accum == 1:
        (loss, reported), grads = grad_fn(params, *batch)
        return (loss, grads, reported[1]) if stats else (loss, grads)

    def accumulate(carry, micro):
        loss_sum, grad_sum = carry
        micro = [with_logical_constraint(a, ("batch", "length")) for a in micro]
        (loss, reported), grads = grad_fn(params, *micro)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        if param_rules is not None:
            grad_sum = with_sharding_constraint(grad_sum, param_rules)
        return (loss_sum + loss, grad_sum), (reported[1] if stats else None)

    zeros = jax.tree.map(jnp.zeros_like, params)
    micro = tuple(to_microbatches(a, grad_accum) for a in batch)
    (loss, grads), load = jax.lax.scan(accumulate, (jnp.float32(0), zeros), micro)
    out = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
    if not stats:
        return out
    if load is not None:  # per microbatch: tokens add up, the loss and fraction average
        load = MoEStats(jnp.mean(load.loss), jnp.sum(load.expert_tokens, axis=0),
                        jnp.mean(load.dropped_fraction))
    return (*out, load)


def _key(path) -> str:
    """The first key of a tree path, as a string."""
    k = path[0]
    return str(getattr(k, "key", getattr(k, "name", k)))
