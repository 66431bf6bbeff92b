"""Rotary position embedding with DeepSeek's YaRN frequency correction.

Frequencies are static (computed once in numpy from the config); the rotation is applied to
interleaved pairs (x[2i], x[2i+1]) when `rope_interleave` is set (DeepSeek's layout), else to
NeoX halves (x[i], x[i + d/2]).
"""

import math

import jax.numpy as jnp
import numpy as np

from jaxmtp.config import ModelConfig, yarn_mscale


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair angular frequencies, float32 [qk_rope_head_dim // 2] (see pair_frequencies)."""
    return pair_frequencies(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)


def pair_frequencies(dim: int, base: float, rs) -> np.ndarray:
    """Angular frequencies of `dim // 2` rotated pairs at `base`, float32, with YaRN `rs` or None.

    With YaRN, pairs below the `low` correction dimension keep their frequency, pairs above
    `high` are divided by `factor`, and a linear ramp blends the two in between.
    """
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rs is None:
        return freqs.astype(np.float32)
    low, high = _correction_range(rs.beta_fast, rs.beta_slow, dim, base, rs.original_max_position_embeddings,
                                  rs.truncate)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return (freqs * (1.0 - ramp) + freqs / rs.factor * ramp).astype(np.float32)


def attention_factor(config: ModelConfig) -> float:
    """YaRN's multiplier on cos/sin: 1.0 for DeepSeek-V3, where mscale == mscale_all_dim."""
    rs = config.rope_scaling
    if rs is None:
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def _correction_range(beta_fast, beta_slow, dim, base, original_len, truncate):
    def corr_dim(rotations):
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, config: ModelConfig,
               interleave: bool | None = None) -> jnp.ndarray:
    """Rotates the last dim of x by its positions.

    Args:
      x: [B, T, ..., R] with R = qk_rope_head_dim (any number of head dims after T).
      positions: [B, T] absolute 0-based token positions.
      interleave: pairs (x[2i], x[2i+1]) or halves (x[i], x[i + R/2]); default config.rope_interleave
        (the lightning indexer always rotates halves).
    Returns:
      x rotated, same shape and dtype, same pair layout.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(config))  # [B,T,R/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    scale = attention_factor(config)
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    half = x.shape[-1] // 2
    if config.rope_interleave if interleave is None else interleave:
        pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.astype(x.dtype)
