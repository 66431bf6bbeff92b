"""Will it fit? Per-device memory of speculative generation on a mesh, from abstract shapes only.

Parameters (FP8 kept where the config is quantized) and the inputs are abstract arrays carrying
their NamedShardings; the whole generation function (prefill + the speculative while_loop) is
compiled ahead of time for that mesh, and XLA's own memory analysis gives the per-device figures.
"""

from __future__ import annotations

import glob
import math
import re
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp

from jaxmtp.config import ModelConfig
from jaxmtp.decoding import Inputs, Static, advance, start
from jaxmtp.errors import InputError
from jaxmtp.generation import ALL_STEPS, prompt_width
from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.layout import decode_layout
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.quant import QuantizedWeight, with_matmul
from jaxmtp.sampling import SamplingMode, SamplingParams
from jaxmtp.sharding import batch_sharding, make_mesh, replicated

DEVICES = {"H200 (141 GB)": 141e9, "H100 (80 GB)": 80e9, "TPU v5p (95 GB)": 95e9, "TPU v6e (32 GB)": 32e9}
# The name `jaxmtp plan --fit` takes for each.
DEVICE_NAMES = {"h200": "H200 (141 GB)", "h100": "H100 (80 GB)", "v5p": "TPU v5p (95 GB)", "v6e": "TPU v6e (32 GB)"}
# Cache lengths that `fit` reports are multiples of this (the cache bucket past 1024 slots).
CONTEXT_STEP = 1024


def _per_device_bytes(array: jax.ShapeDtypeStruct) -> int:
    return math.prod(array.sharding.shard_shape(array.shape)) * jnp.dtype(array.dtype).itemsize


def abstract_inputs(config: ModelConfig, mesh, batch: int, prompt_len: int, max_len: int, k: int, dtype,
                    matmul: str = "dequant", prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
    """(Static, (abstract parameters, abstract `Inputs`)) for greedy generation on `mesh`, with the
    parameters in the layout `generate` decodes in (jaxmtp.layout.decode_layout); FP8 weights
    (kept when the config is quantized) multiplied by `matmul`."""
    keep = config.quantization is not None
    layout = decode_layout(config, abstract_params(config, dtype, keep_fp8=keep), mesh)
    params = with_matmul(abstract_params(config, dtype, keep_fp8=keep, layout=layout), matmul,
                         config.quantization.scale_fmt if keep else None)
    shardings = param_shardings(config, params, mesh, layout)
    params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings)
    width = prompt_width(prompt_len, prefill_chunk)
    static = Static(config, jnp.dtype(dtype), k, SamplingMode(), max(width, max_len), layout,
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


@partial(jax.jit, static_argnums=0)
def _generation(static: Static, params, inputs: Inputs):
    """The prefill and every round in one program, as a device holds them for the memory figures."""
    state = start(static, params, inputs)
    return advance(static, params, state, inputs, jnp.int32(ALL_STEPS), jnp.zeros_like(inputs.real))[0]


def plan(config: ModelConfig, data: int, expert: int, tensor: int, batch: int, max_len: int, prompt_len: int,
         k: int = 2, dtype=jnp.bfloat16, matmul: str = "dequant", prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict:
    """Compiles speculative generation for the mesh and returns per-device byte counts."""
    mesh = make_mesh(data, expert, tensor, jax.devices()[:data * expert * tensor])
    static, args = abstract_inputs(config, mesh, batch, prompt_len, max_len, k, dtype, matmul, prefill_chunk)
    leaves = jax.tree.leaves(args[0])
    param_bytes = max(sum(_per_device_bytes(x) for x in leaves if d in x.sharding.device_set) for d in mesh.devices.flat)
    fp8 = sum(w.value.size for w in jax.tree.leaves(args[0], is_leaf=lambda v: isinstance(v, QuantizedWeight))
              if isinstance(w, QuantizedWeight))
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    rows_per_device = batch // data if batch % data == 0 else batch
    cache_bytes = layers * rows_per_device * static.cache_len * config.cached_per_token * jnp.dtype(dtype).itemsize
    start = time.perf_counter()
    with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as dump:
        compiled = _generation.lower(static, *args).compile(compiler_options={"xla_dump_to": dump,
                                                                             "xla_dump_hlo_pass_re": "^$"})
        seconds = time.perf_counter() - start
        temporaries = largest_temporaries(dump)
    memory = compiled.memory_analysis()
    return {"devices": data * expert * tensor, "mesh": {"data": data, "expert": expert, "tensor": tensor},
            "batch": batch, "cache_len": static.cache_len, "prompt_len": args[1].prompt.shape[1], "k": k, "matmul": matmul,
            "prefill_chunk": prefill_chunk,
            "parameter_bytes_per_device": int(param_bytes), "fp8_weights": int(fp8),
            "cache_bytes_per_device": int(cache_bytes),
            "xla_argument_bytes": int(memory.argument_size_in_bytes), "xla_output_bytes": int(memory.output_size_in_bytes),
            "xla_temp_bytes": int(memory.temp_size_in_bytes), "compile_seconds": seconds,
            "largest_temporaries": temporaries}


def largest_temporaries(dump: str, count: int = 8) -> list[dict]:
    """The largest buffers of the compiled generation's temporary allocation, from XLA's buffer
    assignment in `dump` (an --xla_dump_to folder): [{"bytes", "shape", "op"}], largest first, one
    entry per (shape, op) pair. `op` is the JAX operation that made the buffer (its op_name
    metadata, e.g. ".../advance/while/body/.../moe/mlp/experts/..."), or XLA's instruction name
    where it has none."""
    (assignment,) = glob.glob(f"{dump}/*_generation*buffer-assignment.txt")
    (program,) = glob.glob(f"{dump}/*_generation*after_optimizations.txt")
    ops = _op_names(open(program).read())
    text = open(assignment).read()
    temp = next(block for block in re.split(r"^(?=allocation \d+:)", text, flags=re.M)
                if "preallocated-temp" in block.split("\n", 1)[0])
    values = re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", temp)
    seen, out = set(), []
    for name, size, shape in sorted(values, key=lambda v: -int(v[1])):
        op = ops.get(name, name).removeprefix("jit(_generation)/").replace("\\'", "'")
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
        progress=lambda figures: None) -> list[dict]:
    """The largest cache lengths that fit `capacity` bytes per device, for batches of data x 1, 2,
    4, .. rows per device (`rows` batches at most, fewer where not even one prefill chunk fits),
    each with a prompt as long as its cache (prefilled in chunks).

    Three compiles fit a model of the per-device total, a + batch x (cache_len x x + y) (the
    caches grow with both, the prefill's and the decode loop's temporaries with the batch); each
    batch's predicted length, rounded down to CONTEXT_STEP, is then compiled to check it, and
    shortened by the excess over the per-token cost until it fits. -> the `plan` result of each
    batch that fits, smallest batch first. `progress` receives every compile's figures."""
    def measure(batch, length):
        figures = plan(config, data, expert, tensor, batch, length, length, k, dtype, matmul, prefill_chunk)
        progress(figures)
        return figures

    longest = config.max_position_embeddings - k - 1
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
        while length >= max(prefill_chunk, CONTEXT_STEP):
            figures = measure(batch, length)
            excess = total_bytes(figures) - capacity
            if excess <= 0:
                out.append(figures)
                break
            # Shorter by what the excess holds in cache tokens (the per-token cost is the caches'
            # and predicts well; the batch's temporaries are what the model misjudges).
            length = min(length - CONTEXT_STEP,
                         int(length - excess / (batch * per_token)) // CONTEXT_STEP * CONTEXT_STEP)
        else:
            break
    return out


def fit_report(results: list[dict], device: str) -> str:
    """`fit`'s results as the table `jaxmtp plan --fit` prints: one row per batch."""
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    lines = [f"largest cache (= prompt, prefilled in chunks of {results[0]['prefill_chunk']}) that fits {device}, "
             f"by batch:" if results else f"nothing fits {device}",
             "batch  cache tokens  params GB  caches GB  temporaries GB  total GB  compile s"]
    for r in results:
        lines.append(f"{r['batch']:5d}  {r['cache_len']:12d}  {gb(r['parameter_bytes_per_device']):>9s}  "
                     f"{gb(r['cache_bytes_per_device']):>9s}  {gb(r['xla_temp_bytes']):>14s}  "
                     f"{gb(total_bytes(r)):>8s}  {r['compile_seconds']:9.0f}")
    return "\n".join(lines if results else lines[:1])


def report(figures: dict) -> str:
    """`plan`'s figures as `jaxmtp plan` prints them: per-device memory by kind, the fit on each
    device in DEVICES, and the largest temporaries."""
    gb = lambda b: f"{b / 1e9:8.2f} GB"  # noqa: E731
    m = figures["mesh"]
    total = total_bytes(figures)
    lines = [f"mesh data={m['data']} expert={m['expert']} tensor={m['tensor']} ({figures['devices']} devices), "
             f"batch {figures['batch']}, cache {figures['cache_len']} tokens, prompt bucket {figures['prompt_len']}, "
             f"prefill chunk {figures['prefill_chunk']}, k={figures['k']}, matmul={figures['matmul']}; "
             f"compiled in {figures['compile_seconds']:.0f} s",
             f"parameters per device (largest):     {gb(figures['parameter_bytes_per_device'])}"
             f"   ({figures['fp8_weights'] / 1e9:.1f} B weights kept FP8)",
             f"MLA caches per device (main + MTP):  {gb(figures['cache_bytes_per_device'])}",
             f"XLA arguments per device:            {gb(figures['xla_argument_bytes'])}",
             f"XLA temporaries per device:          {gb(figures['xla_temp_bytes'])}",
             f"XLA outputs per device:              {gb(figures['xla_output_bytes'])}",
             f"total per device:                    {gb(total)}"]
    for name, capacity in DEVICES.items():
        lines.append(f"  fits {name}: {'yes' if total <= capacity else 'no'} ({100 * total / capacity:.0f}% of memory)")
    lines.append("largest temporaries (XLA buffer assignment):")
    for t in figures["largest_temporaries"]:
        lines.append(f"  {gb(t['bytes'])}  {t['shape']:28s} {t['op'][-110:]}")
    return "\n".join(lines)

