"""DeepSeek-V3's YaRN frequencies and softmax scale against numbers worked by hand from the YaRN formulas
(factor 40, a linear ramp between frequency indices 10 and 23)."""

import numpy as np
import pytest

import jaxmtp
from jaxmtp.rope import attention_factor, inverse_frequencies

V3 = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json")


def test_v3_softmax_scale():
    assert V3.softmax_scale == pytest.approx(0.1352337789, abs=1e-10)


def test_v3_yarn_ramp():
    base = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    ratio = base / inverse_frequencies(V3).astype(np.float64)
    np.testing.assert_allclose(ratio[:11], 1.0, rtol=1e-6)  # i <= low = 10: unchanged
    np.testing.assert_allclose(ratio[23:], 40.0, rtol=1e-6)  # i >= high = 23: divided by factor
    assert ratio[16] == pytest.approx(1 / (1 - 6 / 13 + 6 / 13 / 40), rel=1e-6)  # ramp 6/13: 1.818
    assert ratio[16] == pytest.approx(1.818, abs=1e-3)
    assert ratio[22] == pytest.approx(10.0, rel=1e-5)
    assert attention_factor(V3) == 1.0  # mscale == mscale_all_dim: cos/sin unscaled


def test_rope_rotates_interleaved_pairs():
    """Rotating a unit vector in pair i by position t gives angle t * freq_i within that pair only."""
    import jax.numpy as jnp

    from jaxmtp.rope import apply_rope

    cfg = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")
    dim = cfg.qk_rope_head_dim
    x = np.zeros((1, 1, dim), np.float32)
    x[..., 2] = 1.0  # pair 1, first component
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray([[7]]), cfg))[0, 0]
    angle = 7 * inverse_frequencies(cfg)[1]
    expected = np.zeros(dim)
    expected[2], expected[3] = np.cos(angle), np.sin(angle)
    np.testing.assert_allclose(out, expected, atol=1e-6)
