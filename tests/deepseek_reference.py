"""numpy references written from DeepSeek's own inference code (DeepSeek-V3.2-Exp `inference/`):
its activation quantization and its lightning indexer's FP8 scoring."""

import ml_dtypes
import numpy as np


def numpy_ue8m0_act_quant(x):
    """Written from DeepSeek's kernel: per 128 channels amax (at least 1e-4) times the float32
    1 / 448; the scale is 2 ** (its exponent + 1 if any mantissa bit is set); values x / scale
    clamped to +-448, cast to e4m3."""
    k = x.shape[-1]
    blocks = -(-k // 128)
    padded = np.zeros(x.shape[:-1] + (blocks * 128,), np.float32)
    padded[..., :k] = x
    g = padded.reshape(x.shape[:-1] + (blocks, 128))
    t = np.maximum(np.abs(g).max(-1), np.float32(1e-4)).astype(np.float32) * np.float32(1 / 448)
    bits = t.astype(np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
    scale = np.ldexp(np.float32(1), exponent).astype(np.float32)
    q = np.clip(g / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(padded.shape)[..., :k], scale


def sylvester_hadamard(n: int) -> np.ndarray:
    """H_n by the Sylvester construction (entries +-1), H_2n = [[H, H], [H, -H]]."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.kron(np.array([[1, 1], [1, -1]]), h)
    return h


def rotate_halves(v, positions, theta):
    """RoPE with default frequencies theta^(-2i/R) on halves (v[i], v[i + R/2]) of v [B, T, ..., R]."""
    r = v.shape[-1]
    angles = positions[..., None].astype(np.float64) * theta ** (-np.arange(0, r, 2) / r)  # [B, T, R/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (v.ndim - 3) + angles.shape[-1:])
    a, b = v[..., :r // 2], v[..., r // 2:]
    return np.concatenate([a * np.cos(angles) - b * np.sin(angles), b * np.cos(angles) + a * np.sin(angles)], axis=-1)


def fp8_index_scores(x, q_resid, positions, weights, heads, head_dim, rope_dim, theta):
    """DeepSeek's Indexer.forward with its fp8_index kernel, for rows that start at position 0:
    q = wq_b(q_resid), k = k_norm(wk(x)), RoPE on the first rope_dim dims, both rotated by
    hadamard_transform(scale=head_dim^-0.5), act_quant with ue8m0 scales (one per 128 values),
    then score[t, s] = sum_h relu(q8[t, h] . k8[s]) x (weights_proj(x) x heads^-0.5 x q_scale x
    head_dim^-0.5)[t, h] x k_scale[s], -inf past each query's position. weights: dense float
    wq_b [H*D, Q], wk [D, hidden], k_norm (weight, bias), weights_proj [H, hidden]."""
    b, t, _ = x.shape
    q = (q_resid @ weights["wq_b"].T).reshape(b, t, heads, head_dim)
    k = x @ weights["wk"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * weights["k_norm_weight"] + weights["k_norm_bias"]
    q = np.concatenate([rotate_halves(q[..., :rope_dim], positions, theta), q[..., rope_dim:]], axis=-1)
    k = np.concatenate([rotate_halves(k[..., :rope_dim], positions, theta), k[..., rope_dim:]], axis=-1)
    h = sylvester_hadamard(head_dim) * head_dim ** -0.5
    q8, q_scale = numpy_ue8m0_act_quant((q @ h).astype(np.float32))
    k8, k_scale = numpy_ue8m0_act_quant((k @ h).astype(np.float32))
    w = (x @ weights["weights_proj"].T) * heads ** -0.5 * q_scale[..., 0] * head_dim ** -0.5  # [B, T, H]
    dots = np.einsum("bthd,bsd->bths", q8.astype(np.float64), k8.astype(np.float64))
    scores = np.einsum("bths,bth->bts", np.maximum(dots, 0), w) * k_scale[:, None, :, 0]
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    return np.where(causal[None], scores, -np.inf)
