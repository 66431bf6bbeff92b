"""Meshes and the one table that maps logical axis names to mesh axes.

Every parameter carries logical axis names (see `jaxmtp.params.logical_axes`); RULES turns them
into mesh axes: batch over `data`, attention heads / MLP and expert intermediates / vocabulary over
`tensor`, routed experts over `data` and `expert` together. Everything else (model width, latent
ranks, the layer stacking axis, norms, the router, whose weights every token needs) is replicated.
A dimension that its mesh axes do not divide stays whole over them, and says so: `split` words
the reason, and jaxmtp.params.param_shardings warns (ShardingWarning) with the parameters it keeps.

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


class ShardingWarning(UserWarning):
    """Parameters stay whole over a mesh axis that their sharding rule splits them over, or a layer
    runs without the parallelism its mesh axes ask for; the message names the axis and why."""


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
    """Mesh PartitionSpec for an array with these logical axes; a dimension that its mesh axes do
    not divide stays replicated over them (`split` also says which and why)."""
    return split(logical, shape, mesh)[0]


def split(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh) -> tuple[PartitionSpec, tuple[str, ...]]:
    """(the PartitionSpec of `spec`, a sentence for each dimension that stays whole over a mesh axis
    of size > 1 that its rule names, because that axis does not divide it), e.g. "vocab 1000 is not
    divisible by tensor=3" or, for experts kept on some of their axes only, "expert 4 is not
    divisible by data x expert = 2 x 4: split over expert=4 alone"."""
    rules = dict(RULES)
    out, unsplit = [], []
    for name, size in zip(logical, shape):
        rule = rules.get(name)
        axes = rule if isinstance(rule, tuple) else (rule,) if rule is not None else ()
        kept = dividing_axes(axes, size, mesh)
        if isinstance(rule, tuple):
            out.append(kept or None)
        else:  # a one-axis rule names its axis wherever that divides the dimension, size 1 included
            out.append(rule if rule is not None and size % mesh.shape.get(rule, 1) == 0 else None)
        wanted = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
        if kept != wanted:
            unsplit.append(f"{name} {size} is not divisible by {_sizes(wanted, mesh)}"
                           + (f": split over {_sizes(kept, mesh)} alone" if kept else ""))
    return PartitionSpec(*out), tuple(unsplit)


def _sizes(axes: tuple[str, ...], mesh) -> str:
    """("data", "expert") -> "data x expert = 2 x 4"; ("tensor",) -> "tensor=3"."""
    if len(axes) == 1:
        return f"{axes[0]}={mesh.shape[axes[0]]}"
    return f"{' x '.join(axes)} = {' x '.join(str(mesh.shape[a]) for a in axes)}"


def dividing_axes(axes: tuple[str, ...], size: int, mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that a dimension of `size` is split over when its rule names
    `axes`: all of them where their product divides it, else the longest tail of them that
    divides it (routed experts: over data and expert, else over expert alone); () for none.
    `split` names the axes this leaves out."""
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
    the result) where the context mesh's `data` axis divides them, in shard_map; else as it is, on
    the whole batch, as such a batch is placed (jaxmtp.generation.prepare replicates the rows of a
    batch that the data axis does not divide). No warning: batches are padded to powers of two, so
    on a data axis of a power of two this is a batch smaller than the axis, which cannot give every
    device a row. For operations that XLA's partitioner runs on the whole batch on every device
    (top_k)."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 0 if mesh.empty else mesh.shape.get("data", 1)
    if data <= 1 or arrays[0].shape[0] % data:
        return fn(*arrays)
    return jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"))(*arrays)


def context_mesh(arrays, where: str):
    """The context mesh (`jax.set_mesh`; empty where none is set), for code that chooses its program
    by it. Refuses `arrays` (a pytree; traced or not) placed on a mesh of several devices when no
    mesh is set: the program would silently be another one (MoE layers without expert parallelism,
    every expert's weights gathered onto each device). `where` names the caller in the message."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for leaf in jax.tree.leaves(arrays):
        placed = jax.typeof(leaf).sharding.mesh
        if not placed.empty and placed.size > 1:
            sizes = " x ".join(f"{axis}={size}" for axis, size in placed.shape.items())
            raise InputError(f"{where}: arrays placed on a mesh ({sizes}) but no mesh is set: run it inside "
                             "`with model.mesh_context():` (jax.set_mesh(model.mesh)), as Model.forward and "
                             "jaxmtp.generate do")
    return mesh


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

