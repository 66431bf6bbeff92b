"""DeepSeek-V4 checkpoints (jaxmtp.models.deepseek_v4.checkpoint): the release's FP8 and FP4 formats
decoded bit for bit against numpy written here from their description; a tiny checkpoint in DeepSeek's
released layout (written here, not by save_v4) loaded kept and dequantized, equal logits and greedy
tokens, the FP8 kernels on it; save -> load round trips (the released layout bit for bit, transformers'
loaded by transformers); bad checkpoints refused by name."""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxmtp.config import QuantizationConfig
from jaxmtp.errors import CheckpointError, ConfigError, InputError
from jaxmtp.models.deepseek_v4 import CSA, HCA, V4Config, init_v4
from jaxmtp.models.deepseek_v4 import names as v4names
from jaxmtp.models.deepseek_v4.checkpoint import (FP4_CODES, decode_fp4, e8m0_to_float32, float32_to_e8m0,
                                                   fp4_weight, is_fp4, load_v4, pack_fp4, save_v4, unpack_fp4,
                                                   with_matmul)
from jaxmtp.models.deepseek_v4.speculative import generate
from jaxmtp.models.deepseek_v4.transformer import unstack_layers
from jaxmtp.moe import gathered_experts, local_experts
from jaxmtp.quant import QuantizedWeight, dequantize
from jaxmtp.sharding import make_mesh

# The format, as published: code -> value, low nibble = the lower input index, scale byte b = 2^(b - 127).
TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

# Widths over 128 and not multiples of it, so FP8 weights have several blocks, partial ones at the edges;
# two HCA layers, which the model keeps stacked and runs in a loop (transformer.segments).
CONFIG = V4Config(vocab_size=256, hidden_size=192, moe_intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, q_lora_rank=160, n_routed_experts=4, num_experts_per_tok=2,
                  layer_types=(CSA, HCA, HCA), mlp_layer_types=("hash_moe", "moe", "moe"), head_dim=64, qk_rope_head_dim=16,
                  sliding_window=8, compress_rates=(4, 8), o_groups=2, o_lora_rank=32, index_n_heads=4,
                  index_head_dim=32, index_topk=2, hc_mult=2, initializer_range=0.1,
                  quantization=QuantizationConfig(scale_fmt="ue8m0"), expert_dtype="fp4")
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 19))


# ----- reference codecs, from the format's description ------------------------------------------
def ref_scale(byte):
    return np.float32(np.nan) if byte == 255 else np.float32(2.0 ** (int(byte) - 127))


SCALES = np.array([ref_scale(b) for b in range(256)], np.float32)


def ref_fp4_decode(packed, scale_bytes):
    """int8 [out, in/2], e8m0 bytes [out, in/32] -> float32 [out, in]: input c is byte c // 2's low
    nibble for even c, its high nibble for odd c, times the scale of inputs 32 (c // 32)..."""
    packed, scale_bytes = np.asarray(packed).view(np.uint8), np.asarray(scale_bytes).view(np.uint8)
    c = np.arange(packed.shape[1] * 2)
    byte = packed[:, c // 2]
    code = np.where(c % 2 == 0, byte & 15, byte >> 4)
    return np.asarray(TABLE, np.float32)[code] * SCALES[scale_bytes[:, c // 32]]


def ref_fp8_decode(value, scale_bytes):
    """e4m3 [out, in], e8m0 bytes per 128x128 block -> float32 [out, in]."""
    scale_bytes = np.asarray(scale_bytes).view(np.uint8)
    r, c = np.arange(value.shape[0])[:, None], np.arange(value.shape[1])[None]
    return np.asarray(value).astype(np.float32) * SCALES[scale_bytes[r // 128, c // 128]]


def ref_fp8_encode(w):
    """float32 [out, in] -> (e4m3 [out, in], e8m0 bytes [ceil(out/128), ceil(in/128)]): per block the
    power of two at or above amax / 448."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scales = np.zeros((rows, cols), np.uint8)
    value = np.zeros(w.shape, np.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            exponent = int(np.ceil(np.log2(max(np.abs(tile).max(), 1e-30) / 448)))
            scales[i, j] = exponent + 127
            value[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = tile / 2.0 ** exponent
    return value.astype(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu)


def ref_fp4_encode(w):
    """float32 [out, in] -> (int8 [out, in/2], e8m0 bytes [out, in/32]): per 32 inputs the power of two
    at or above amax / 6, each value the nearest code."""
    groups = w.reshape(w.shape[0], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6)).astype(int)
    scaled = groups / 2.0 ** exponent[..., None]
    magnitude = np.abs(np.asarray(TABLE[:8])[None, None, None] - np.abs(scaled)[..., None]).argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).reshape(w.shape).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(np.int8), (exponent + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


# ----- safetensors read byte by byte, and the released checkpoint written here ---------------------
def raw_tensors(directory):
    """name -> (safetensors dtype, shape, bytes) of every tensor of the directory's files."""
    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            with open(os.path.join(directory, file), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
                data = f.read()
            for name, entry in header.items():
                if name != "__metadata__":
                    start, stop = entry["data_offsets"]
                    assert name not in out
                    out[name] = (entry["dtype"], tuple(entry["shape"]), data[start:stop])
    return out


_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8, "I64": np.int64}


def arrays(directory):
    return {name: np.frombuffer(data, _DTYPES[kind]).reshape(shape)
            for name, (kind, shape, data) in raw_tensors(directory).items()}


def write_checkpoint(directory, config, tensors, shards=2):
    """config.json and the tensors in `shards` files with an index, as the release has them."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: np.ascontiguousarray(tensors[n]) for n in names[i::shards]}
        save_file(part, os.path.join(directory, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def released_tensors(params):
    """The release's tensors of a dense parameter tree: FP8 linears and FP4 experts (quantized with
    the reference encoders above), bf16 weights and norms, float32 hyper-connections, sinks, position
    and routing biases, int64 tid2eid."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(k.key for k in keypath)
        leaf = np.asarray(leaf)
        forms = v4names.quantizable(path)
        for e in range(leaf.shape[0]) if "fp4" in forms else (None,):
            name = v4names.released_name(path, e)
            w = leaf if e is None else leaf[e]
            if forms:
                value, scale = (ref_fp4_encode if "fp4" in forms else ref_fp8_encode)(w)
                out[name], out[name.removesuffix(".weight") + ".scale"] = value, scale
            elif path[-1] == "tid2eid":
                out[name] = w.astype(np.int64)
            elif leaf.dtype == np.float32 and path[-1] in ("fn", "base", "scale", "hc_fn", "hc_base", "hc_scale",
                                                           "sinks", "position_bias", "e_score_correction_bias"):
                out[name] = w
            else:
                out[name] = w.astype(ml_dtypes.bfloat16)
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A released-layout checkpoint of a random tiny model: its directory and its tensors."""
    model = init_v4(CONFIG, seed=3)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(  # the zero-initialised biases and sinks random too
        lambda kp, a: a + rng.normal(size=a.shape).astype(np.float32) * 0.3
        if kp[-1].key in ("base", "sinks", "position_bias", "e_score_correction_bias", "hc_base") else a, model.params)
    tensors = released_tensors(unstack_layers(CONFIG, params))
    directory = str(tmp_path_factory.mktemp("v4_released"))
    write_checkpoint(directory, CONFIG.to_hf_config(), tensors)
    return directory, tensors


@pytest.fixture(scope="module")
def loaded(released):
    directory, _ = released
    kept = load_v4(directory)
    dense = load_v4(directory, keep_quantized=False)
    note, dense_note = kept.mtp_note, dense.mtp_note
    assert note is None and dense_note is None
    return kept, dense


# ----- (i) the formats ---------------------------------------------------------------------------
def test_e8m0_scales_are_powers_of_two_of_the_byte_minus_127():
    every = np.arange(256, dtype=np.uint8)
    got = e8m0_to_float32(every.view(ml_dtypes.float8_e8m0fnu))
    want = np.array([ref_scale(b) for b in every])
    assert np.array_equal(got.view(np.uint32)[:255], want.view(np.uint32)[:255]) and np.isnan(got[255])
    assert got[0] == np.float32(2.0 ** -127) and got[127] == 1 and got[254] == np.float32(2.0 ** 127)
    assert np.array_equal(float32_to_e8m0(got[:255]).view(np.uint8), every[:255])
    with pytest.raises(CheckpointError, match="w.scale: scale 3.0 is not a power of two"):
        float32_to_e8m0(np.array([1.0, 3.0]), "w.scale")


def test_fp4_decoding_all_codes_nibble_order_and_edge_scales():
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32).view(np.int8)  # every pair of codes
    # Row 0's scales give subnormal products, which numpy keeps and XLA's CPU backend flushes to zero;
    # 252 is the largest byte at which 6 x scale stays finite.
    scale = np.array([[0, 1], [126, 127], [128, 252], [127, 120], [3, 250], [127, 127], [100, 200], [64, 190]],
                     np.uint8)
    want = ref_fp4_decode(packed, scale)
    assert np.array_equal(FP4_CODES.view(np.uint32), np.asarray(TABLE, np.float32).view(np.uint32))
    assert want[0, 0] == 0 and want[0, 1] == 0 and want[0, 2] == np.float32(0.5 * 2.0 ** -127)  # byte 1: codes 1, 0
    got = decode_fp4(packed, scale.view(ml_dtypes.float8_e8m0fnu))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # -0 included
    assert np.array_equal(unpack_fp4(packed)[0, :4], [0, 0, 1, 0]) and np.array_equal(pack_fp4(unpack_fp4(packed)),
                                                                                         packed)
    kept = fp4_weight(packed, scale)
    assert kept.value.dtype == np.dtype(ml_dtypes.float4_e2m1fn) and kept.block == (1, 32) and is_fp4(kept)
    assert np.array_equal(np.asarray(kept.value).view(np.uint8), unpack_fp4(packed))
    for got in (kept.dequantize(), jax.jit(lambda w: w.dequantize())(kept)):
        assert np.array_equal(np.asarray(got)[1:].view(np.uint32), want[1:].view(np.uint32))


def test_fp8_decoding_every_code_and_edge_scales():
    codes = np.arange(256, dtype=np.uint8)
    value = np.resize(codes[(codes & 0x7F) != 0x7F], (130, 260)).view(ml_dtypes.float8_e4m3fn)  # no NaN codes
    # Edge bytes in the small edge blocks; 448 x 2^(246 - 127) is still finite.
    scale = np.array([[127, 246, 0], [1, 128, 126]], np.uint8)
    want = ref_fp8_decode(value, scale)
    got = dequantize(value, e8m0_to_float32(scale), (128, 128))  # what load_v4 does with keep_quantized=False
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    kept = QuantizedWeight(jnp.asarray(value), jnp.asarray(e8m0_to_float32(scale)))
    # XLA's CPU backend flushes subnormals, among them byte 0's scale 2^-127, to zero.
    normal = ((want == 0) | (np.abs(want) >= np.finfo(np.float32).tiny)) & (np.repeat(np.repeat(
        scale, 128, 0), 128, 1)[:130, :260] > 0)
    assert normal.mean() > 0.9
    assert np.array_equal(np.asarray(kept.dequantize())[normal], want[normal])


def test_fp4_experts_run_in_the_moe_paths_as_their_dequantized_weights():
    rng = np.random.default_rng(0)
    e, i, d = 4, 32, 64
    weights = []
    for shape in ((e, i, d), (e, i, d), (e, d, i)):
        parts = [ref_fp4_encode(rng.normal(size=shape[1:]).astype(np.float32)) for _ in range(e)]
        weights.append(fp4_weight(np.stack([p for p, _ in parts]), np.stack([s for _, s in parts])))
    dense = [np.asarray(w.dequantize()) for w in weights]
    x = jnp.asarray(rng.normal(size=(5, d)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, e, (5, 2)), jnp.int32)
    routing = jnp.asarray(rng.random((5, 2)), jnp.float32)
    want = np.asarray(local_experts(x, routing, experts, *dense, first=0, num_experts=e, limit=10.0))
    for fn in (lambda *w: gathered_experts(x, routing, experts, *w, limit=10.0),
               lambda *w: local_experts(x, routing, experts, *w, first=0, num_experts=e, limit=10.0)):
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(*weights)), want, rtol=2e-5, atol=1e-5)


# ----- (ii) a released checkpoint, kept and dequantized -------------------------------------------
def test_flash_has_the_released_tensor_count_and_shapes():
    """69,187 tensors in V4-Flash's released files (spec section 8.3), weights and scales."""
    from jaxmtp import CONFIGS
    from jaxmtp.models.deepseek_v4.checkpoint import expected_tensors
    from jaxmtp.models.deepseek_v4.model import abstract_params

    config = V4Config.from_hf_config(f"{CONFIGS}/deepseek_v4_flash.json")
    expected = expected_tensors(config, abstract_params(config), "deepseek")
    assert len(expected) + sum(1 for slot in expected.values() if slot.forms) == 69187
    shapes = {name: slot.shape for name, slot in expected.items()}
    assert shapes["layers.42.ffn.experts.255.w2.weight"] == (4096, 2048) and shapes["mtp.0.hc_head_fn"] == (4, 16384)
    assert shapes["layers.3.attn.compressor.ape"] == (128, 512) and shapes["layers.2.attn.indexer.wq_b.weight"] == (
        8192, 1024)
    assert expected["mtp.0.ffn.experts.0.w1.weight"].forms == ("fp4", "fp8") and "layers.3.ffn.gate.bias" in shapes


def test_released_layout_loads_every_tensor_exactly(released, loaded):
    _, tensors = released
    kept, dense = loaded
    assert "mtp.0.e_proj.scale" in tensors and "mtp.0.hc_head_fn" in tensors and "mtp.0.attn.kv_norm.weight" in tensors
    assert tensors["layers.0.ffn.experts.3.w2.weight"].shape == (192, 32) and "layers.0.ffn.gate.tid2eid" in tensors
    assert tensors["layers.1.attn.wq_a.scale"].shape == (2, 2) and "layers.1.ffn.gate.bias" in tensors
    paths = released_paths()
    dense_layers, kept_layers = unstack_layers(CONFIG, dense.params), unstack_layers(CONFIG, kept.params)
    assert set(paths) == {name for name in tensors if not name.endswith(".scale")}
    for name, value in tensors.items():
        if name.endswith(".scale"):
            continue
        path, e = paths[name]
        got_dense, got_kept = _leaf(dense_layers, path), _leaf(kept_layers, path)
        if e is not None:
            got_dense = got_dense[e]
            got_kept = got_kept.replace(value=got_kept.value[e], scale=got_kept.scale[e])
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            assert np.array_equal(np.asarray(got_dense), value.astype(got_dense.dtype)), name
            continue
        scale = scale.view(np.uint8)
        want = ref_fp4_decode(value, scale) if value.dtype == np.int8 else ref_fp8_decode(value, scale)
        assert np.array_equal(np.asarray(got_dense), want), name
        assert isinstance(got_kept, QuantizedWeight) and np.array_equal(np.asarray(got_kept.dequantize()), want), name
        assert got_kept.block == ((1, 32) if value.dtype == np.int8 else (128, 128)) and got_kept.matmul == "dequant"
    assert kept.config.quantization.scale_fmt == "ue8m0" and kept.config.expert_dtype == "fp4"
    assert dense.config.quantization is None and dense.config.has_mtp


def released_paths():
    """released name -> (parameter path, expert index or None) of CONFIG's tree."""
    from jaxmtp.models.deepseek_v4.model import abstract_params

    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(unstack_layers(CONFIG, abstract_params(CONFIG)))[0]:
        path = tuple(k.key for k in keypath)
        for e in range(leaf.shape[0]) if v4names.split_path(path)[2] in v4names.EXPERT_WEIGHTS else (None,):
            out[v4names.released_name(path, e)] = path, e
    return out


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_kept_weights_give_the_dequantized_models_logits_and_tokens(loaded):
    kept, dense = loaded
    want, _ = dense.forward(TOKENS)
    got, _ = kept.forward(TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    prompts = TOKENS[:, :15]
    new = np.array(kept.greedy(prompts.tolist(), 4, chunk=19))  # prefill: the forward's [2, 19] step, compiled
    # Each greedy token is the dequantized model's argmax after the tokens before it (its [2, 19]
    # forward too).
    logits, _ = dense.forward(np.concatenate([prompts, new], axis=1))
    assert np.array_equal(new, np.asarray(logits)[:, 14:18].argmax(-1))


def test_kept_weights_run_the_fp8_kernels(loaded):
    """matmul="fp8" (interpreted Pallas kernels on CPU): the FP8 linears on the W8A8 kernels, the FP4
    experts still dequantized; a few greedy tokens."""
    kept, _ = loaded
    fp8 = kept.__class__(kept.config, with_matmul(kept.params, "fp8", "ue8m0"))
    leaves = jax.tree.leaves(fp8.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    assert {(is_fp4(w), w.matmul) for w in leaves if isinstance(w, QuantizedWeight)} == {(True, "dequant"),
                                                                                          (False, "fp8")}
    tokens = fp8.greedy([TOKENS[0, :5].tolist()], 2)
    assert len(tokens[0]) == 2 and all(0 <= t < CONFIG.vocab_size for t in tokens[0])


# ----- (iii) save -> load ----------------------------------------------------------------------
def test_released_layout_round_trips_bit_for_bit(released, tmp_path):
    directory, _ = released
    model = load_v4(directory, dtype="bfloat16")  # the dtype the release's dense tensors have
    save_v4(model, tmp_path / "out", max_shard_bytes=200_000)
    assert len([f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]) > 1
    assert raw_tensors(tmp_path / "out") == raw_tensors(directory)
    again = load_v4(tmp_path / "out")
    assert again.mtp_note is None and again.config == load_v4(directory).config
    with pytest.raises(CheckpointError, match="pass overwrite=True"):
        save_v4(model, tmp_path / "out")
    save_v4(model, tmp_path / "out", overwrite=True)


def test_transformers_loads_what_save_v4_writes_in_either_layout(loaded, tmp_path):
    """transformers.DeepseekV4ForCausalLM.from_pretrained reads both layouts, dense (the released
    names through its own conversion mapping), to equal logits; jaxmtp reads them back, and what
    transformers' save_pretrained writes, to the same parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers without DeepseekV4ForCausalLM")
    _, dense = loaded
    want, _ = dense.forward(TOKENS)
    for layout in ("hf", "deepseek"):
        save_v4(dense, tmp_path / layout, layout=layout)
        hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / layout, output_loading_info=True)
        assert not any(info.values()), (layout, info)
        with torch.no_grad():
            got = hf.float()(torch.tensor(TOKENS)).logits.numpy()
        np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-4)
        back = load_v4(tmp_path / layout)
        note = back.mtp_note
        assert note is None and back.config == dense.config
        assert_same_params(back.params, dense.params)
    hf.save_pretrained(tmp_path / "saved")
    back = load_v4(tmp_path / "saved")
    note = back.mtp_note
    assert "transformers' layout has no MTP block" in note and not back.config.has_mtp
    assert_same_params(back.params, {k: v for k, v in dense.params.items() if k != "mtp"})


def assert_same_params(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


# ----- (iv) bad checkpoints --------------------------------------------------------------------
def variant(released, tmp_path, change, config=None):
    directory, tensors = released
    tensors = dict(tensors)
    change(tensors)
    write_checkpoint(str(tmp_path / "bad"), config or CONFIG.to_hf_config(), tensors, shards=1)
    return str(tmp_path / "bad")


@pytest.mark.parametrize("change, message", [
    (lambda t: [t.pop("layers.1.ffn.experts.2.w3.weight"), t.pop("layers.1.ffn.experts.2.w3.scale")],
     r"1 tensor\(s\) missing, e.g. \['layers.1.ffn.experts.2.w3.weight'\]"),
    (lambda t: t.pop("layers.0.attn.wq_a.scale"), "tensor 'layers.0.attn.wq_a.scale' missing: the block scale"),
    (lambda t: t.update({"layers.0.attn.wkv.weight": t["layers.0.attn.wkv.weight"][:32]}),
     r"tensor 'layers.0.attn.wkv.weight' has shape \[32, 192\], expected \[64, 192\]"),
    (lambda t: t.update({"layers.1.ffn.experts.0.w2.scale": t["layers.1.ffn.experts.0.w2.scale"][:, :1]}),
     r"tensor 'layers.1.ffn.experts.0.w2.scale' has shape \[192, 1\], expected \[192, 2\]"),
    (lambda t: t.update({"layers.0.attn.wq_c.weight": t["layers.0.attn.wq_a.weight"]}),
     "unexpected tensor 'layers.0.attn.wq_c.weight'"),
    (lambda t: t.update({"layers.0.attn.compressor.wkv.scale": t["layers.0.attn.wkv.scale"]}),
     "unexpected tensor 'layers.0.attn.compressor.wkv.scale'"),
    (lambda t: t.update({"layers.0.ffn.gate.weight": t["layers.0.ffn.gate.weight"].astype(np.int8)}),
     "tensor 'layers.0.ffn.gate.weight' has dtype I8"),
    (lambda t: t.update({"layers.0.attn.wq_a.scale": t["layers.0.attn.wq_a.scale"].view(np.uint8)}),
     "tensor 'layers.0.attn.wq_a.scale' has dtype U8"),
    (lambda t: t.update(fp8_experts(t, experts=[2])),
     r"tensor 'layers.1.ffn.experts.2.w(\d).weight' is fp8, but 'layers.1.ffn.experts.0.w\1.weight' of the same "
     "stacked parameter is fp4"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"] + 3}),
     r"tensor 'layers.0.ffn.gate.tid2eid' routes to experts 3...6, outside 0..3"),
])
def test_bad_tensors_are_refused_by_name(released, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        load_v4(variant(released, tmp_path, change))


def fp8_experts(tensors, experts=range(4), layers=(1, 2)):
    """Routed experts of `layers` in FP8 with float32 block scales, as the base releases ship them."""
    out = {}
    for e, layer in itertools.product(experts, layers):
        for w in ("w1", "w2", "w3"):
            name = f"layers.{layer}.ffn.experts.{e}.{w}"
            dense = ref_fp4_decode(tensors[name + ".weight"], tensors[name + ".scale"])
            value, scale = ref_fp8_encode(dense)
            out[name + ".weight"], out[name + ".scale"] = value, SCALES[scale.view(np.uint8)]
    return out


def test_fp8_experts_with_float32_scales_load_as_fp8(released, tmp_path):
    tensors = fp8_experts(released[1])
    model = load_v4(variant(released, tmp_path, lambda t: t.update(tensors)))
    up = unstack_layers(CONFIG, model.params)["layers_2"]["mlp"]["experts"]["up_proj"]
    assert isinstance(up, QuantizedWeight) and not is_fp4(up) and up.block == (128, 128)
    want = ref_fp8_decode(tensors["layers.2.ffn.experts.3.w3.weight"],
                          float32_to_e8m0(tensors["layers.2.ffn.experts.3.w3.scale"]))
    assert np.array_equal(np.asarray(up.dequantize()[3]), want)
    # layers 1 and 2 are stacked: one in FP8 and the other in FP4 is refused, naming the tensor
    mixed = variant(released, tmp_path / "mixed", lambda t: t.update(fp8_experts(released[1], layers=(2,))))
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.0\.w\d\.weight' is fp8, but layer 1's is fp4"):
        load_v4(mixed)


@pytest.mark.parametrize("change", [
    lambda t: t.update({"mtp.1.attn.wq_a.weight": t["mtp.0.attn.wq_a.weight"],
                        "mtp.2.markov_head.markov_w1.weight": np.zeros((8, 4), np.float32)}),
    lambda t: [t.pop(n) for n in ("mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.h_proj.weight",
                                  "mtp.0.h_proj.scale")] and t.update({"mtp.0.main_proj.weight": t["embed.weight"]}),
])
def test_a_dspark_drafter_in_mtp_loads_the_main_model_and_says_why(released, loaded, tmp_path, change):
    model = load_v4(variant(released, tmp_path, change), keep_quantized=False)
    note = model.mtp_note
    assert "DSpark" in note and model.config.num_nextn_predict_layers == 0 and "mtp" not in model.params
    assert_same_params(model.params, {k: v for k, v in loaded[1].params.items() if k != "mtp"})
    with pytest.raises(InputError, match="no MTP block to draft with.*DSpark"):
        generate(model, [[1, 2, 3]], 2, k=1)


def test_deepseek_v41_is_refused_by_name(released, tmp_path):
    with pytest.raises(ConfigError, match="deepseek_v41"):
        load_v4(variant(released, tmp_path, lambda t: None, dict(CONFIG.to_hf_config(), model_type="deepseek_v41")))


def test_generate_cli_decodes_a_v4_checkpoint(loaded, tmp_path, capsys):
    """`jaxmtp generate --model` of a V4 checkpoint prints the tokens that speculative.generate gives
    (it prints them from speculative.stream, round by round)."""
    from jaxmtp.cli import main

    kept, _ = loaded
    save_v4(kept, tmp_path / "v4")
    main(["generate", "--model", str(tmp_path / "v4"), "--tokens", "5,6,7,8,9", "--k", "2", "--max-new-tokens", "6",
          "--ignore-eos", "--quiet"])
    printed = capsys.readouterr().out.split("\n")[0]
    want = generate(load_v4(tmp_path / "v4"), [[5, 6, 7, 8, 9]], 6, 2).tokens[0]
    assert printed == "[5, 6, 7, 8, 9] ->" + "".join(f" {t}" for t in want)
    # --stop-tokens ends the completion after the sequence's last token
    main(["generate", "--model", str(tmp_path / "v4"), "--tokens", "5,6,7,8,9", "--k", "2", "--max-new-tokens", "6",
          "--ignore-eos", "--quiet", "--stop-tokens", ",".join(map(str, want[2:4]))])
    printed = capsys.readouterr().out.split("\n")[0]
    assert printed == "[5, 6, 7, 8, 9] ->" + "".join(f" {t}" for t in want[:4])


def test_convert_cli_between_the_released_layout_and_transformers(released, loaded, tmp_path, capsys):
    from jaxmtp.cli import main

    directory, _ = released
    main(["convert", str(directory), str(tmp_path / "hf"), "--format", "hf", "--dtype", "float32",
          "--quantized", "dequantize"])
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--format", "deepseek", "--dtype", "float32"])
    assert_same_params(load_v4(tmp_path / "back").params, loaded[1].params)


def test_kept_weights_load_onto_a_mesh_and_decode_as_on_one_device(released, loaded):
    """FP8 and FP4 weights placed on a data=2, expert=2, tensor=2 mesh, each device its slice of the
    values and their scales: speculative tokens equal one device's plain greedy tokens (its programs
    are those of the test above: the rows padded to one chunk of 19, a cache of 19 positions)."""
    directory, _ = released
    sharded = load_v4(directory, mesh=make_mesh(data=2, expert=2, tensor=2))
    experts = unstack_layers(CONFIG, sharded.params)["layers_1"]["mlp"]["experts"]["gate_proj"]
    assert is_fp4(experts) and experts.value.sharding.shard_shape(experts.value.shape)[0] == 1
    prompts = [list(TOKENS[0, :11]), list(TOKENS[1, :6])]
    assert generate(sharded, prompts, 8, 2).tokens == loaded[0].greedy(prompts, 8, chunk=19)


def _held(tree, device) -> int:
    """Bytes of `tree`'s arrays on `device` (their shards there), e2m1 values packed two to a byte as
    XLA stores them."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = next(s.data for s in leaf.addressable_shards if s.device == device)
        total += -(-shard.size * jax.dtypes.itemsize_bits(shard.dtype) // 8)
    return total


def _uncompiled(program, name, args, static):
    """The V4 planner's compile step, skipped: a program holding nothing (the byte accounting that
    does not depend on XLA stays the planner's own)."""
    return {"program": name, "xla_argument_bytes": 0, "xla_output_bytes": 0, "xla_temp_bytes": 0,
            "largest_temporaries": [], "compile_seconds": 0.0}


def test_plan_counts_what_a_loaded_model_and_its_caches_hold_on_each_device(released, tmp_path, capsys,
                                                                            monkeypatch):
    """`jaxmtp plan` of a V4 config (abstract, kept FP8 and FP4 weights): its per-device parameter and
    cache bytes equal what a real load onto the mesh and real caches hold on a device; the CLI routes
    a V4 config to this planner. (Its programs are compiled in the test below.)"""
    from jaxmtp.cli import main
    from jaxmtp.models.deepseek_v4 import plan as v4plan
    from jaxmtp.plan import default_loops

    mesh = make_mesh(data=2, expert=2, tensor=2)
    model = load_v4(released[0], dtype="bfloat16", mesh=mesh)
    monkeypatch.setattr(v4plan, "_compile", _uncompiled)
    (figures,) = v4plan.plans(CONFIG, 2, 2, 2, batch=4, max_len=64, prompt_len=64,
                              loops=default_loops(CONFIG, 2, "auto"), prefill_chunk=16)
    device = mesh.devices.flat[0]
    assert figures["parameter_bytes_per_device"] == _held(model.params, device)
    caches = (model.new_caches(4, 64, headroom=4), model.new_mtp_cache(4, 64, headroom=4))
    assert figures["cache_bytes_per_device"] == _held(caches, device)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG.to_hf_config()))
    main(["plan", "--config", str(path), "--mesh", "data=2,expert=2,tensor=2", "--batch", "4", "--max-len", "64",
          "--prefill-chunk", "16", "--loop", "auto"])
    out = capsys.readouterr().out
    assert "auto (k = 0..3 per round), sampling with top-k and top-p" in out and "largest temporaries" in out
    assert "caches per device (main + MTP)" in out and "H200 (141 GB)" in out
    assert f"parameters per device (largest):     {figures['parameter_bytes_per_device'] / 1e9:8.2f} GB" in out


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="compiles a V4 prefill chunk and round for 8 "
                    "devices, about 20 CPU-seconds; set JAXMTP_LONG_TESTS=1 to run it")
def test_plan_compiles_the_prefill_chunk_and_the_round_for_a_mesh():
    """The compiled programs' arguments hold at least the parameters and caches the plan counts, and
    the figures are those of the larger program."""
    from jaxmtp.models.deepseek_v4 import plan as v4plan
    from jaxmtp.plan import default_loops, total_bytes

    (figures,) = v4plan.plans(CONFIG, 2, 2, 2, batch=4, max_len=64, prompt_len=64,
                              loops=default_loops(CONFIG, 2, "auto"), prefill_chunk=16)
    held = figures["parameter_bytes_per_device"] + figures["cache_bytes_per_device"]
    assert held <= figures["xla_argument_bytes"] and set(figures["programs"]) == {"prefill_chunk", "run_round"}
    assert max(figures["programs"].values()) == total_bytes(figures)
    largest = [t["bytes"] for t in figures["largest_temporaries"]]
    assert largest == sorted(largest, reverse=True) and 0 < largest[0] <= figures["xla_temp_bytes"]
