"""Meshes and the one table that maps logical axis names to mesh axes.

Every parameter carries logical axis names (see `jaxmtp.params.logical_axes`); RULES turns them
into mesh axes: batch over `data`, attention heads / MLP and expert intermediates / vocabulary over
`tensor`, routed experts over `data` and `expert` together. Everything else (model width, latent
ranks, the layer stacking axis, norms, the router, whose weights every token needs) is replicated.

So `data` is data-parallel attention beside expert-parallel MoE on the same devices: each device
attends for its own rows and holds only their caches, and holds 1 / (data x expert) of the routed
experts; the MoE layers exchange tokens between the two (jaxmtp.moe.expert_parallel). One node of
8 GPUs serving a batch: make_mesh(data=8); 64 chips: make_mesh(data=8, tensor=8).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmtp.errors import InputError


AXES = ("data", "expert", "tensor")
RULES = (
    ("batch", "data"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", ("data", "expert")),
)


def make_mesh(data: int = 1, expert: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, expert, tensor) mesh with Auto axis types; the sizes must multiply to the device count."""
    devices = jax.devices() if devices is None else devices
    if data * expert * tensor != len(devices):
        raise InputError(f"make_mesh: data x expert x tensor = {data} x {expert} x {tensor} = "
                         f"{data * expert * tensor}, but there are {len(devices)} devices")
    return jax.make_mesh((data, expert, tensor), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)


def spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Mesh PartitionSpec for an array with these logical axes; a dimension that the mesh axis
    does not divide stays replicated."""
    rules = dict(RULES)
    out = []
    for name, size in zip(logical, shape):
        axis = rules.get(name)
        if isinstance(axis, tuple):
            out.append(dividing_axes(axis, size, mesh) or None)
        else:
            out.append(axis if axis is not None and size % mesh.shape[axis] == 0 else None)
    return PartitionSpec(*out)


def dividing_axes(axes: tuple[str, ...], size: int, mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that a dimension of `size` is split over when its rule names
    `axes`: all of them where their product divides it, else the longest tail of them that
    divides it (routed experts: over data and expert, else over expert alone); () for none."""
    for first in range(len(axes)):
        kept = tuple(a for a in axes[first:] if mesh.shape.get(a, 1) > 1)
        if kept and size % math.prod(mesh.shape[a] for a in kept) == 0:
            return kept
    return ()


def expert_axes(mesh, num_experts: int) -> tuple[str, ...]:
    """The mesh axes that the routed experts are split over (see RULES)."""
    return dividing_axes(dict(RULES)["expert"], num_experts, mesh)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over `data`, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec("data", *([None] * (ndim - 1))))


def over_data_rows(fn, *arrays):
    """fn(*arrays) computed by each device for its own rows (the leading axis of every array and of
    the result) where the context mesh's `data` axis divides them, in shard_map; else as it is.
    For operations that XLA's partitioner runs on the whole batch on every device (top_k)."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 0 if mesh.empty else mesh.shape.get("data", 1)
    if data <= 1 or arrays[0].shape[0] % data:
        return fn(*arrays)
    return jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"))(*arrays)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_shapes(array: jax.Array) -> set[tuple[int, ...]]:
    """The shapes of an array's per-device pieces."""
    return {tuple(s.data.shape) for s in array.addressable_shards}


def place(params, shardings):
    """Host arrays -> global arrays, each device receiving only its own slice."""
    def put(host, sharding):
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, params, shardings)

