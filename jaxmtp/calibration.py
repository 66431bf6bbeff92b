"""What a speculative round at each k costs on this machine, measured once and kept on disk.

The cost of a round at k (draft k tokens, verify k + 1 rows, repair) in units of a step of plain
decoding depends on the device, the model (config, dtype, parameter layout), the sampling mode and
the shapes (batch, prompt and cache buckets), hardly on the text. `generate(speculative_k="auto")`
measures it the first time it meets such a combination, by running its own compiled loop with k
forced to each value, and the plain decoding loop for the unit; it stores the figures in a JSON
file keyed by all of the above, the jax version and a digest of jaxmtp's own source, so that
costs measured by other code (an upgrade, an edit) are measured again. The file lives in
$JAXMTP_CACHE_DIR (default ~/.cache/jaxmtp).

The unit is the plain loop's step, so that the costs read as what speculation buys over plain
decoding; the rule in jaxmtp.adaptive compares them with each other only. The auto loop's own
round at k = 0 costs about that step (benchmarks/auto_k0.py).

With several processes (jax.distributed) the costs are process 0's on every process: process 0
alone reads and writes its table, and says whether the key is stored; where it is not, every
process runs the same measuring loops (they launch collectives) and takes process 0's figures. Each
process's own clock and table would otherwise give it its own costs, its own k in a round and its
own branch of the loop, and the processes' collectives would no longer meet.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable

import jax
import numpy as np

FILE = "round_costs.json"
PACKAGE = os.path.dirname(os.path.abspath(__file__))
ROUNDS = 48  # timed rounds per k
REPEATS = 7


def cache_dir() -> str:
    return os.environ.get("JAXMTP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxmtp")


def source_digest(root: str) -> str:
    """A digest of the Python sources under `root`, names and contents."""
    digest = hashlib.sha256()
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


@functools.cache
def engine_digest() -> str:
    """The digest of jaxmtp's own sources, read once per process."""
    return source_digest(PACKAGE)


def key(config_json: dict, dtype, layout, mode, batch: int, prompt_len: int, cache_len: int, k_max: int) -> str:
    """Everything the costs depend on, as one string (the model config by its digest)."""
    device = jax.devices()[0]
    digest = hashlib.sha256(json.dumps(config_json, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return (f"{device.platform}:{device.device_kind}:n{jax.device_count()}|jax {jax.__version__}|{digest}|"
            f"{jax.numpy.dtype(dtype).name}|{layout}|{mode}|batch {batch}|prompt {prompt_len}|cache {cache_len}|"
            f"k<={k_max}|jaxmtp {engine_digest()}")


def _read() -> dict:
    """The stored table; parsed again only when the file changed (generate reads it on every call)."""
    path = os.path.join(cache_dir(), FILE)
    try:
        stamp = (path, os.stat(path).st_mtime_ns)
        if _last_read[0] != stamp:
            with open(path) as f:
                table = json.load(f)
            _last_read[:] = [stamp, table if isinstance(table, dict) else {}]
    except (OSError, ValueError):  # absent or unreadable: measure again
        return {}
    return dict(_last_read[1])


_last_read: list = [None, {}]  # [(path, mtime), table] of the last file parsed


def _write(table: dict):
    """Atomically: a temporary file beside the table, renamed over it."""
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(directory, FILE))


def _nothing():
    pass


def _warm_up(*runs: Callable):
    """The first call of each run, which compiles its loop. In one process the loops compile side
    by side, in threads (XLA compiles outside the GIL), which shortens the first `jaxmtp generate`
    on a machine (benchmarks/compile_cache.py times it); each thread runs in the caller's mesh
    (`jax.set_mesh` holds per thread), so that it compiles the program the caller would. Several
    processes run them in turn, so that every process launches its collectives in the same order."""
    if jax.process_count() > 1:
        for run in runs:
            run()
        return
    mesh = jax.sharding.get_mesh()

    def in_mesh(run: Callable):
        if mesh.empty:
            return run()
        with jax.set_mesh(mesh):
            return run()

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        for future in [pool.submit(in_mesh, run) for run in reversed(runs)]:  # the slowest to compile first
            future.result()


def measure(plain_seconds: Callable[[], float], round_seconds: Callable[[int], float], k_max: int,
            warmed: Callable[[], None] = _nothing) -> list[float]:
    """Round costs in plain steps for k = 0..k_max.

    plain_seconds() runs about ROUNDS steps of the plain decoding loop and round_seconds(k) about
    ROUNDS rounds of the auto loop with k forced, each after a prefill it does not time, and return
    the seconds per step or round. Each of REPEATS repeats runs the plain loop before and after
    every k (P 0 P 1 P ... k_max P); the cost at k is the median over the repeats of its time over
    the mean of the two plain runs beside it. A shared machine's slower spells last from a tenth of
    a second to seconds, so a run at k and the plain runs beside it mostly share one, which keeps the
    costs steady where a competing process runs (tools/calibration.py --windows 60 --competing).

    A round at k > 0 does all the work of one at k - 1 and more (a main forward over one more row,
    one more MTP pass), so a median below the cost at k - 1 is the machine's noise and is raised to
    that bound. The round at k = 0 has no bound against the plain step: it can cost less than one
    (benchmarks/auto_k0.py)."""
    _warm_up(plain_seconds, lambda: round_seconds(0))
    warmed()
    ratios = {k: [] for k in range(k_max + 1)}
    for _ in range(REPEATS):
        before = plain_seconds()
        for k in range(k_max + 1):
            seconds = round_seconds(k)
            after = plain_seconds()
            ratios[k].append(2 * seconds / (before + after))
            before = after
    costs = [statistics.median(ratios[0])]
    for k in range(1, k_max + 1):
        costs.append(max(statistics.median(ratios[k]), costs[-1]))
    return costs


def stored(cache_key: str, k_max: int) -> list[float] | None:
    """The costs stored for this key, or None where they are still to be measured. With several
    processes, process 0's answer on every process (a collective: every process calls it)."""
    costs = _stored_here(cache_key, k_max) if jax.process_index() == 0 else None
    return _from_process_0(costs, k_max)


def _stored_here(cache_key: str, k_max: int) -> list[float] | None:
    """This process's own table's costs for the key, or None."""
    costs = _read().get(cache_key)
    return [float(c) for c in costs] if isinstance(costs, list) and len(costs) == k_max + 1 else None


def _from_process_0(costs: list[float] | None, k_max: int) -> list[float] | None:
    """Process 0's costs [k_max + 1] (or its None) on every process; in one process, `costs` as
    they are. Broadcast as float32, the precision that the loop reads them in."""
    if jax.process_count() == 1:
        return costs
    from jax.experimental import multihost_utils

    found, values = multihost_utils.broadcast_one_to_all(
        (np.bool_(costs is not None), np.asarray(costs if costs is not None else [0.0] * (k_max + 1), np.float32)))
    return [float(c) for c in values] if found else None


def measured(cache_key: str, plain_seconds: Callable[[], float], round_seconds: Callable[[int], float],
             k_max: int, warmed: Callable[[], None] = _nothing) -> list[float]:
    """The costs measured now (see `measure`; warmed() is called once the warm-up has compiled the
    loops) and stored for this key. With several processes, every process measures, all take
    process 0's figures, and process 0 stores them."""
    costs = _from_process_0(measure(plain_seconds, round_seconds, k_max, warmed), k_max)
    if jax.process_index() == 0:
        table = _read()
        table[cache_key] = costs
        _write(table)
    return costs


def round_costs(cache_key: str, plain_seconds: Callable[[], float], round_seconds: Callable[[int], float],
                k_max: int, warmed: Callable[[], None] = _nothing) -> list[float]:
    """The stored costs for this key (`stored`), or else `measured`."""
    known = stored(cache_key, k_max)
    return known if known is not None else measured(cache_key, plain_seconds, round_seconds, k_max, warmed)
