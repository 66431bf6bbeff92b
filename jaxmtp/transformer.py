"""The top-level DeepSeek-V3 module: embedding, dense and MoE layer stacks, final norm, head, MTP."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.decoder import LayerStack
from jaxmtp.layers import Dtype, Embed, Linear, RMSNorm
from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.mtp import MTPBlock


class DeepseekV3(nn.Module):
    """Main model and MTP module sharing one embedding and one output head.

    Caches are a dict {"dense": MLACache, "moe": MLACache} for the main stacks (either may be
    absent when its stack is empty; per-layer tuples of MLACaches in an unrolled layout) and one
    MLACache for the MTP layer. `layout` (jaxmtp.layout) says how the parameters are arranged.
    """

    config: ModelConfig
    dtype: Dtype = jnp.float32
    absorbed: bool = False
    layout: Layout = CHECKPOINT

    def setup(self):
        c, layout = self.config, self.layout
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.dtype, c.initializer_range)
        if c.num_dense_layers:
            self.dense_layers = LayerStack(c, c.num_dense_layers, self.dtype, False, self.absorbed, layout)
        if c.num_moe_layers:
            self.moe_layers = LayerStack(c, c.num_moe_layers, self.dtype, True, self.absorbed, layout)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, ("vocab", "embed"), self.dtype, c.initializer_range,
                                  layout)
        if c.has_mtp:
            self.mtp = MTPBlock(c, self.dtype, self.absorbed, layout)

    def __call__(self, tokens, positions, caches: dict | None = None):
        """tokens, positions [B, T] -> (logits [B, T, V] f32, post-norm hidden [B, T, D], caches)."""
        hidden, caches = self.hidden_states(tokens, positions, caches)
        return self.logits(hidden), hidden, caches

    def hidden_states(self, tokens, positions, caches: dict | None = None):
        """The main model without its head: -> (post-norm hidden [B, T, D], caches)."""
        x = self.embed_tokens(tokens)
        new_caches = {}
        for group in ("dense", "moe"):
            if hasattr(self, f"{group}_layers"):
                stack = getattr(self, f"{group}_layers")
                with jax.named_scope(f"{group}_layers"):
                    x, new_caches[group] = stack(x, positions, None if caches is None else caches[group])
        return self.norm(x), (None if caches is None else new_caches)

    def logits(self, hidden):
        """Shared output head. hidden [B, T, D] -> float32 logits [B, T, V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden, out_dtype=jnp.float32)

    def mtp_step(self, hidden, next_tokens, positions, cache: MLACache | None = None):
        """One MTP pass. hidden [B, T, D] (main post-norm or recycled MTP output), next_tokens [B, T]
        (t_{p+1} at slot p), positions [B, T] -> (logits [B, T, V] predicting t_{p+2}, MTP hidden, cache)."""
        z, cache = self.mtp_hidden(hidden, next_tokens, positions, cache)
        return self.logits(z), z, cache

    def mtp_hidden(self, hidden, next_tokens, positions, cache: MLACache | None = None):
        """The MTP module without the head: -> (post shared_head.norm hidden [B, T, D], cache)."""
        with jax.named_scope("mtp"):
            return self.mtp(hidden, self.embed_tokens(next_tokens), positions, cache)

    def init_all(self, tokens, positions):
        """Touches every submodule so `init` creates all parameters."""
        logits, hidden, _ = self(tokens, positions)
        if self.config.has_mtp:
            self.mtp_step(hidden, tokens, positions)
        return logits
