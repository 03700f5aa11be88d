"""``MeshShardingHelper``: a device mesh and the tools that use it (sjit, contexts, data).

>>> helper = MeshShardingHelper([-1, 2], ["fsdp", "tp"])   # 8 devices -> fsdp=4, tp=2
>>> helper.shape
{'fsdp': 4, 'tp': 2}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, PartitionSpec

from shardax import _compat, _context, constraints
from shardax.context import ShardingContext
from shardax.jit import ShardedFunction, sjit
from shardax.rules import ShardingRule, match_shardings
from shardax.utils import named_tree_map

__all__ = [
    "MeshShardingHelper",
    "get_global_mesh_helper",
    "get_global_mesh",
    "get_global_annotation_shardings",
    "mesh_axis_sizes",
    "parse_mesh_string",
]


def parse_mesh_string(spec: str) -> dict[str, int]:
    """The one reader of mesh strings: ``"dp=2,fsdp=-1"`` -> ``{"dp": 2, "fsdp": -1}``
    (syntax only: sizes are fitted to the devices when a mesh is built); ValueError naming the
    bad part.

    >>> parse_mesh_string("fsdp=-1, tp=2")
    {'fsdp': -1, 'tp': 2}
    """
    axes: dict[str, int] = {}
    for part in str(spec).split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name.isidentifier() or not size.lstrip("-").isdigit():
            raise ValueError("expected comma-separated name=size pairs such as "
                             f"'dp=2,fsdp=-1' (one size may be -1), got {part.strip()!r}")
        if name in axes:
            raise ValueError(f"axis {name!r} given twice")
        axes[name] = int(size)
    return axes


def _resolve_dims(axis_dims: Sequence[int], axis_names: Sequence[str], device_count: int):
    """Validates mesh dims and fills in the one ``-1``; errors name the device count."""
    dims, names = [int(d) for d in axis_dims], [str(n) for n in axis_names]
    if len(dims) != len(names):
        raise ValueError(
            f"mesh has {len(dims)} dims {tuple(dims)} but {len(names)} axis names "
            f"{tuple(names)}; give one name per dim (the device count is {device_count})"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must be unique, got {tuple(names)}")
    if dims.count(-1) > 1:
        raise ValueError(f"at most one mesh dim may be -1, got {tuple(dims)}")
    if any(d == 0 or d < -1 for d in dims):
        raise ValueError(f"mesh dims must be positive (or one -1), got {tuple(dims)}")
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if device_count % known:
            raise ValueError(
                f"cannot infer the -1 in mesh {dict(zip(names, dims))}: the other dims multiply "
                f"to {known}, which does not divide the device count {device_count}"
            )
        dims[dims.index(-1)] = device_count // known
    elif known != device_count:
        raise ValueError(
            f"mesh {dict(zip(names, dims))} has {known} devices but the device count is "
            f"{device_count}; make the dims multiply to {device_count} (or use -1 for one dim)"
        )
    return tuple(dims), tuple(names)


def _hybrid_devices(ici: tuple[int, ...], dcn: tuple[int, ...], devices: list) -> np.ndarray:
    """Devices for a multi-slice mesh: each axis is dcn (outer) x ici (inner).

    Real multi-slice TPUs carry ``slice_index``; multi-process runs use each process as one
    granule; a single process (emulated CPU devices) is laid out as contiguous device blocks, one
    block per slice, which is what the other two cases produce too.
    """
    if hasattr(devices[0], "slice_index"):
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    if jax.process_count() == math.prod(dcn):
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    n = len(ici)
    blocks = np.asarray(devices, dtype=object).reshape(dcn + ici)
    # Interleave axes to (dcn_0, ici_0, dcn_1, ici_1, ...) then merge each pair.
    blocks = blocks.transpose([k for i in range(n) for k in (i, n + i)])
    return blocks.reshape(tuple(d * i for d, i in zip(dcn, ici)))


def mesh_axis_sizes(mesh: Any) -> dict[str, int]:
    """``{axis name: size}`` of a ``Mesh`` or ``AbstractMesh``."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


class MeshShardingHelper:
    """A device mesh plus the tools to turn sharding rules into compiled, sharded functions.

    Args:
      axis_dims: size of each mesh axis; one may be ``-1`` and is inferred from the devices.
      axis_names: one name per axis, e.g. ``("dp", "fsdp", "tp")``.
      mesh_axis_splitting: lay devices out in plain order instead of asking
        ``mesh_utils.create_device_mesh`` for a topology-aware layout (lets one physical axis
        be split over several mesh axes).
      dcn_axis_dims: for multi-slice (DCN x ICI) meshes, the number of slices along each axis;
        ``axis_dims`` is then the shape within one slice.
      devices: the devices to use (default: all of ``jax.devices()``).

    >>> from shardax import FSDPShardingRule
    >>> mesh = MeshShardingHelper([-1], ["fsdp"])
    >>> train_step = lambda state, batch: ({"w": state["w"] - batch.mean()}, batch.sum())
    >>> step = mesh.sjit(train_step, in_shardings=(FSDPShardingRule(min_fsdp_size=0), None))
    >>> state, loss = step({"w": np.ones((16, 4))}, np.ones((8, 2)))
    >>> state["w"].sharding.spec
    P('fsdp', None)
    """

    def __init__(
        self,
        axis_dims: Sequence[int],
        axis_names: Sequence[str],
        mesh_axis_splitting: bool = False,
        dcn_axis_dims: Sequence[int] | None = None,
        devices: Sequence[Any] | None = None,
    ):
        devices = list(jax.devices() if devices is None else devices)
        if dcn_axis_dims is None:
            dims, names = _resolve_dims(axis_dims, axis_names, len(devices))
            if mesh_axis_splitting:
                device_array = np.asarray(devices, dtype=object).reshape(dims)
            else:
                device_array = mesh_utils.create_device_mesh(dims, devices)
            self.dcn_axis_dims = (1,) * len(dims)
        else:
            dcn = tuple(int(d) for d in dcn_axis_dims)
            if len(dcn) != len(tuple(axis_dims)) or any(d < 1 for d in dcn):
                raise ValueError(
                    f"dcn_axis_dims {dcn} must give one positive size per mesh axis "
                    f"{tuple(axis_names)}"
                )
            slices = math.prod(dcn)
            if len(devices) % slices:
                raise ValueError(
                    f"dcn_axis_dims {dcn} asks for {slices} slices but the device count "
                    f"{len(devices)} does not split into {slices} equal slices"
                )
            ici, names = _resolve_dims(axis_dims, axis_names, len(devices) // slices)
            device_array = _hybrid_devices(ici, dcn, devices)
            dims = tuple(i * d for i, d in zip(ici, dcn))
            self.dcn_axis_dims = dcn
        self.axis_dims: tuple[int, ...] = dims
        self.axis_names: tuple[str, ...] = names
        self._mesh = _compat.make_mesh(device_array, names)

    @classmethod
    def from_string(cls, spec: str, **kwargs: Any) -> MeshShardingHelper:
        """Builds a helper from ``"dp=1,fsdp=-1,tp=2"`` (the form CLIs take).

        >>> MeshShardingHelper.from_string("fsdp=-1,tp=2").shape
        {'fsdp': 4, 'tp': 2}
        """
        try:
            axes = parse_mesh_string(spec)
        except ValueError as e:
            raise ValueError(f"cannot read mesh {spec!r}: {e}") from None
        names, dims = list(axes), list(axes.values())
        return cls(dims, names, **kwargs)

    @property
    def mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` (all axes ``Auto``)."""
        return self._mesh

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}``."""
        return dict(zip(self.axis_names, self.axis_dims))

    def __repr__(self) -> str:
        axes = ",".join(f"{n}={d}" for n, d in self.shape.items())
        return f"MeshShardingHelper({axes})"

    def get_context(
        self,
        annotation_shardings: Mapping[str, Any] | None = None,
        logical_axis_rules: Any = None,
    ) -> ShardingContext:
        """A context manager making this mesh (and its annotation rules) the global one.

        Inside it ``with_sharding_constraint``/``with_sharding_annotation`` take effect,
        ``with_logical_constraint`` maps names by ``logical_axis_rules``, and JAX's ambient
        mesh is set, so bare ``PartitionSpec``s in user code work too. It may be entered inside
        a traced function as well.
        """
        return ShardingContext(self, annotation_shardings, logical_axis_rules)

    def sjit(
        self,
        fun: Callable[..., Any] | None = None,
        in_shardings: Any = None,
        out_shardings: Any = None,
        static_argnums: int | Sequence[int] | None = None,
        args_sharding_constraint: Any = None,
        annotation_shardings: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ShardedFunction | Callable[[Callable[..., Any]], ShardedFunction]:
        """``jax.jit`` with sharding rules on this mesh; see :func:`shardax.jit.sjit`.

        scalax's signature: ``mesh.sjit(f, PS("fsdp"))`` and ``mesh.sjit(f, None, None, (1,))``
        work, and so do keywords and the decorator form (``fun`` left out).

        >>> step = mesh.sjit(train_step, FSDPShardingRule(), None, (2,))  # doctest: +SKIP
        """
        return sjit(fun, in_shardings, out_shardings, static_argnums, args_sharding_constraint,
                    annotation_shardings, mesh=self, **kwargs)

    sharded_jit = sjit  # scalax's older name

    # scalax's class-level forms of the module functions, for code that calls them this way
    # (``shard_map(..., mesh=MeshShardingHelper.get_global_mesh())``).

    @staticmethod
    def get_global_mesh_helper() -> MeshShardingHelper | None:
        """The innermost active ``MeshShardingHelper``, or None outside any context."""
        return get_global_mesh_helper()

    @staticmethod
    def get_global_mesh() -> Mesh | None:
        """The innermost active ``Mesh``, or None outside any context."""
        return get_global_mesh()

    @staticmethod
    def get_global_annotation_shardings() -> dict[str, Any] | None:
        """The innermost context's ``annotation_shardings``, or None outside any context."""
        return get_global_annotation_shardings()

    @staticmethod
    def with_sharding_constraint(pytree: Any, sharding_rule: Any) -> Any:
        """:func:`shardax.constraints.with_sharding_constraint` (a no-op outside a context)."""
        return constraints.with_sharding_constraint(pytree, sharding_rule)

    @staticmethod
    def with_sharding_annotation(pytree: Any, sharding_name: str) -> Any:
        """:func:`shardax.constraints.with_sharding_annotation` (a no-op outside a context)."""
        return constraints.with_sharding_annotation(pytree, sharding_name)

    def match_sharding_rule(self, sharding_rules: Any, pytree: Any) -> Any:
        """A tree of ``NamedSharding`` (None where unspecified) for ``pytree``.

        ``sharding_rules`` is a tree prefix of ``pytree`` whose leaves are ``ShardingRule``s,
        ``PartitionSpec``s or None. Specs are checked against the mesh and the leaf shapes.
        """
        return match_shardings(sharding_rules, pytree, self.mesh)

    def make_shard_and_gather_fns(
        self, pytree: Any, sharding_rule: ShardingRule | PartitionSpec | Any
    ) -> tuple[Any, Any]:
        """Trees of functions that put one leaf on the mesh / bring it back to host numpy.

        >>> from shardax import FSDPShardingRule
        >>> mesh = MeshShardingHelper([-1], ["fsdp"])
        >>> params = {"w": np.ones((16, 4), np.float32)}
        >>> rule = FSDPShardingRule(min_fsdp_size=0)
        >>> shard_fns, gather_fns = mesh.make_shard_and_gather_fns(params, rule)
        >>> sharded = mesh.apply_shard_and_gather_fns(shard_fns, params)
        >>> sharded["w"].sharding.spec
        P('fsdp', None)
        >>> type(mesh.apply_shard_and_gather_fns(gather_fns, sharded)["w"])
        <class 'numpy.ndarray'>
        """
        shardings = self.match_sharding_rule(sharding_rule, pytree)
        replicated = jax.sharding.NamedSharding(self.mesh, PartitionSpec())

        def make_shard_fn(sharding):
            return lambda x: jax.device_put(x, sharding if sharding is not None else replicated)

        gather = jax.jit(lambda x: x, out_shardings=replicated)

        def make_gather_fn(sharding):
            return lambda x: np.asarray(jax.device_get(gather(x)))

        is_leaf = lambda x: x is None  # noqa: E731 - an unspecified leaf still needs a function
        return (
            jax.tree.map(make_shard_fn, shardings, is_leaf=is_leaf),
            jax.tree.map(make_gather_fn, shardings, is_leaf=is_leaf),
        )

    @staticmethod
    def apply_shard_and_gather_fns(fns: Any, pytree: Any) -> Any:
        """Applies a tree of shard or gather functions leaf by leaf."""
        return jax.tree.map(lambda fn, x: fn(x), fns, pytree)

    def local_data_to_global_array(
        self,
        pytree: Any,
        batch_axis: int = 0,
        mesh_axis_subset: str | Sequence[str] | None = None,
    ) -> Any:
        """Turns each process's local batch into one global array sharded along ``batch_axis``.

        The global batch is the processes' local batches stacked in process order (on one
        process the global array equals the local one, row for row).

        >>> mesh = MeshShardingHelper([-1], ["fsdp"])
        >>> batch = mesh.local_data_to_global_array({"x": np.ones((8, 4))})
        >>> batch["x"].shape, batch["x"].sharding.spec
        ((8, 4), P('fsdp',))
        """
        if mesh_axis_subset is None:
            axes = self.axis_names
        else:
            axes = (mesh_axis_subset,) if isinstance(mesh_axis_subset, str) else mesh_axis_subset
            unknown = [a for a in axes if a not in self.axis_names]
            if unknown:
                raise ValueError(
                    f"mesh_axis_subset names {unknown} which are not mesh axes; "
                    f"the mesh axes are {self.shape}"
                )
            axes = tuple(axes)
        spec = PartitionSpec(*([None] * batch_axis), axes)
        sharding = jax.sharding.NamedSharding(self.mesh, spec)
        split = math.prod(self.shape[a] for a in axes)

        def to_global(path, local):
            local = np.asarray(local) if not isinstance(local, jax.Array) else local
            shape = list(local.shape)
            if len(shape) <= batch_axis:
                raise ValueError(
                    f"leaf {path!r} of shape {tuple(shape)} has no batch axis {batch_axis}"
                )
            shape[batch_axis] *= jax.process_count()
            if shape[batch_axis] % split:
                raise ValueError(
                    f"leaf {path!r}: global batch {shape[batch_axis]} (shape {tuple(shape)}) is "
                    f"not divisible by mesh axes {axes} of total size {split} (mesh {self.shape})"
                )
            return jax.make_array_from_process_local_data(sharding, local, tuple(shape))

        return named_tree_map(to_global, pytree, sep="/")


def get_global_mesh_helper() -> MeshShardingHelper | None:
    """The innermost active ``MeshShardingHelper``, or None outside any context."""
    return _context.active().mesh_helper


def get_global_mesh() -> Mesh | None:
    """The innermost active ``Mesh``, or None outside any context."""
    helper = get_global_mesh_helper()
    return None if helper is None else helper.mesh


def get_global_annotation_shardings() -> dict[str, Any] | None:
    """The innermost context's ``annotation_shardings``, or None outside any context."""
    return _context.active().annotation_shardings
