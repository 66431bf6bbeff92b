"""Whether a model's parameters fit the devices they are to be loaded onto, checked from abstract
shapes and shardings before any tensor is read.

A GPU's or TPU's room is its allocator's limit (`memory_stats()["bytes_limit"]`, which already
reflects XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION) less what is in use; CPU
devices share the host's memory, so what all local devices hold together (plus any whole-model
copy the loader stages on the host) is compared with MemAvailable of /proc/meminfo.
"""

from __future__ import annotations

import math
import warnings

import jax

from jaxmtp.errors import CheckpointError

MEMINFO = "/proc/meminfo"
ADVICE = ("try a mesh over more devices (mesh=, --mesh), FP8 weights kept as FP8 (quantized='keep', --matmul), or, "
          "on a GPU, a larger XLA_CLIENT_MEM_FRACTION (formerly XLA_PYTHON_CLIENT_MEM_FRACTION: the share of "
          "the device JAX's allocator takes, 0.75 by default; `jaxmtp plan` names the one that fits)")


def bytes_per_device(target, shardings=None) -> dict:
    """{device: bytes of the parameters it holds} for every device of this process, from the
    abstract `target` tree (QuantizedWeight leaves count values and scales) and its NamedSharding
    tree; without shardings the whole tree sits on the first local device."""
    leaves = jax.tree.leaves(target)
    if shardings is None:
        return {jax.local_devices()[0]: sum(_nbytes(leaf.shape, leaf.dtype) for leaf in leaves)}
    held = dict.fromkeys(jax.local_devices(), 0)
    for leaf, sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        size = _nbytes(sharding.shard_shape(leaf.shape), leaf.dtype)
        for device in sharding.addressable_devices:
            held[device] += size
    return {device: size for device, size in held.items() if size}


def _nbytes(shape, dtype) -> int:
    """Bytes of an array; sub-byte types (FP4) packed two to a byte, as XLA stores them."""
    return -(-math.prod(shape) * jax.dtypes.itemsize_bits(dtype) // 8)


def device_room(device) -> tuple[int | None, str]:
    """(bytes `device` can still take, where the figure comes from), or (None, why it is unknown).
    For a GPU or TPU: the allocator's limit less the bytes in use."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None, f"{device.platform} reports no memory_stats()"
    limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
    return limit - used, f"the allocator's limit {_gb(limit)} less {_gb(used)} in use"


def host_room() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none (not Linux)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(target, shardings=None, *, staged_on_host: bool = False, source: str = "model"):
    """Raises CheckpointError when the parameters of `target` (with `shardings`, or on one device
    without) cannot fit where they go: per device against `device_room` on a GPU or TPU, and on a
    CPU all local devices together against `host_room`. `staged_on_host`: the loader first
    assembles the whole model in host memory (one host copy besides the device arrays, except on a
    CPU without a mesh, where the host buffers become the device arrays). Where the room is
    unknown it warns and goes on."""
    held = bytes_per_device(target, shardings)
    whole = sum(_nbytes(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(target))
    platform = next(iter(held)).platform
    where = "on one device" if shardings is None else f"on a mesh of {jax.tree.leaves(shardings)[0].mesh.size} devices"
    if platform != "cpu":
        for device, need in held.items():
            room, what = device_room(device)
            if room is None:
                warnings.warn(f"{source}: not checked whether the parameters fit {device}: {what}", stacklevel=3)
            elif need > room:
                raise CheckpointError(f"{source}: the parameters need {_gb(need)} per device ({where}), but "
                                      f"{device} has {_gb(room)} ({what}); {ADVICE}")
    host_need = (sum(held.values()) if platform == "cpu" else 0)
    if staged_on_host and not (platform == "cpu" and shardings is None):
        host_need += whole
    if not host_need:
        return
    room = host_room()
    if room is None:
        warnings.warn(f"{source}: not checked whether the parameters fit host memory: no MemAvailable in {MEMINFO}",
                      stacklevel=3)
    elif host_need > room:
        per_device = f"{_gb(max(held.values()))} per device ({where}, all in host memory)" if platform == "cpu" else ""
        staged = "the whole model staged in host memory" if staged_on_host and host_need != sum(held.values()) else ""
        needs = " plus ".join(part for part in (per_device, staged) if part)
        raise CheckpointError(f"{source}: the parameters need {_gb(host_need)} of host memory ({needs}), but "
                              f"MemAvailable is {_gb(room)}; {ADVICE}")


def _gb(n: int) -> str:
    return f"{n:,} bytes ({n / 1e9:.2f} GB)"
