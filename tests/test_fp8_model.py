"""matmul="fp8" (W8A8 Pallas kernels, interpret mode) on an FP8 checkpoint of the trained demo
model, against the same checkpoint dequantized to float32.

The checkpoint's weights are quantized in numpy (per 128x128 block, scale = amax / 448), so both paths multiply the
very same weights; they differ only by the per-token 1x128 e4m3 quantization of the activations,
whose rounding (3 mantissa bits) already moves one linear layer's output by about 2.5% (relative
Frobenius norm) on this model. It generates in the layout of a real FP8 checkpoint, its layers scanned.
"""

import os

import numpy as np
import pytest
from tokenizers import Tokenizer

import hf_reference as ref
import jaxmtp
from jaxmtp import data, layout
from jaxmtp.config import QuantizationConfig
from jaxmtp.quant import QuantizedWeight, is_quantized_param

PROMPTS, NEW_TOKENS = 16, 16


def _quantized(tree, prefix=()):
    """Every projection weight -> QuantizedWeight of numpy 128x128 block quantization."""
    out = {}
    for key, leaf in tree.items():
        path = prefix + (key,)
        if isinstance(leaf, dict):
            out[key] = _quantized(leaf, path)
        elif is_quantized_param(path):
            w = np.asarray(leaf)
            pairs = [ref.quantize_blocks(m) for m in w.reshape((-1,) + w.shape[-2:])]
            value = np.stack([v for v, _ in pairs]).reshape(w.shape)
            scale = np.stack([s for _, s in pairs]).reshape(w.shape[:-2] + pairs[0][1].shape)
            out[key] = QuantizedWeight(value, scale)
        else:
            out[key] = leaf
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The FP8 demo generates in the checkpoint layout, its layers scanned (jaxmtp.layout.CHECKPOINT), as a
    real FP8 checkpoint does (over MAX_UNROLLED_BYTES): the path a user's DeepSeek-V3 takes, and one copy of
    each interpret-mode kernel per program where the unrolled layout compiles one per layer (a small FP8
    checkpoint's unrolled layers generate in tests/test_ue8m0.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "MAX_UNROLLED_BYTES", 0)
        yield _models(tmp_path_factory)


def _models(tmp_path_factory):
    demo = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    path = tmp_path_factory.mktemp("fp8_demo")
    config = demo.config.replace(quantization=QuantizationConfig())
    jaxmtp.save(jaxmtp.Model(config, _quantized(demo.params)), path)
    fp8 = jaxmtp.load(path, quantized="keep", matmul="fp8", quiet=True)
    dense = jaxmtp.load(path, dtype="float32", quantized="dequantize", quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    return fp8, dense, data.held_out_prompts(tokenizer, count=PROMPTS, length=32)


@pytest.fixture(scope="module")
def plain_fp8_tokens(models):
    """The FP8 model's plain greedy tokens for the prompts (both tests below read them)."""
    fp8, _, prompts = models
    return jaxmtp.generate(fp8, prompts, max_new_tokens=NEW_TOKENS).tokens


def test_fp8_logits_and_greedy_decisions_follow_the_dequantized_model(models, plain_fp8_tokens):
    fp8, dense, prompts = models
    assert fp8.params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"].matmul == "fp8"
    assert fp8.decoding().layout == layout.CHECKPOINT  # generated in (plain_fp8_tokens)
    got, want = (np.asarray(m.forward(np.array(prompts))[0]) for m in (fp8, dense))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03
    # Greedy decisions: along the FP8 model's own 16 x 16 generated tokens, the float32 model
    # picks the same next token almost everywhere (free-running sequences drift apart after the
    # first differing token, so they are compared decision by decision).
    generated = plain_fp8_tokens
    assert all(len(g) == NEW_TOKENS for g in generated)
    sequences = np.array([p + g for p, g in zip(prompts, generated)])
    decisions = np.asarray(dense.forward(sequences)[0])[:, 31:-1].argmax(-1)
    assert (decisions == sequences[:, 32:]).mean() >= 0.95


def test_fp8_speculative_greedy_follows_plain_fp8_greedy(models, plain_fp8_tokens):
    """With W8A8 kernels, speculative greedy equals plain greedy in nearly every row, not in all:
    the verify pass computes k + 1 rows where the plain step computes one, and a last-bit
    difference in an activation can move its e4m3 rounding (3 mantissa bits) and so a later
    token (over 32 new tokens a row can part from about its 25th on; over these 16, none has).
    Without activation rounding (float32, tests/test_generate.py) the tokens are equal."""
    fp8, _, prompts = models
    plain = plain_fp8_tokens
    spec = jaxmtp.generate(fp8, prompts, max_new_tokens=NEW_TOKENS, speculative_k=2).tokens
    assert sum(a == b for a, b in zip(spec, plain)) >= len(prompts) - 2
    assert all(a[:8] == b[:8] for a, b in zip(spec, plain))


def test_quantize_follows_the_spec_formula():
    """jaxmtp.quant.quantize (used to make FP8 checkpoints) against the numpy reference, also for
    stacked [layers, experts, out, in] weights with partial blocks."""
    from jaxmtp.quant import quantize

    w = np.random.default_rng(0).normal(size=(2, 3, 200, 136)).astype(np.float32)
    q = quantize(w)
    for index in np.ndindex(2, 3):
        value, scale = ref.quantize_blocks(w[index])
        np.testing.assert_array_equal(np.asarray(q.value[index]).view(np.uint8), value.view(np.uint8))
        np.testing.assert_allclose(q.scale[index], scale, rtol=1e-6)


def test_fp8_kernels_run_expert_parallel_on_a_mesh(models):
    """The grouped FP8 kernel inside the expert-parallel shard_map: same logits as one device."""
    from jaxmtp.sharding import make_mesh, place
    from jaxmtp.params import param_shardings

    fp8, _, prompts = models
    mesh = make_mesh(data=2, expert=4)
    sharded = jaxmtp.Model(fp8.config, place(fp8.params, param_shardings(fp8.config, fp8.params, mesh)), mesh)
    tokens = np.array(prompts[:4])
    want = np.asarray(fp8.forward(tokens)[0])
    np.testing.assert_allclose(np.asarray(sharded.forward(tokens)[0]), want, rtol=0, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("axes", [("heads", "embed"), ("embed", "heads")], ids=["column", "row"])
def test_fp8_linear_runs_per_tensor_shard(axes):
    """On a tensor axis that cuts whole 128-blocks, an FP8 linear runs the kernel per shard:
    column-parallel (out features split) equals one device exactly, row-parallel (in features
    split, partial products summed) up to float32 summation order; no weight is all-gathered."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxmtp.layers import Linear
    from jaxmtp.quant import quantize
    from jaxmtp.sharding import make_mesh, spec

    rng = np.random.default_rng(0)
    out_features, in_features = (512, 256) if axes[0] == "heads" else (256, 512)
    weight = quantize(rng.normal(size=(out_features, in_features))).replace(matmul="fp8")
    x = jnp.asarray(rng.normal(size=(4, 8, in_features)), jnp.float32)
    layer = Linear(in_features, out_features, axes)
    apply = jax.jit(lambda w, x: layer.apply({"params": {"weight": w}}, x))
    want = np.asarray(apply(weight, x))
    mesh = make_mesh(data=2, expert=2, tensor=2)
    cut = NamedSharding(mesh, spec(axes, weight.shape, mesh))
    sharded = weight.replace(value=jax.device_put(weight.value, cut), scale=jax.device_put(weight.scale, cut))
    with jax.set_mesh(mesh):
        got = np.asarray(apply(sharded, x))
        assert "all-gather" not in apply.lower(sharded, x).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
