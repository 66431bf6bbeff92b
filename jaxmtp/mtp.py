"""The Multi-Token-Prediction module: DeepSeek-V3's own draft model."""

import flax.linen as nn
import jax.numpy as jnp

from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.decoder import DecoderLayer
from jaxmtp.layers import Dtype, Linear, RMSNorm
from jaxmtp.layout import CHECKPOINT, Layout


class MTPBlock(nn.Module):
    """One Multi-Token-Prediction module (checkpoint layer index = num_hidden_layers).

    Position p combines hnorm(h_p) with enorm(Emb(t_{p+1})), embedding first, through eh_proj and
    one full MoE decoder layer with its own cache; the output after shared_head.norm is both the
    input to the shared head and the hidden state recycled for the next draft step.
    """

    config: ModelConfig
    dtype: Dtype = jnp.float32
    absorbed: bool = False
    layout: Layout = CHECKPOINT

    @nn.compact
    def __call__(self, hidden, next_embeds, positions, cache: MLACache | None = None):
        """hidden, next_embeds [B, T, D]; positions [B, T] -> (post-norm hidden [B, T, D], cache)."""
        c, D = self.config, self.config.hidden_size
        e = RMSNorm(D, c.rms_norm_eps, self.dtype, name="enorm")(next_embeds)
        h = RMSNorm(D, c.rms_norm_eps, self.dtype, name="hnorm")(hidden)
        x = Linear(2 * D, D, ("embed", "embed_pair"), self.dtype, c.initializer_range, self.layout, name="eh_proj")(
            jnp.concatenate([e, h], axis=-1))
        x, cache = DecoderLayer(c, self.dtype, moe=True, absorbed=self.absorbed, layout=self.layout, name="block")(x, positions, cache)
        return RMSNorm(D, c.rms_norm_eps, self.dtype, name="shared_head_norm")(x), cache
