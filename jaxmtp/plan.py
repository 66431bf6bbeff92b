"""Will it fit? Per-device memory of speculative generation on a mesh, from abstract shapes only.

Parameters (FP8 kept where the config is quantized) and the inputs are abstract arrays carrying
their NamedShardings; the whole generation function (prefill + the speculative while_loop) is
compiled ahead of time for that mesh, and XLA's own memory analysis gives the per-device figures.
A plan compiles each decode loop a run may use (`Loop`: by default the speculative_k="auto" loop
with sampling that `jaxmtp generate` runs, and a fixed k) and counts the largest against the
memory JAX's allocator may use on each device (`MemoryLimit`), not the device's whole memory.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxmtp.config import ModelConfig
from jaxmtp.decoding import Inputs, Static, advance, start
from jaxmtp.errors import InputError
from jaxmtp.generation import ALL_STEPS, AUTO_MAX_K, prompt_width
from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.layout import decode_layout
from jaxmtp.memory import bytes_per_device
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.quant import QuantizedWeight, with_matmul
from jaxmtp.sampling import SamplingMode, SamplingParams
from jaxmtp.sharding import batch_sharding, make_mesh, replicated


@dataclasses.dataclass(frozen=True)
class Device:
    """A device kind that plans are checked against. memory: bytes, the maker's figure read in
    decimal units (an H200's "141 GB" as 141e9 bytes). A GPU's driver reports more (nvidia-smi
    gives an H200 143771 MiB, 150.8e9 bytes: benchmarks/results/h200/device.txt), and JAX's memory
    fraction applies to CUDA's total, a little below the driver's figure but above the decimal one,
    so a plan within a fraction of the decimal figure is within that fraction on the device. A TPU's
    runtime limit was not measured here; the decimal figure is taken as its whole memory. gpu:
    whether JAX's GPU allocator settings apply."""

    name: str
    memory: float
    gpu: bool

    @property
    def label(self) -> str:
        return f"{self.name} ({self.memory / 1e9:g} GB)"


# The devices `jaxmtp plan` reports on, by the name `--fit` takes.
DEVICES = {"h200": Device("H200", 141e9, gpu=True), "h100": Device("H100", 80e9, gpu=True),
           "v5p": Device("TPU v5p", 95e9, gpu=False), "v6e": Device("TPU v6e", 32e9, gpu=False)}
# Cache lengths that `fit` reports are multiples of this (the cache bucket past 1024 slots).
CONTEXT_STEP = 1024
# JAX's GPU memory settings (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
FRACTION = "XLA_CLIENT_MEM_FRACTION"
OLD_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # its older name, still read
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
DEFAULT_FRACTION = 0.75
# The largest fraction `plan` suggests: the rest of a GPU's memory is for what lives outside JAX's
# pool (the CUDA context, cuBLAS and NCCL workspaces). A suggestion also leaves HEADROOM of the
# plan's bytes for the pool's fragmentation.
MAX_FRACTION = 0.95
HEADROOM = 0.02


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """JAX's GPU memory settings, as a process's environment gives them.

    JAX documents (https://docs.jax.dev/en/latest/gpu_memory_allocation.html): on a GPU it
    preallocates 75% of the total memory at its first operation; XLA_CLIENT_MEM_FRACTION=.XX
    (older name XLA_PYTHON_CLIENT_MEM_FRACTION) sets that fraction; XLA_PYTHON_CLIENT_PREALLOCATE=
    false allocates on demand instead, and with the BFC allocator keeps the same limit (XLA sizes
    the allocator total memory x fraction either way and only lets it grow into that on demand:
    CreateBFCAllocator in xla/pjrt/gpu/gpu_helpers.cc); XLA_PYTHON_CLIENT_ALLOCATOR=platform
    allocates exactly what is asked, with no pool. Newer JAX releases document a "0.75+" policy,
    where with no fraction set the pool may grow past 75% as memory allows; `plan` counts the 75%
    that is assured. On a TPU none of these apply: jaxlib passes them to its CUDA client only
    (`jaxlib.xla_client.generate_pjrt_gpu_plugin_options`).

    fraction: the fraction set, None where neither variable is; variable: the one that set it (or
    the one to set); preallocate: XLA_PYTHON_CLIENT_PREALLOCATE; allocator: XLA_PYTHON_CLIENT_ALLOCATOR.
    """

    fraction: float | None = None
    variable: str = FRACTION
    preallocate: bool = True
    allocator: str = "default"


def allocator_settings(environ: Mapping[str, str] | None = None) -> AllocatorSettings:
    """JAX's GPU memory settings from `environ` (default: this process's environment), read as
    jaxlib reads them; a value jaxlib would refuse is refused here, naming the variable."""
    env = os.environ if environ is None else environ
    new, old = env.get(FRACTION, ""), env.get(OLD_FRACTION, "")
    if new and old:
        raise InputError(f"{FRACTION} and {OLD_FRACTION} are both set; JAX refuses that: keep {FRACTION}")
    variable, value = (OLD_FRACTION, old) if old else (FRACTION, new)
    fraction = None
    if value:
        try:
            fraction = float(value)
        except ValueError:
            raise InputError(f"{variable}={value}: expected a fraction of the GPU's memory, e.g. 0.9") from None
        if not 0 < fraction <= 1:
            raise InputError(f"{variable}={value}: expected a fraction of the GPU's memory in (0, 1]")
    allocator = env.get(ALLOCATOR, "default").lower()
    if allocator not in ("default", "platform", "bfc", "cuda_async", "vmm"):
        raise InputError(f'{ALLOCATOR}={allocator}: expected "default", "platform", "bfc", "cuda_async" or "vmm"')
    preallocate = env.get(PREALLOCATE, "") not in ("false", "False", "0")
    return AllocatorSettings(fraction, variable, preallocate, allocator)


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """The bytes JAX may hold on one `device`: fraction x device.memory, or its whole memory where
    fraction is None (a TPU; a GPU with the platform allocator). how: where the figure comes from.
    variable: the setting that raises it (None where none does)."""

    device: Device
    fraction: float | None
    how: str
    variable: str | None = None

    @property
    def bytes(self) -> float:
        return self.device.memory * (1.0 if self.fraction is None else self.fraction)

    def describe(self) -> str:
        """E.g. "H200 (141 GB): allocator limit 105.75 GB = 0.75 x 141 GB (...)"."""
        gb = f"{self.bytes / 1e9:.2f} GB"
        if self.fraction is None:
            return f"{self.device.label}: limit {gb}, the whole memory ({self.how})"
        return (f"{self.device.label}: allocator limit {gb} = {self.fraction:g} x {self.device.memory / 1e9:g} GB "
                f"({self.how})")

    def verdict(self, total: float) -> str:
        """Whether `total` bytes per device fit, and if not, the setting that makes them fit."""
        share = f"{100 * total / self.bytes:.0f}% of the limit"
        if total <= self.bytes:
            return f"fits ({share})"
        if total > self.device.memory:
            return f"does not fit ({share}): more than the device's memory"
        if self.variable is None:
            return f"does not fit ({share})"
        needed = math.ceil(100 * total * (1 + HEADROOM) / self.device.memory) / 100
        if needed <= MAX_FRACTION:
            return f"does not fit ({share}); fits with {self.variable}={needed:.2f}"
        return (f"does not fit ({share}): it needs {self.variable}={needed:.2f}, above the {MAX_FRACTION} that leaves "
                f"room for the CUDA context and libraries")


def memory_limit(device: Device, settings: AllocatorSettings) -> MemoryLimit:
    """What JAX's allocator may hold on `device` under `settings` (see `AllocatorSettings`)."""
    if not device.gpu:
        return MemoryLimit(device, None, "no allocator fraction on a TPU")
    if settings.allocator == "platform":
        return MemoryLimit(device, None, f"{ALLOCATOR}=platform: no pool, allocated on demand")
    how = (f"{settings.variable}={settings.fraction:g}" if settings.fraction is not None
           else f"{FRACTION} unset: JAX's default")
    if not settings.preallocate:
        how += f"; {PREALLOCATE}=false grows the pool on demand up to the same limit"
    if settings.allocator == "vmm":  # XLA sizes the BFC and cuda_async pools by the fraction; this one unchecked
        how += f"; {ALLOCATOR}=vmm, counted as the BFC allocator's limit"
    fraction = DEFAULT_FRACTION if settings.fraction is None else settings.fraction
    return MemoryLimit(device, fraction, how, settings.variable)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A decode loop that generation compiles: k drafts per round, or with `auto` the most a round
    may draft (each round then chooses its own k in 0..k); mode: its sampling transform."""

    k: int
    auto: bool = False
    mode: SamplingMode = SamplingMode()

    @property
    def label(self) -> str:
        rounds = f"auto (k = 0..{self.k} per round)" if self.auto else f"k = {self.k}"
        filters = " and ".join(name for name, on in (("top-k", self.mode.top_k), ("top-p", self.mode.top_p)) if on)
        mode = "greedy" if self.mode.greedy else "sampling" + (f" with {filters}" if filters else "")
        return f"{rounds}, {mode}"


# Sampling with both filters compiled in: what `jaxmtp generate` runs for a checkpoint whose
# generation_config.json samples with top-k and top-p, or with --temperature, --top-k and --top-p.
SAMPLING = SamplingMode(greedy=False, top_k=True, top_p=True)


def default_loops(config: ModelConfig, k: int, which: str = "both", greedy: bool = False) -> tuple[Loop, ...]:
    """The loops `jaxmtp plan` compiles: which="auto": the speculative_k="auto" loop that
    `jaxmtp generate` runs by default (k = 0..generation.AUTO_MAX_K per round on an accelerator;
    plain decoding for a model without an MTP layer); "fixed": speculative_k=k; "both" (without
    repeating a loop). Sampling with top-k and top-p, or greedy."""
    if which not in ("auto", "fixed", "both"):
        raise InputError(f'loops: expected "auto", "fixed" or "both", found {which!r}')
    mode = SamplingMode() if greedy else SAMPLING
    auto = Loop(AUTO_MAX_K, True, mode) if config.has_mtp else Loop(0, False, mode)
    loops = {"auto": (auto,), "fixed": (Loop(k, False, mode),), "both": (auto, Loop(k, False, mode))}[which]
    return tuple(dict.fromkeys(loops))


def abstract_inputs(config: ModelConfig, mesh, batch: int, prompt_len: int, max_len: int, k: int, dtype,
                    matmul: str = "dequant", prefill_chunk: int = DEFAULT_PREFILL_CHUNK, *, auto: bool = False,
                    mode: SamplingMode = SamplingMode()):
    """(Static, (abstract parameters, abstract `Inputs`)) for generation on `mesh` by the loop of
    `k` (with `auto`: k at most) and sampling `mode`, with the parameters in the layout `generate`
    decodes in (jaxmtp.layout.decode_layout); FP8 weights (kept when the config is quantized)
    multiplied by `matmul`."""
    keep = config.quantization is not None
    layout = decode_layout(config, abstract_params(config, dtype, keep_fp8=keep), mesh)
    params = with_matmul(abstract_params(config, dtype, keep_fp8=keep, layout=layout), matmul,
                         config.quantization.scale_fmt if keep else None)
    shardings = param_shardings(config, params, mesh, layout)
    params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings)
    width = prompt_width(prompt_len, prefill_chunk)
    static = Static(config, jnp.dtype(dtype), k, mode, max(width, max_len), layout, auto=auto and k > 0,
                    prefill_chunk=prefill_chunk)
    rows = batch_sharding(mesh, 1) if batch % mesh.shape["data"] == 0 else replicated(mesh)
    matrix = batch_sharding(mesh, 2) if batch % mesh.shape["data"] == 0 else replicated(mesh)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=replicated(mesh))  # noqa: E731
    per_row = lambda dt: jax.ShapeDtypeStruct((batch,), dt, sharding=rows)  # noqa: E731
    inputs = Inputs(prompt=jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=matrix), lengths=per_row(jnp.int32),
                    limits=per_row(jnp.int32), real=per_row(jnp.bool_),
                    stops=jax.ShapeDtypeStruct((4, 1), jnp.int32, sharding=replicated(mesh)),
                    sampling=SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32)),
                    key=jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated(mesh)),
                    costs=jax.ShapeDtypeStruct((k + 1,), jnp.float32, sharding=replicated(mesh)),
                    force_k=scalar(jnp.int32))
    return static, (params, inputs)


def _generation_program():
    """A new jitted program of the prefill and every round, as a device holds them for the memory
    figures, for one plan. JAX keeps what a jitted function compiled for as long as the function
    lives (about 1,400 memory mappings per plan of the tiny config on 8 devices), so `fit`'s many
    compiles with one function reached the kernel's limit on mappings (vm.max_map_count, 65530 by
    default), where XLA's next compile failed; a function per plan is released with it."""

    def _generation(static: Static, params, inputs: Inputs):
        state = start(static, params, inputs)
        return advance(static, params, state, inputs, jnp.int32(ALL_STEPS), jnp.zeros_like(inputs.real))[0]

    return jax.jit(_generation, static_argnums=0)


def plan(config: ModelConfig, data: int, expert: int, tensor: int, batch: int, max_len: int, prompt_len: int,
         k: int = 2, dtype=jnp.bfloat16, matmul: str = "dequant", prefill_chunk: int = DEFAULT_PREFILL_CHUNK, *,
         auto: bool = False, mode: SamplingMode = SamplingMode()) -> dict:
    """Compiles generation by one loop (`Loop(k, auto, mode)`) for the mesh and returns per-device
    byte counts."""
    mesh = make_mesh(data, expert, tensor, jax.devices()[:data * expert * tensor])
    static, args = abstract_inputs(config, mesh, batch, prompt_len, max_len, k, dtype, matmul, prefill_chunk,
                                   auto=auto, mode=mode)
    leaves = jax.tree.leaves(args[0])
    param_bytes = max(bytes_per_device(leaves, [leaf.sharding for leaf in leaves]).values())
    fp8 = sum(w.value.size for w in jax.tree.leaves(args[0], is_leaf=lambda v: isinstance(v, QuantizedWeight))
              if isinstance(w, QuantizedWeight))
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    rows_per_device = batch // data if batch % data == 0 else batch
    cache_bytes = layers * rows_per_device * static.cache_len * config.cached_per_token * jnp.dtype(dtype).itemsize
    start = time.perf_counter()
    with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as dump:
        compiled = _generation_program().lower(static, *args).compile(compiler_options={"xla_dump_to": dump,
                                                                             "xla_dump_hlo_pass_re": "^$"})
        seconds = time.perf_counter() - start
        temporaries = largest_temporaries(dump)
    memory = compiled.memory_analysis()
    return {"devices": data * expert * tensor, "mesh": {"data": data, "expert": expert, "tensor": tensor},
            "batch": batch, "cache_len": static.cache_len, "prompt_len": args[1].prompt.shape[1], "k": k,
            "auto": static.auto, "loop": Loop(k, static.auto, mode).label, "matmul": matmul,
            "prefill_chunk": prefill_chunk,
            "parameter_bytes_per_device": int(param_bytes), "fp8_weights": int(fp8),
            "cache_bytes_per_device": int(cache_bytes),
            "xla_argument_bytes": int(memory.argument_size_in_bytes), "xla_output_bytes": int(memory.output_size_in_bytes),
            "xla_temp_bytes": int(memory.temp_size_in_bytes), "compile_seconds": seconds,
            "largest_temporaries": temporaries}


def plans(config: ModelConfig, data: int, expert: int, tensor: int, batch: int, max_len: int, prompt_len: int, *,
          loops: Sequence[Loop], dtype=jnp.bfloat16, matmul: str = "dequant",
          prefill_chunk: int = DEFAULT_PREFILL_CHUNK, progress=lambda figures: None) -> list[dict]:
    """`plan`'s figures for each of `loops` (one compile each), in their order; `progress`
    receives each as it is compiled."""
    out = []
    for loop in loops:
        out.append(plan(config, data, expert, tensor, batch, max_len, prompt_len, loop.k, dtype, matmul, prefill_chunk,
                        auto=loop.auto, mode=loop.mode))
        progress(out[-1])
    return out


def largest(results: Sequence[dict]) -> dict:
    """Of several loops' figures, the one whose program holds the most per device (the first of equals)."""
    return max(results, key=total_bytes)


def largest_temporaries(dump: str, count: int = 8, program: str = "_generation") -> list[dict]:
    """The largest buffers of the temporary allocation of the compiled `program` (the jitted
    function's name; by default the generation), from XLA's buffer assignment in `dump` (an
    --xla_dump_to folder): [{"bytes", "shape", "op"}], largest first, one entry per (shape, op)
    pair. `op` is the JAX operation that made the buffer (its op_name metadata, e.g.
    ".../advance/while/body/.../moe/mlp/experts/..."), or XLA's instruction name where it has none."""
    (assignment,) = glob.glob(f"{dump}/*{program}*buffer-assignment.txt")
    (module,) = glob.glob(f"{dump}/*{program}*after_optimizations.txt")
    ops = _op_names(open(module).read())
    text = open(assignment).read()
    temp = next(block for block in re.split(r"^(?=allocation \d+:)", text, flags=re.M)
                if "preallocated-temp" in block.split("\n", 1)[0])
    values = re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", temp)
    seen, out = set(), []
    for name, size, shape in sorted(values, key=lambda v: -int(v[1])):
        op = ops.get(name, name).removeprefix(f"jit({program})/").replace("\\'", "'")
        shape = shape.split("{")[0]
        if (shape, op) not in seen:
            seen.add((shape, op))
            out.append({"bytes": int(size), "shape": shape, "op": op})
        if len(out) == count:
            break
    return out


def _op_names(program: str) -> dict[str, str]:
    """Instruction name -> the JAX op_name behind it, from an optimized HLO module's text. A fusion
    without one of its own takes its fused computation's root's (or else any of its
    instructions'); one that only reads parameters (a dtype conversion of a weight) names them."""
    named, fused, operands, computations = {}, {}, {}, {}
    computation = None
    for line in program.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
            continue
        instruction = re.match(r"^\s*(ROOT )?%(\S+) = \S+ (\S+?)\((.*?)\)", line)
        if not instruction:
            continue
        root, name = instruction.group(1), instruction.group(2)
        op = re.search(r'op_name="([^"]*)"', line)
        if op:
            named[name] = op.group(1)
            if computation and (root or computation not in computations):
                computations[computation] = op.group(1)
        calls = re.search(r"calls=%(\S+?)[,\s]", line)
        if calls:
            fused[name] = calls.group(1)
        operands[name] = re.findall(r"%(\S+?)[,)]", instruction.group(4) + ")")
    for name, computation in fused.items():
        if name not in named:
            read = [named[o] for o in operands.get(name, ()) if o in named and o not in fused]
            named[name] = computations.get(computation) or ("reads " + ", ".join(read) if read else name)
    return named


def total_bytes(figures: dict) -> int:
    """Per-device bytes XLA holds for the program: arguments, temporaries and outputs."""
    return figures["xla_argument_bytes"] + figures["xla_temp_bytes"] + figures["xla_output_bytes"]


def fit(config: ModelConfig, data: int, expert: int, tensor: int, capacity: float, k: int = 2, dtype=jnp.bfloat16,
        matmul: str = "dequant", prefill_chunk: int = DEFAULT_PREFILL_CHUNK, rows: int = 4,
        progress=lambda figures: None, *, loops: Sequence[Loop] | None = None, planner=None) -> list[dict]:
    """The largest cache lengths that fit `capacity` bytes per device (a `MemoryLimit`'s bytes),
    for batches of data x 1, 2, 4, .. rows per device (`rows` batches at most, fewer where not even
    one prefill chunk fits), each with a prompt as long as its cache (prefilled in chunks). Each
    size counts the largest of `loops` (default: `default_loops(config, k)`, the auto loop with
    sampling and speculative_k=k), compiled one by one.

    Three sizes fit a model of the per-device total, a + batch x (cache_len x x + y) (the
    caches grow with both, the prefill's and the decode loop's temporaries with the batch); each
    batch's predicted length, rounded down to CONTEXT_STEP, is then compiled to check it, and
    shortened by the excess over the per-token cost until it fits. Where that cost cannot explain
    the excess (DeepSeek-V4's compressed caches cost little per token, and the temporaries of
    attending over a long one dominate), the search halves the ratio between the longest length
    known to fit and the shortest known not to, until they are within FIT_RATIO of each other
    (`_longest`). -> the `plan` result of the
    largest loop of each batch that fits, smallest batch first, with "loops": [{"loop",
    "total_bytes"}] of every loop. `progress` receives every compile's figures. `planner`: `plans`
    by default, or another with its arguments and figures (DeepSeek-V4's,
    jaxmtp.models.deepseek_v4.plan.plans). After each size it drops JAX's compiled programs
    (jax.clear_caches), which would otherwise stay for the process's life."""
    loops = default_loops(config, k) if loops is None else tuple(loops)
    planner = plans if planner is None else planner

    def measure(batch, length):
        results = planner(config, data, expert, tensor, batch, length, length, loops=loops, dtype=dtype, matmul=matmul,
                          prefill_chunk=prefill_chunk, progress=progress)
        # JAX's caches keep each compiled program (and its memory mappings: about 1,400 per DeepSeek-V4
        # program on 8 devices) for the process's life; a long search reached the kernel's limit on
        # mappings (vm.max_map_count, 65530 by default), where LLVM failed to allocate. The search
        # drops them after each size.
        jax.clear_caches()
        return dict(largest(results), loops=[{"loop": r["loop"], "total_bytes": total_bytes(r)} for r in results])

    longest = config.max_position_embeddings - max(loop.k for loop in loops) - 1
    short, long_ = 4 * CONTEXT_STEP, min(32 * CONTEXT_STEP, longest)
    if long_ <= short:
        raise InputError(f"fit: max_position_embeddings {config.max_position_embeddings} leaves no room to search")
    base = total_bytes(measure(data, short))
    per_token = (total_bytes(measure(data, long_)) - base) / (data * (long_ - short))
    per_row = (total_bytes(measure(2 * data, short)) - base) / data  # at the short length
    fixed = base - data * per_row
    out = []
    for i in range(rows):
        batch = data << i
        room = (capacity - fixed) / batch - (per_row - short * per_token)
        length = min(int(room / per_token) // CONTEXT_STEP * CONTEXT_STEP, longest // CONTEXT_STEP * CONTEXT_STEP)
        figures = _longest(lambda n, batch=batch: measure(batch, n), length, max(prefill_chunk, CONTEXT_STEP),
                           capacity, batch * per_token)
        if figures is None:
            break
        out.append(figures)
    return out


# fit's search stops once the longest length known to fit is within this ratio of the shortest
# known not to.
FIT_RATIO = 1.25


def _longest(measure, length: int, floor: int, capacity: float, per_token: float) -> dict | None:
    """The figures of the longest cache length (a multiple of CONTEXT_STEP, at least `floor`) that
    `measure(length)` finds within `capacity`, starting at the predicted `length`: a length that
    does not fit is shortened by what its excess holds at `per_token` bytes per cache token (the
    caches' cost, which predicts the V3 family's well); where that would go below the floor, or
    once some length fits, the next is the geometric mean of the longest that fits (or the floor)
    and the shortest that does not, until they are within FIT_RATIO. None where the floor does not
    fit."""
    best, fits, fails = None, None, None
    while length >= floor:
        figures = measure(length)
        excess = total_bytes(figures) - capacity
        if excess <= 0:
            best, fits = figures, length
        else:
            fails = length
        if fails is None or (fits is not None and (fails <= FIT_RATIO * fits or fails - fits <= CONTEXT_STEP)):
            return best
        if fits is None:
            guess = int(length - excess / per_token) // CONTEXT_STEP * CONTEXT_STEP
            if guess >= floor:
                length = min(length - CONTEXT_STEP, guess)
                continue
            if length == floor:
                return None
        low = floor if fits is None else fits
        length = max(low if fits is None else low + CONTEXT_STEP,
                     min(fails - CONTEXT_STEP, int(math.sqrt(low * fails)) // CONTEXT_STEP * CONTEXT_STEP))
    return best


def fit_report(results: list[dict], limit: MemoryLimit) -> str:
    """`fit`'s results against `limit` as the table `jaxmtp plan --fit` prints: one row per
    batch, and the setting that raises the limit where one does."""
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    lines = [limit.describe()]
    if results:
        loops = "; ".join(loop["loop"] for loop in results[0]["loops"])
        lines += [f"largest cache (= prompt, prefilled in chunks of {results[0]['prefill_chunk']}) within that limit, "
                  f"by batch, counting the largest of the loops {loops}:",
                  "batch  cache tokens  params GB  caches GB  temporaries GB  total GB  compile s  largest loop"]
    else:
        lines.append("nothing fits within that limit")
    for r in results:
        lines.append(f"{r['batch']:5d}  {r['cache_len']:12d}  {gb(r['parameter_bytes_per_device']):>9s}  "
                     f"{gb(r['cache_bytes_per_device']):>9s}  {gb(r['xla_temp_bytes']):>14s}  "
                     f"{gb(total_bytes(r)):>8s}  {r['compile_seconds']:9.0f}  {r['loop']}")
    if limit.variable is not None and limit.fraction < MAX_FRACTION:
        most = gb(MAX_FRACTION * limit.device.memory)
        lines.append(f"{limit.variable}={MAX_FRACTION} would let JAX hold up to {most} GB per device: run again "
                     "with it set to search against that")
    return "\n".join(lines)


def report(results: Sequence[dict], limits: Sequence[MemoryLimit]) -> str:
    """`plans`' figures as `jaxmtp plan` prints them: each loop's total, the largest loop's
    per-device memory by kind, its fit within each of `limits`, and its largest temporaries."""
    gb = lambda b: f"{b / 1e9:8.2f} GB"  # noqa: E731
    figures = largest(results)
    m = figures["mesh"]
    total = total_bytes(figures)
    width = max(len(r["loop"]) for r in results)
    lines = [f"mesh data={m['data']} expert={m['expert']} tensor={m['tensor']} ({figures['devices']} devices), "
             f"batch {figures['batch']}, cache {figures['cache_len']} tokens, prompt bucket {figures['prompt_len']}, "
             f"prefill chunk {figures['prefill_chunk']}, matmul={figures['matmul']}",
             f"{'decode loop':{width}s}  total GB  temporaries GB  compile s"]
    lines += [f"{r['loop']:{width}s}  {total_bytes(r) / 1e9:8.2f}  {r['xla_temp_bytes'] / 1e9:14.2f}  "
              f"{r['compile_seconds']:9.0f}" for r in results]
    lines += [f"the largest, {figures['loop']}:",
              f"parameters per device (largest):     {gb(figures['parameter_bytes_per_device'])}"
              f"   ({figures['fp8_weights'] / 1e9:.1f} B weights kept block-scaled)",
              f"caches per device (main + MTP):      {gb(figures['cache_bytes_per_device'])}",
              f"XLA arguments per device:            {gb(figures['xla_argument_bytes'])}",
              f"XLA temporaries per device:          {gb(figures['xla_temp_bytes'])}",
              f"XLA outputs per device:              {gb(figures['xla_output_bytes'])}",
              f"total per device:                    {gb(total)}",
              "within the memory JAX may hold on each device:"]
    lines += [f"  {limit.describe()}: {limit.verdict(total)}" for limit in limits]
    lines.append("largest temporaries (XLA buffer assignment, the largest loop):")
    for t in figures["largest_temporaries"]:
        lines.append(f"  {gb(t['bytes'])}  {t['shape']:28s} {t['op'][-110:]}")
    return "\n".join(lines)
