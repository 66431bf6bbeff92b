"""Compressed MLA KV cache: per token per layer the normed latent c_kv and the rotated k_pe (and
with DeepSeek Sparse Attention the lightning indexer's key index_k).

That is kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek-V3; 704 with DeepSeek-V3.2's
index key) instead of the expanded heads x (qk_head_dim + v_head_dim). Entries are addressed by
absolute position, so rolling back a row is just moving its position: stale entries beyond it are
masked out and later overwritten.
"""

import flax.struct
import jax
import jax.numpy as jnp

from jaxmtp.config import ModelConfig


@flax.struct.dataclass
class MLACache:
    """c_kv: [..., B, S, kv_lora_rank]; k_pe: [..., B, S, qk_rope_head_dim]; index_k: [..., B, S,
    index_head_dim] or None (leading dim = layers when stacked)."""

    c_kv: jax.Array
    k_pe: jax.Array
    index_k: jax.Array | None = None

    @classmethod
    def zeros(cls, config: ModelConfig, num_layers: int | None, batch: int, max_len: int,
              dtype=jnp.float32) -> "MLACache":
        """An empty cache; num_layers=None gives a single layer's cache without the stacking axis."""
        shape = (() if num_layers is None else (num_layers,)) + (batch, max_len)
        return cls(c_kv=jnp.zeros(shape + (config.kv_lora_rank,), dtype),
                   k_pe=jnp.zeros(shape + (config.qk_rope_head_dim,), dtype),
                   index_k=jnp.zeros(shape + (config.index_head_dim,), dtype) if config.has_indexer else None)

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[-2]

    def write(self, positions: jax.Array, c_kv: jax.Array, k_pe: jax.Array,
              index_k: jax.Array | None = None) -> "MLACache":
        """Stores one layer's new entries at their positions.

        Args:
          positions: [B, T] absolute positions, consecutive in each row (p, p+1, .., p+T-1) with
            p + T <= max_len (generation sizes its caches so).
          c_kv: [B, T, C]; k_pe: [B, T, R]; index_k: [B, T, Di] where the cache holds index keys.

        A scatter promised in bounds, to unique indices, so that XLA updates the cache in place (the
        bounds-checked form, "drop", makes it copy the whole cache on every step). One row (batch 1)
        is one dynamic_update_slice at its first position, because XLA CPU turns a one-token scatter
        into a slice update guarded by a bounds check, more kernels per layer (tools/step_profile.py).
        """
        rows = jnp.arange(positions.shape[0])[:, None]

        def put(cache, new):
            new = new.astype(cache.dtype)
            if positions.shape[0] == 1:
                return jax.lax.dynamic_update_slice_in_dim(cache, new, positions[0, 0], axis=-2)
            return cache.at[rows, positions].set(new, mode="promise_in_bounds", unique_indices=True,
                                                 indices_are_sorted=True)

        return MLACache(c_kv=put(self.c_kv, c_kv), k_pe=put(self.k_pe, k_pe),
                        index_k=None if self.index_k is None else put(self.index_k, index_k))


def bytes_per_token(config: ModelConfig, dtype=jnp.bfloat16) -> int:
    """Cache bytes per token per layer: (kv_lora_rank + qk_rope_head_dim [+ index_head_dim]) x
    dtype size."""
    return config.cached_per_token * jnp.dtype(dtype).itemsize
