"""DeepSeek-V4 checkpoints: loading DeepSeek's released layout or transformers', keeping the released
FP8 and FP4 weights as they are or dequantizing them, and saving back in either layout.

Formats (the release, spec section 8.1):
- FP8 linears (attention wq_a, wq_b, wkv, wo_a, wo_b; indexer wq_b; shared experts; MTP e_proj, h_proj):
  `float8_e4m3fn` weight [out, in] and a scale per 128x128 block, [ceil(out/128), ceil(in/128)], of
  dtype `float8_e8m0fnu` (one byte b: the power of two 2^(b-127); 255 is NaN) or float32; the weight
  is value x scale of its block. Kept as `jaxmtp.quant.QuantizedWeight` (e4m3 values, float32
  scales, block (128, 128)), as DeepSeek-V3's are.
- FP4 routed experts (instruct releases): the safetensors dtype is int8 [out, in/2], each byte two
  e2m1 codes, the low nibble the lower input index; code c means FP4_CODES[c] (0, .5, 1, 1.5, 2, 3, 4,
  6, then the same negated, -0 first); `float8_e8m0fnu` scale [out, in/32], one per 32 inputs. Kept
  as a QuantizedWeight whose `value` is `jnp.float4_e2m1fn` [out, in] (unpacked: one code per
  element), float32 `scale` [out, in/32] and block (1, 32). The W8A8 kernels take neither FP4
  values nor 1x32 blocks: FP4 weights are always multiplied with matmul="dequant" (dequantized
  inside the jitted step, only the chosen experts when few tokens route; see jaxmtp.moe).
- Base releases ship FP8 routed experts (float32 scales); those load as FP8 too.

Layouts, told apart by the names (see names.py): DeepSeek's (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
one tensor per routed expert, `mtp.0.*`) and transformers' (`model.layers.{i}.self_attn...` as
`DeepseekV4ForCausalLM.state_dict()` names them, or the names its `save_pretrained` writes:
`model.layers.{i}.attn.wq_a.weight`, `head.weight`, ...; dense; no MTP block, though `mtp.0.*` in
DeepSeek's names is read where present: `save_v4(layout="hf")` writes the MTP block so, and
transformers ignores `mtp.*` when it loads).

A checkpoint whose `mtp.*` is not DeepSeek-V4's MTP block (DeepSeek's DSpark block drafter ships
there: several `mtp.N` blocks, `markov_head` / `confidence_head` / `main_proj` tensors, no
`e_proj` / `h_proj`), or that has no `mtp.*` at all, loads its main model only, with
`num_nextn_predict_layers` 0, and the model's `mtp_note` says why (speculation refuses it with that).

Files are read one tensor at a time through a memory map (safetensors headers are parsed and checked
by `safetensors`; the bytes, including `F8_E8M0`, which safetensors' numpy reader cannot return, are
viewed with numpy and ml_dtypes). Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxmtp import checks
from jaxmtp.checkpoint.hf import INDEX_FILE, checkpoint_files
from jaxmtp.checkpoint.save import write_checkpoint
from jaxmtp.checkpoint.sharded import TensorFiles
from jaxmtp.config import QuantizationConfig
from jaxmtp.errors import CheckpointError, InputError
from jaxmtp.models.deepseek_v4 import names as v4names
from jaxmtp.models.deepseek_v4.config import HASH_MOE, V4Config
from jaxmtp.models.deepseek_v4.model import V4Model, abstract_params, param_shardings
from jaxmtp.models.deepseek_v4.transformer import segments, stack_layers, unstack_layers
from jaxmtp.quant import KERNEL_BLOCK, MATMULS, QuantizedWeight, dequantize
from jaxmtp.sharding import place

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
# e2m1 code -> value; codes 8..15 are 0..7 negated (8 is -0).
FP4_CODES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
LAYOUTS = ("deepseek", "hf")

# safetensors dtype -> numpy dtype (little-endian, as the format stores them).
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
          "F8_E8M0": np.uint8, "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
_FLOATS = ("F32", "BF16", "F16", "F64")
_INTS = ("I64", "I32")
_SCALE_DTYPES = {"fp8": ("F8_E8M0", "F32"), "fp4": ("F8_E8M0",)}
_DSPARK_PARTS = ("markov_head", "confidence_head", "main_proj", "main_norm")


# ----- the formats ---------------------------------------------------------------------------
def e8m0_to_float32(raw) -> np.ndarray:
    """`float8_e8m0fnu` bytes (uint8 or ml_dtypes array) -> float32 2^(byte - 127); byte 255 is NaN."""
    raw = np.asarray(raw)
    raw = raw.view(np.uint8) if raw.dtype.itemsize == 1 else raw.astype(np.uint8)
    out = np.ldexp(np.float32(1), np.minimum(raw, 254).astype(np.int32) - 127).astype(np.float32)
    return np.where(raw == 255, np.float32(np.nan), out)


def float32_to_e8m0(scale, name: str = "scale") -> np.ndarray:
    """Float32 scales that are powers of two in 2^-127..2^127 -> their `float8_e8m0fnu` bytes (as an
    ml_dtypes array); anything else raises CheckpointError naming `name` (no rounding)."""
    scale = np.asarray(scale, np.float32)
    mantissa, exponent = np.frexp(scale)
    byte = exponent.astype(np.int64) - 1 + 127
    bad = ~((mantissa == 0.5) & (byte >= 0) & (byte <= 254))
    if bad.any():
        raise CheckpointError(f"{name}: scale {float(scale[bad].flat[0])!r} is not a power of two in 2^-127..2^127, "
                              "so it has no float8_e8m0fnu byte")
    return byte.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def unpack_fp4(packed) -> np.ndarray:
    """int8 [..., n/2] (two e2m1 codes a byte, low nibble first) -> uint8 codes [..., n]."""
    raw = np.asarray(packed).view(np.uint8)
    codes = np.empty(raw.shape[:-1] + (raw.shape[-1] * 2,), np.uint8)
    codes[..., 0::2] = raw & 0x0F
    codes[..., 1::2] = raw >> 4
    return codes


def pack_fp4(codes) -> np.ndarray:
    """uint8 e2m1 codes [..., n] (n even) -> int8 [..., n/2], the lower index in the low nibble."""
    codes = np.asarray(codes).view(np.uint8)
    if codes.shape[-1] % 2 or (codes > 15).any():
        raise InputError("pack_fp4: expects an even number of 4-bit codes per row")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)


def decode_fp4(packed, scale_raw) -> np.ndarray:
    """The release's FP4 weight as float32: packed int8 [out, in/2] and e8m0 scale bytes [out, in/32]
    -> [out, in] = FP4_CODES[code] x 2^(byte - 127) of its group of 32."""
    values = FP4_CODES[unpack_fp4(packed)]
    return values * np.repeat(e8m0_to_float32(scale_raw), FP4_BLOCK[1], axis=-1)


def fp4_weight(packed, scale_raw) -> QuantizedWeight:
    """A kept FP4 weight: QuantizedWeight(value float4_e2m1fn [..., out, in], scale float32
    [..., out, in/32], block (1, 32), matmul "dequant")."""
    codes = unpack_fp4(packed).view(ml_dtypes.float4_e2m1fn)
    return QuantizedWeight(jnp.asarray(codes), jnp.asarray(e8m0_to_float32(scale_raw)), FP4_BLOCK, "dequant")


def is_fp4(weight) -> bool:
    """Whether `weight` is a QuantizedWeight of e2m1 values (the release's routed experts)."""
    return isinstance(weight, QuantizedWeight) and weight.value.dtype == jnp.float4_e2m1fn


def with_matmul(params, matmul: str, scale_fmt: str | None = None):
    """The parameter tree with every FP8 QuantizedWeight of 128x128 blocks multiplied by `matmul`
    ("fp8": the W8A8 kernels, activations quantized with `scale_fmt`, the config's
    quantization.scale_fmt, "ue8m0" for V4; or "dequant"); FP4 weights, and FP8 ones of other blocks,
    which the kernels do not take, stay "dequant". (o_a_proj, a grouped projection, is dequantized
    inside its matmul whatever its weight says.)"""
    if matmul not in MATMULS:
        raise InputError(f"matmul: expected one of {MATMULS}, found {matmul!r}")

    def one(leaf):
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        if is_fp4(leaf) or tuple(leaf.block) != KERNEL_BLOCK:
            return leaf.replace(matmul="dequant")
        return leaf.replace(matmul=matmul, scale_fmt=scale_fmt)

    return jax.tree.map(one, params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))


# ----- what a checkpoint must hold -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: the leaf at `path` (its `expert`-th entry for stacked
    routed experts), the dense shape of this tensor, the block-scaled forms it may come in, and
    `joint` for transformers' gate_up_proj [E, 2I, D] (gate_proj's half first, then up_proj's)."""

    path: tuple[str, ...]
    expert: int | None
    shape: tuple[int, ...]
    forms: tuple[str, ...]
    joint: bool = False


def expected_tensors(config: V4Config, abstract, layout: str) -> dict[str, _Slot]:
    """Every tensor name of the model's parameter tree `abstract` in `layout`: "deepseek" (the
    release's names), "hf" (transformers' state-dict names) or "hf_saved" (the names transformers'
    save_pretrained writes); the MTP block always in DeepSeek's names (`mtp.0.*`). Slot paths name
    the layers one by one (transformer.unstack_layers)."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(unstack_layers(config, abstract))[0]:
        path = tuple(k.key for k in keypath)
        part, _, rest = v4names.split_path(path)
        released = layout == "deepseek" or part in ("mtp", "mtp_block")
        forms = v4names.quantizable(path) if released else ()
        if rest in v4names.EXPERT_WEIGHTS and (released or layout == "hf_saved"):
            for e in range(leaf.shape[0]):
                name = v4names.released_name(path, e)
                out[name if released else v4names.saved_hf_name(name)] = _Slot(path, e, tuple(leaf.shape[1:]), forms)
        elif released:
            out[v4names.released_name(path)] = _Slot(path, None, tuple(leaf.shape), forms)
        elif layout == "hf_saved":
            out[v4names.saved_hf_name(v4names.released_name(path))] = _Slot(path, None, tuple(leaf.shape), ())
        elif rest == "mlp/experts/gate_proj":
            joint = path[:-1] + ("gate_up_proj",)
            e, i, d = leaf.shape
            out[v4names.hf_name(joint)] = _Slot(path, None, (e, 2 * i, d), (), joint=True)
        elif rest != "mlp/experts/up_proj":
            out[v4names.hf_name(path)] = _Slot(path, None, tuple(leaf.shape), ())
    return out


def _layout(names) -> str:
    """"deepseek", "hf" or "hf_saved", from the tensor names."""
    main = [n for n in names if not n.startswith("mtp.")]
    if not any(n.startswith("model.") for n in main):
        return "deepseek"
    layers = [n for n in main if n.startswith("model.layers.")]
    saved = sum(bool(re.match(r"model\.layers\.\d+\.(attn|ffn|hc_attn|hc_ffn|attn_norm|ffn_norm)[._]", n))
                for n in layers)
    return "hf_saved" if saved * 2 > len(layers) else "hf"


def dspark_reason(names) -> str | None:
    """Why the checkpoint's `mtp.*` tensors are not DeepSeek-V4's MTP block (a DSpark drafter's
    marks), or None."""
    mtp = [n for n in names if n.startswith("mtp.")]
    if not mtp:
        return None
    blocks = sorted({int(m.group(1)) for n in mtp if (m := re.match(r"mtp\.(\d+)\.", n))})
    evidence = []
    if len(blocks) > 1:
        evidence.append(f"{len(blocks)} blocks mtp.{blocks[0]}..mtp.{blocks[-1]}")
    parts = [p for p in _DSPARK_PARTS if any(f".{p}." in n or n.endswith(f".{p}") for n in mtp)]
    if parts:
        evidence.append(" / ".join(parts) + " tensors")
    lacking = [n for n in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight") if n not in names]
    if lacking:
        evidence.append("no " + " / ".join(lacking))
    if not evidence:
        return None
    return (f"mtp.* is not DeepSeek-V4's MTP block but looks like a DSpark block drafter ({'; '.join(evidence)}), "
            "which jaxmtp does not run: loaded the main model only (num_nextn_predict_layers = 0)")


# ----- loading -------------------------------------------------------------------------------
def load_v4(path, *, dtype=None, keep_quantized: bool = True, matmul: str = "dequant", mtp: bool = True,
            check_finite: bool = True, mesh=None) -> V4Model:
    """Loads a DeepSeek-V4 checkpoint directory (config.json + *.safetensors [+ index]) in DeepSeek's
    released layout or transformers' (see the module docstring). An MTP block that is a DSpark
    drafter or is absent is left out: the model then has num_nextn_predict_layers 0, and its
    `mtp_note` says what was left out and why (None when everything the config promises loaded).

    Args:
      dtype: the dense parameters' dtype (default float32; bfloat16 is what the release ships).
        Hyper-connection weights, sinks, position biases and the routing bias stay float32.
      keep_quantized: keep FP8 and FP4 weights as QuantizedWeight (see the module docstring); False
        dequantizes them to `dtype`.
      matmul: how kept FP8 weights of 128x128 blocks are multiplied, "dequant" or "fp8" (`with_matmul`).
      mtp: False loads the main model alone, leaving any `mtp.*` tensors unread.
      check_finite: refuse NaN or Inf in any floating tensor (values and scales).
      mesh: place each parameter on this mesh (`jaxmtp.make_mesh`) with its NamedSharding
        (model.param_shardings), each device receiving only its slice; the whole model is read
        onto the host first.
    Every tensor the config implies must be present with its shape and an allowed dtype, and every
    tensor of the files must be one of them: anything else raises CheckpointError naming the tensor.
    model_type deepseek_v41 is refused (ConfigError) by V4Config.from_hf_config.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    if matmul not in MATMULS:
        raise InputError(f"matmul: expected one of {MATMULS}, found {matmul!r}")
    dtype = checks.float_dtype("dtype", dtype or "float32")
    config = V4Config.from_hf_config(os.path.join(directory, "config.json"))
    tensors = TensorFiles(checkpoint_files(directory))
    names = set(tensors.where)
    layout = _layout(names)
    config, skipped, note = _mtp_plan(config, names, layout, mtp)
    expected = expected_tensors(config, abstract_params(config, dtype), layout)
    abstract = unstack_layers(config, abstract_params(config, dtype))  # layer by layer, as the files name them
    block = tuple(config.quantization.weight_block_size) if config.quantization else FP8_BLOCK
    forms = _check_names(directory, tensors, expected, skipped, block, config)  # all headers before any data
    leaf_forms = {slot.path: forms[name] for name, slot in expected.items()}  # stacked experts share one
    if keep_quantized:
        _check_stackable(config, leaf_forms)
    buffers = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path = tuple(k.key for k in keypath)
        buffers[path] = _buffer(leaf, leaf_forms.get(path, "dense") if keep_quantized else "dense", block)
    for name, slot in sorted(expected.items(), key=lambda item: (tensors.where[item[0]][0], item[0])):  # file by file
        up = buffers[slot.path[:-1] + ("up_proj",)] if slot.joint else None
        _place(tensors, name, slot, forms[name], buffers[slot.path], keep_quantized, block, check_finite,
               config.n_routed_experts, up)
    params = {}
    for path in list(buffers):
        _put(params, path, _on_host(buffers.pop(path)))
    params = stack_layers(config, params)
    params = place(params, param_shardings(config, params, mesh)) if mesh is not None else jax.tree.map(
        jnp.asarray, params)
    kept = {form for form in leaf_forms.values() if form != "dense"} if keep_quantized else set()
    expert_forms = {form for path, form in leaf_forms.items() if v4names.split_path(path)[2] in v4names.EXPERT_WEIGHTS}
    model = V4Model(_loaded_config(config, kept, expert_forms, block), params, mesh, mtp_note=note)
    if kept:
        scale_fmt = model.config.quantization.scale_fmt if model.config.quantization else None
        model = dataclasses.replace(model, params=with_matmul(model.params, matmul, scale_fmt))
    return model


def _check_stackable(config: V4Config, leaf_forms: dict):
    """The layers the model stacks (one segment's repeats of a unit, transformer.segments) must hold
    each weight in one form: CheckpointError naming the first layer whose form differs."""
    for segment in segments(config):
        size = len(segment.kinds)
        for j in range(size):
            first = f"layers_{segment.first + j}"
            for r in range(1, segment.repeats):
                layer = f"layers_{segment.first + r * size + j}"
                for path, form in leaf_forms.items():
                    if path[0] == layer and leaf_forms.get((first,) + path[1:]) != form:
                        name = v4names.released_name(path, 0 if path[-1] in ("gate_proj", "up_proj", "down_proj")
                                                     and "experts" in path else None)
                        raise CheckpointError(
                            f"tensor {name!r} is {form}, but layer {segment.first + j}'s is "
                            f"{leaf_forms.get((first,) + path[1:])}: jaxmtp stacks layers {segment.first}.."
                            f"{segment.layers[-1]} and keeps each weight of them in one form; load with "
                            "keep_quantized=False to dequantize them all")


def _mtp_plan(config: V4Config, names, layout: str, mtp: bool):
    """(config, names left unread, note) for the checkpoint's `mtp.*` part."""
    mtp_names = {n for n in names if n.startswith("mtp.")}
    main_only = config.replace(num_nextn_predict_layers=0)
    if not mtp:
        return main_only, mtp_names, None
    reason = dspark_reason(names)
    if reason:
        return main_only, mtp_names, reason
    if not mtp_names and config.has_mtp:
        where = ("transformers' layout has no MTP block" if layout != "deepseek" else
                 "the checkpoint has no mtp.* tensors")
        return main_only, set(), (f"{where} although config.json sets num_nextn_predict_layers = "
                                  f"{config.num_nextn_predict_layers}: loaded the main model only")
    if mtp_names and not config.has_mtp:
        raise CheckpointError(f"tensor {sorted(mtp_names)[0]!r}: an MTP block, but config.json sets "
                              "num_nextn_predict_layers = 0")
    return config, set(), None


def _check_names(directory, tensors: TensorFiles, expected: dict, skipped, block, config) -> dict[str, str]:
    """Checks every tensor's name, dtype and shape against `expected` before any is read.
    -> name -> form ("dense", "fp8" or "fp4") of every expected tensor."""
    where = tensors.where
    scales = {}
    for name, (file, _, _) in where.items():
        if name in expected or name in skipped:
            continue
        weight = name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else None
        if weight in expected and expected[weight].forms:
            scales[weight] = name
            continue
        raise CheckpointError(f"{file}: unexpected tensor {name!r} for this config ({config.num_hidden_layers} "
                              f"layers, {config.n_routed_experts} experts, {config.num_nextn_predict_layers} MTP)")
    missing = [name for name in expected if name not in where]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    forms, by_leaf = {}, {}
    for name, slot in expected.items():
        file, kind, shape = where[name]
        form = {"F8_E4M3": "fp8", "I8": "fp4"}.get(kind, "dense")
        if form != "dense" and form not in slot.forms:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}; the release stores only "
                                  f"{'the routed experts' if form == 'fp4' else 'its linear projections'} so")
        if form == "dense":
            allowed = _INTS if slot.path[-1] == "tid2eid" else _FLOATS
            if kind not in allowed:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}, expected {' or '.join(allowed)}")
            if name in scales:
                raise CheckpointError(f"{where[scales[name]][0]}: tensor {scales[name]!r} is a block scale beside "
                                      f"{name!r}, which is not block-scaled ({kind})")
            _check_shape(file, name, shape, slot.shape)
        else:
            scale = name.removesuffix(".weight") + ".scale"
            if name not in scales:
                raise CheckpointError(f"{file}: tensor {scale!r} missing: the block scale of {name!r} ({kind})")
            scale_file, scale_kind, scale_shape = where[scale]
            if scale_kind not in _SCALE_DTYPES[form]:
                raise CheckpointError(f"{scale_file}: tensor {scale!r} has dtype {scale_kind}; the scale of an "
                                      f"{form.upper()} weight must be {' or '.join(_SCALE_DTYPES[form])}")
            out_dim, in_dim = slot.shape
            if form == "fp8":
                _check_shape(file, name, shape, slot.shape)
                _check_shape(scale_file, scale, scale_shape, (-(-out_dim // block[0]), -(-in_dim // block[1])))
            else:
                if in_dim % FP4_BLOCK[1]:
                    raise CheckpointError(f"{file}: tensor {name!r} is FP4, but its {in_dim} inputs are not a "
                                          f"multiple of the {FP4_BLOCK[1]} that share a scale")
                _check_shape(file, name, shape, (out_dim, in_dim // 2), " (two FP4 codes a byte)")
                _check_shape(scale_file, scale, scale_shape, (out_dim, in_dim // FP4_BLOCK[1]))
        first = by_leaf.setdefault(slot.path, (name, form))
        if first[1] != form:
            raise CheckpointError(f"{file}: tensor {name!r} is {form}, but {first[0]!r} of the same stacked "
                                  f"parameter is {first[1]}: the routed experts of a layer must share a format")
        forms[name] = form
    return forms


def _check_shape(file, name, shape, want, why=""):
    if tuple(shape) != tuple(want):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(want)}{why} from "
                              "config.json")


@dataclasses.dataclass
class _Kept:
    """Host buffers of a kept weight: e4m3 values or e2m1 codes (uint8) and float32 scales."""

    form: str
    value: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]


def _buffer(leaf, form: str, block):
    if form == "dense":
        return np.empty(leaf.shape, leaf.dtype)
    shape = tuple(leaf.shape)
    if form == "fp8":
        scale = shape[:-2] + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        return _Kept(form, np.empty(shape, ml_dtypes.float8_e4m3fn), np.empty(scale, np.float32), tuple(block))
    return _Kept(form, np.empty(shape, np.uint8), np.empty(shape[:-1] + (shape[-1] // FP4_BLOCK[1],), np.float32),
                 FP4_BLOCK)


def _read(tensors: TensorFiles, name: str) -> np.ndarray:
    """A copy of the tensor `name` (F8_E8M0 as its uint8 bytes), through a mapping dropped at once."""
    file, kind, shape = tensors.where[name]
    try:
        if math.prod(shape) == 0:
            return np.empty(shape, _NUMPY[kind])
        mapped = np.memmap(file, dtype=_NUMPY[kind], mode="r", offset=tensors.offsets[name], shape=(math.prod(shape),))
        return np.array(mapped).reshape(shape)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None


def _place(tensors, name, slot: _Slot, form, buffer, keep, block, check_finite, experts, up=None):
    """Reads the tensor `name` (with its scale) into its leaf's buffer (`up`: up_proj's buffer, for
    the second half of a joint gate_up_proj; `experts`: how many a tid2eid entry may name)."""
    value = _read(tensors, name)
    file = tensors.where[name][0]
    index = () if slot.expert is None else (slot.expert,)
    if form == "dense":
        if slot.path[-1] == "tid2eid":
            if value.size and (value.min() < 0 or value.max() >= experts):
                raise CheckpointError(f"{file}: tensor {name!r} routes to experts {int(value.min())}..."
                                      f"{int(value.max())}, outside 0..{experts - 1}")
        else:
            _finite(file, name, value, check_finite)
        if slot.joint:
            half = slot.shape[1] // 2
            buffer[...] = value[:, :half].astype(buffer.dtype)
            up[...] = value[:, half:].astype(up.dtype)
            return
        buffer[index] = value.astype(buffer.dtype)
        return
    scale_name = name.removesuffix(".weight") + ".scale"
    raw = _read(tensors, scale_name)
    scale = e8m0_to_float32(raw) if tensors.where[scale_name][1] == "F8_E8M0" else raw.astype(np.float32)
    _finite(tensors.where[scale_name][0], scale_name, scale, check_finite)
    if form == "fp8":
        _finite(file, name, value, check_finite)
    if keep:
        buffer.value[index] = unpack_fp4(value) if form == "fp4" else value
        buffer.scale[index] = scale
    elif form == "fp8":
        buffer[index] = dequantize(value, scale, block).astype(buffer.dtype)
    else:
        buffer[index] = dequantize(FP4_CODES[unpack_fp4(value)], scale, FP4_BLOCK).astype(buffer.dtype)


def _finite(file, name, value, check):
    if check and not np.isfinite(value).all():
        raise CheckpointError(f"{file}: tensor {name!r} contains NaN or Inf")


def _on_host(buffer):
    """A filled buffer as the parameter it holds, still in host memory."""
    if isinstance(buffer, _Kept):
        value = buffer.value.view(ml_dtypes.float4_e2m1fn) if buffer.form == "fp4" else buffer.value
        return QuantizedWeight(value, buffer.scale, buffer.block, "dequant")
    return buffer


def _put(tree: dict, path, value):
    *parents, leaf = path
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _loaded_config(config: V4Config, kept: set, expert_forms: set, block) -> V4Config:
    """The loaded model's config: quantization_config and expert_dtype describe the weights it holds."""
    if not kept:
        return config.replace(quantization=None, expert_dtype=None)
    quantization = config.quantization
    if "fp8" in kept and quantization is None:
        quantization = QuantizationConfig(weight_block_size=tuple(block))
    expert = next((form for form in ("fp4", "fp8") if form in expert_forms), None)
    return config.replace(quantization=quantization, expert_dtype=expert)


# ----- saving --------------------------------------------------------------------------------
def save_v4(model: V4Model, path, *, layout: str = "deepseek", overwrite: bool = False,
            max_shard_bytes: int = 4 << 30):
    """Writes `model` to the directory `path`: config.json, model-XXXXX-of-YYYYY.safetensors and
    model.safetensors.index.json, written and fsynced in a temporary directory beside `path` and then
    moved there (jaxmtp.checkpoint.save.write_checkpoint); a non-empty `path` is refused unless
    `overwrite`, which replaces it whole.

    layout "deepseek": DeepSeek's released names; kept FP8 weights as float8_e4m3fn with their scales
    (float8_e8m0fnu where the config's quantization.scale_fmt is "ue8m0", else float32), kept FP4
    weights packed two codes a byte in int8 with float8_e8m0fnu scales, the rest in the dtypes the
    parameters have (tid2eid int64): loading a released checkpoint with `dtype` bfloat16 and saving it
    gives back the same tensors, bit for bit. A dense model is written dense under the same names.
    layout "hf": transformers' `DeepseekV4ForCausalLM` state-dict names, every weight dense in the
    model's dtype (kept ones dequantized), which `from_pretrained` loads; the MTP block, which
    transformers lacks (and skips on load), follows in DeepSeek's names (`mtp.0.*`)."""
    if layout not in LAYOUTS:
        raise InputError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    # Layer by layer, as checkpoints name them: each layer's slice of a stacked parameter is a copy
    # on its devices while the checkpoint is written.
    layers = unstack_layers(model.config, model.params)
    entries = _released_entries(model, layers) if layout == "deepseek" else _hf_entries(model, layers)
    raw = _saved_config(model, layers, layout)
    write_checkpoint(os.fspath(path), lambda directory: _write(directory, raw, entries, max_shard_bytes), overwrite)


def _leaves(params):
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]:
        yield tuple(k.key for k in keypath), leaf


class _Host:
    """The host copy of one parameter at a time (entries of one leaf come one after another)."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key, make):
        if key != self.key:
            self.key, self.value = None, None
            self.value, self.key = make(), key
        return self.value


def _released_entries(model: V4Model, layers: dict):
    """[(name, nbytes, thunk giving the array)] in DeepSeek's released layout, of `layers` (the
    model's parameters layer by layer, transformer.unstack_layers)."""
    config, host, entries = model.config, _Host(), []
    e8m0 = config.quantization is not None and config.quantization.scale_fmt == "ue8m0"
    for path, leaf in _leaves(layers):
        stacked = v4names.split_path(path)[2] in v4names.EXPERT_WEIGHTS
        for e in range(leaf.shape[0]) if stacked else (None,):
            name = v4names.released_name(path, e)
            index = () if e is None else (e,)
            shape = tuple(leaf.shape[len(index):])
            if not isinstance(leaf, QuantizedWeight):
                out_dtype = np.int64 if path[-1] == "tid2eid" else leaf.dtype
                entries.append((name, math.prod(shape) * np.dtype(out_dtype).itemsize,
                                lambda path=path, leaf=leaf, index=index, out_dtype=out_dtype:
                                host.get(path, lambda: np.asarray(leaf))[index].astype(out_dtype)))
                continue
            if not v4names.quantizable(path):
                raise CheckpointError(f"parameter {'/'.join(path)}: kept block-scaled, which DeepSeek's layout has no "
                                      "form for")
            scale_name = name.removesuffix(".weight") + ".scale"
            fp4 = is_fp4(leaf)

            def arrays(path=path, leaf=leaf):
                return np.asarray(leaf.value), np.asarray(leaf.scale)

            scale_shape = tuple(leaf.scale.shape[len(index):])
            if fp4:
                entries.append((name, math.prod(shape) // 2, lambda path=path, arrays=arrays, index=index:
                                pack_fp4(host.get(path, arrays)[0][index].view(np.uint8))))
                entries.append((scale_name, math.prod(scale_shape), lambda path=path, arrays=arrays, index=index,
                                scale_name=scale_name: float32_to_e8m0(host.get(path, arrays)[1][index], scale_name)))
            else:
                entries.append((name, math.prod(shape), lambda path=path, arrays=arrays, index=index:
                                host.get(path, arrays)[0][index]))
                entries.append((scale_name, math.prod(scale_shape) * (1 if e8m0 else 4),
                                lambda path=path, arrays=arrays, index=index, scale_name=scale_name:
                                (float32_to_e8m0(host.get(path, arrays)[1][index], scale_name) if e8m0 else
                                 host.get(path, arrays)[1][index].astype(np.float32))))
    return entries


def _hf_entries(model: V4Model, params: dict):
    """[(name, nbytes, thunk)] in transformers' layout: dense, gate and up joined, MTP in DeepSeek's
    names, of `params` (the model's parameters layer by layer)."""
    dtype, entries = model.dtype, []

    def dense(leaf):
        return np.asarray(leaf.dequantize(dtype) if isinstance(leaf, QuantizedWeight) else leaf)

    for path, leaf in _leaves(params):
        part, _, rest = v4names.split_path(path)
        out_dtype = np.int64 if path[-1] == "tid2eid" else (dtype if isinstance(leaf, QuantizedWeight) else leaf.dtype)
        if part in ("mtp", "mtp_block"):
            stacked = rest in v4names.EXPERT_WEIGHTS
            for e in range(leaf.shape[0]) if stacked else (None,):
                index = () if e is None else (e,)
                entries.append((v4names.released_name(path, e), math.prod(leaf.shape[len(index):]) *
                                np.dtype(out_dtype).itemsize,
                                lambda leaf=leaf, index=index, out_dtype=out_dtype:
                                dense(leaf[index] if not isinstance(leaf, QuantizedWeight) else
                                      leaf.replace(value=leaf.value[index], scale=leaf.scale[index]))
                                .astype(out_dtype)))
            continue
        if rest == "mlp/experts/up_proj":
            continue
        if rest == "mlp/experts/gate_proj":
            up = _subtree(params, path[:-1])["up_proj"]
            joint = path[:-1] + ("gate_up_proj",)
            e, i, d = leaf.shape
            entries.append((v4names.hf_name(joint), e * 2 * i * d * np.dtype(out_dtype).itemsize,
                            lambda leaf=leaf, up=up, out_dtype=out_dtype:
                            np.concatenate([dense(leaf), dense(up)], axis=1).astype(out_dtype)))
            continue
        entries.append((v4names.hf_name(path), math.prod(leaf.shape) * np.dtype(out_dtype).itemsize,
                        lambda leaf=leaf, out_dtype=out_dtype: dense(leaf).astype(out_dtype)))
    return entries


def _subtree(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _saved_config(model: V4Model, layers: dict, layout: str) -> dict:
    """config.json as written: quantization_config and expert_dtype only for weights kept so."""
    config = model.config
    leaves = [leaf for _, leaf in _leaves(layers) if isinstance(leaf, QuantizedWeight)]
    if layout == "hf" or not leaves:
        config = config.replace(quantization=None, expert_dtype=None)
    else:
        fp8 = [leaf for leaf in leaves if not is_fp4(leaf)]
        if fp8 and config.quantization is None:
            config = config.replace(quantization=QuantizationConfig(weight_block_size=tuple(fp8[0].block)))
        experts = [leaf for path, leaf in _leaves(layers)
                   if isinstance(leaf, QuantizedWeight) and v4names.split_path(path)[2] in v4names.EXPERT_WEIGHTS]
        config = config.replace(expert_dtype=("fp4" if is_fp4(experts[0]) else "fp8") if experts else None)
    raw = config.to_hf_config()
    raw["dtype"] = str(model.dtype)
    if layout == "deepseek":  # DeepSeek's own spelling of the layer pattern too, for readers that want it
        raw["compress_ratios"] = [config.compress_rate(t) for t in config.layer_types] + [0] * (
            config.num_nextn_predict_layers)
        hashed = config.mlp_layer_types.count(HASH_MOE)
        if config.mlp_layer_types[:hashed] == (HASH_MOE,) * hashed:
            raw["num_hash_layers"] = hashed
    return raw


def _write(directory: str, raw: dict, entries, max_shard_bytes: int):
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    shards, current, size = [], [], 0
    for entry in entries:
        if current and size + entry[1] > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[1]
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {name: np.ascontiguousarray(make()) for name, _, make in shard}
        save_file(arrays, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, file))
        total += sum(a.nbytes for a in arrays.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
