"""Will DeepSeek-V4 fit? Per-device memory of its speculative decoding on a mesh, from abstract shapes.

V4 decodes one jitted program at a time (jaxmtp.models.deepseek_v4.speculative): a prefill chunk
over every row's caches, then rounds of k drafts. A plan compiles, ahead of time for the mesh and on
abstract arrays carrying their NamedShardings, the prefill chunk and the round of the most drafts a
loop may take (with its MTP repair), and counts the larger of the two programs by XLA's own memory
analysis: its arguments (the parameters, FP8 and FP4 weights kept as `load_v4` keeps them, and the
caches or the round's state), temporaries and outputs. The figures have the keys of
jaxmtp.plan.plan, so that jaxmtp.plan's reports and its `fit` search serve V4 as they do V3.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.memory import bytes_per_device
from jaxmtp.models.deepseek_v4 import names as v4names
from jaxmtp.models.deepseek_v4.checkpoint import FP4_BLOCK, with_matmul
from jaxmtp.models.deepseek_v4.config import V4Config
from jaxmtp.models.deepseek_v4.model import abstract_params, cache_bytes, param_shardings, rows_sharding
from jaxmtp.models.deepseek_v4.speculative import RoundState, run_round
from jaxmtp.models.deepseek_v4.speculative import prefill_chunk as prefill_chunk_program
from jaxmtp.models.deepseek_v4.transformer import new_caches, new_mtp_cache, stack_layers, unstack_layers
from jaxmtp.plan import Loop, largest_temporaries, total_bytes
from jaxmtp.quant import KERNEL_BLOCK, QuantizedWeight, scale_shape
from jaxmtp.sampling import SamplingParams
from jaxmtp.sharding import make_mesh, replicated


def kept_params(config: V4Config, dtype=jnp.bfloat16, matmul: str = "dequant"):
    """The abstract parameter tree as `load_v4(keep_quantized=True)` holds a released checkpoint:
    the FP8 linears as QuantizedWeight (e4m3 values, float32 scales of 128 x 128 blocks, multiplied
    by `matmul`), the routed experts as FP4 (e2m1 values, one float32 scale per 32 inputs; FP8 where
    the config's expert_dtype says "fp8", as the base releases' do; V4-Pro's published config names
    none, and its experts ship in FP4), everything else dense in `dtype`. A config without
    quantization gives dense weights throughout."""
    def one(path, leaf):
        keys = tuple(k.key for k in path)
        forms = v4names.quantizable(keys)
        if not forms or config.quantization is None:
            return leaf
        fp4 = forms[0] == "fp4" and config.expert_dtype != "fp8"
        block = FP4_BLOCK if fp4 else tuple(KERNEL_BLOCK)
        value = jax.ShapeDtypeStruct(leaf.shape, jnp.float4_e2m1fn if fp4 else jnp.float8_e4m3fn)
        scale = jax.ShapeDtypeStruct(scale_shape(leaf.shape, block), jnp.float32)
        return QuantizedWeight(value, scale, block, "dequant")

    layers = jax.tree_util.tree_map_with_path(one, unstack_layers(config, abstract_params(config, dtype)))
    params = stack_layers(config, layers)
    return with_matmul(params, matmul, config.quantization and config.quantization.scale_fmt)


def _placed(tree, shardings):
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings)


def _rows(mesh, tree, batch: int, axis: int = 0):
    """Abstract arrays whose axis `axis` is the batch, split over `data` where it divides the batch
    (as V4Model.place_rows places them), else replicated."""
    divides = batch % mesh.shape["data"] == 0

    def one(leaf):
        sharding = rows_sharding(mesh, leaf.ndim, axis) if divides and leaf.ndim > axis else replicated(mesh)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _compile(program, name: str, args: tuple, static: tuple) -> dict:
    """Compiles `program` (a jitted function whose first len(static) arguments are static) and
    returns its memory figures, largest temporaries and compile seconds."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        compiled = program.lower(*static, *args).compile(compiler_options={"xla_dump_to": dump,
                                                                          "xla_dump_hlo_pass_re": "^$"})
        seconds = time.perf_counter() - began
        temporaries = largest_temporaries(dump, program=name)
    memory = compiled.memory_analysis()
    return {"program": name, "xla_argument_bytes": int(memory.argument_size_in_bytes),
            "xla_output_bytes": int(memory.output_size_in_bytes), "xla_temp_bytes": int(memory.temp_size_in_bytes),
            "largest_temporaries": temporaries, "compile_seconds": seconds}


def plans(config: V4Config, data: int, expert: int, tensor: int, batch: int, max_len: int, prompt_len: int, *,
          loops: Sequence[Loop], dtype=jnp.bfloat16, matmul: str = "dequant",
          prefill_chunk: int = DEFAULT_PREFILL_CHUNK, progress=lambda figures: None) -> list[dict]:
    """jaxmtp.plan.plans for DeepSeek-V4: for `batch` rows of caches of max_len positions (with the
    headroom of the most drafts any loop takes), compiles a prefill chunk of `prefill_chunk`
    positions once and, for each loop, its round of the most drafts (auto's with its MTP repair),
    and returns each loop's figures (jaxmtp.plan.plan's keys) for the larger of its round and the
    prefill, with "programs" and "program_temp_bytes": each program's total and temporary bytes.
    prompt_len is recorded only: a prompt of any length is prefilled by the same chunk program.
    `progress` receives each loop's figures."""
    mesh = make_mesh(data, expert, tensor, jax.devices()[:data * expert * tensor])
    headroom = max(loop.k for loop in loops) + 1
    params = kept_params(config, dtype, matmul)
    params = _placed(params, param_shardings(config, params, mesh))
    caches = _rows(mesh, jax.eval_shape(lambda: new_caches(config, batch, max_len, headroom, dtype)), batch, axis=1)
    mtp_cache = _rows(mesh, jax.eval_shape(lambda: new_mtp_cache(config, batch, max_len, headroom, dtype)), batch)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=replicated(mesh))  # noqa: E731
    per_row = lambda shape, dt: _rows(mesh, jax.ShapeDtypeStruct((batch,) + shape, dt), batch)  # noqa: E731
    sampling = SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
    span = min(config.sliding_window, prefill_chunk)
    chunk_args = (params, per_row((prefill_chunk,), jnp.int32), scalar(jnp.int32), per_row((), jnp.int32), caches,
                  per_row((span, config.hc_mult, config.hidden_size), dtype), per_row((config.vocab_size,), jnp.float32))
    leaves = jax.tree.leaves(params)
    per_token, per_sequence = cache_bytes(config, dtype, headroom)
    rows_per_device = batch // data if batch % data == 0 else batch
    common = {"devices": data * expert * tensor, "mesh": {"data": data, "expert": expert, "tensor": tensor},
              "batch": batch, "cache_len": max_len, "prompt_len": prompt_len, "matmul": matmul,
              "prefill_chunk": prefill_chunk,
              "parameter_bytes_per_device": int(max(bytes_per_device(leaves, [x.sharding for x in leaves]).values())),
              "fp8_weights": int(sum(w.value.size for w in jax.tree.leaves(params, is_leaf=_kept) if _kept(w))),
              "cache_bytes_per_device": int(rows_per_device * (per_token * max_len + per_sequence))}
    out = []
    with jax.set_mesh(mesh):
        prefill = _compile(prefill_chunk_program, "prefill_chunk", chunk_args, (config, jnp.dtype(dtype)))
        for loop in loops:
            state = RoundState(caches=caches, mtp_cache=mtp_cache, n=per_row((), jnp.int32),
                               token=per_row((), jnp.int32), draft=per_row((), jnp.int32),
                               draft_probs=None if loop.mode.greedy else per_row((config.vocab_size,), jnp.float32),
                               recycled=per_row((1, config.hc_mult, config.hidden_size), dtype),
                               key=jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated(mesh)))
            auto = loop.auto and loop.k > 0
            decode = _compile(run_round, "run_round", (params, sampling, state),
                              (config, jnp.dtype(dtype), loop.k, loop.mode, auto or loop.k > 0))
            largest = max((prefill, decode), key=total_bytes)
            out.append(dict(common, k=loop.k, auto=auto, loop=Loop(loop.k, auto, loop.mode).label,
                            compile_seconds=prefill["compile_seconds"] * (not out) + decode["compile_seconds"],
                            programs={p["program"]: total_bytes(p) for p in (prefill, decode)},
                            program_temp_bytes={p["program"]: p["xla_temp_bytes"] for p in (prefill, decode)},
                            largest_program=largest["program"],
                            **{key: largest[key] for key in ("xla_argument_bytes", "xla_output_bytes",
                                                             "xla_temp_bytes", "largest_temporaries")}))
            progress(out[-1])
    return out


def _kept(leaf) -> bool:
    return isinstance(leaf, QuantizedWeight)
