"""The DeepSeek-V4 module: embedding, the residual widened to hc_mult streams, decoder layers of
the config's attention and routing kinds, the final collapse of the streams, norm and head."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.layers import Dtype, Embed, Linear, RMSNorm
from jaxmtp.models.deepseek_v4.attention import Attention, LayerCache, layer_cache
from jaxmtp.models.deepseek_v4.blocks import HyperConnection, HyperHead, MoE, expand, is_hashed
from jaxmtp.models.deepseek_v4.config import SLIDING, V4Config


class DecoderLayer(nn.Module):
    """Attention then MoE, each between a hyper-connection's collapse and expansion of the streams.
    (streams [B, T, N, D], tokens [B, T], positions [B, T], start [B], count [B], cache)
    -> (streams, cache)."""

    config: V4Config
    layer_type: str
    hashed: bool
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = Attention(c, self.layer_type, self.dtype)
        self.mlp = MoE(c, self.hashed, self.dtype)

    def __call__(self, streams, tokens, positions, start, count, cache: LayerCache):
        with jax.named_scope("attention"):
            x, post, comb = self.attn_hc(streams)
            out, cache = self.self_attn(self.input_layernorm(x), positions, start, count, cache)
            streams = expand(streams, out, post, comb)
        with jax.named_scope("moe"):
            x, post, comb = self.ffn_hc(streams)
            out = self.mlp(self.post_attention_layernorm(x), tokens)
            return expand(streams, out, post, comb), cache


class MTPBlock(nn.Module):
    """DeepSeek's V4 MTP block: a sliding-window, top-k routed decoder layer over
    e_proj(enorm(embedding of the next token)) added to h_proj(hnorm(streams)) of each stream, with
    its own final collapse of the streams and norm (the embedding and head are the main model's).
    (streams [B, T, N, D], next-token embeddings [B, T, D], tokens, positions, start, count, cache)
    -> (post-norm hidden [B, T, D], its streams [B, T, N, D], cache)."""

    config: V4Config
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        D, std = c.hidden_size, c.initializer_range
        self.enorm = RMSNorm(D, c.rms_norm_eps, self.dtype)
        self.hnorm = RMSNorm(D, c.rms_norm_eps, self.dtype)
        self.e_proj = Linear(D, D, ("embed", "embed_in"), self.dtype, std)
        self.h_proj = Linear(D, D, ("embed", "embed_in"), self.dtype, std)
        self.block = DecoderLayer(c, SLIDING, False, self.dtype)
        self.hc_head = HyperHead(c)
        self.norm = RMSNorm(D, c.rms_norm_eps, self.dtype)

    def __call__(self, streams, embedded, tokens, positions, start, count, cache: LayerCache):
        x = self.e_proj(self.enorm(embedded))[:, :, None, :] + self.h_proj(self.hnorm(streams))
        x, cache = self.block(x, tokens, positions, start, count, cache)
        return self.norm(self.hc_head(x)), x, cache


class DeepseekV4(nn.Module):
    """The main model and its MTP block (`num_nextn_predict_layers` 1). Caches: a tuple with one
    LayerCache per layer (`new_caches`); the MTP block's is a LayerCache of a sliding layer."""

    config: V4Config
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.dtype, c.initializer_range)
        self.layers = [DecoderLayer(c, c.layer_types[i], is_hashed(c, i), self.dtype)
                       for i in range(c.num_hidden_layers)]
        self.hc_head = HyperHead(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, ("vocab", "embed"), self.dtype, c.initializer_range)
        if c.has_mtp:
            self.mtp = MTPBlock(c, self.dtype)

    def __call__(self, tokens, start, count, caches: tuple):
        """tokens [B, T] at positions start[b] + t, the first count[b] of each row real ->
        (logits [B, T, V] float32, post-norm hidden [B, T, D], the last layer's streams
        [B, T, N, D] (what the MTP layer reads), caches)."""
        c = self.config
        positions = start[:, None] + jnp.arange(tokens.shape[1])[None]
        x = self.embed_tokens(tokens)
        streams = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (c.hc_mult, c.hidden_size))
        new_caches = []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                streams, cache = layer(streams, tokens, positions, start, count, caches[i])
            new_caches.append(cache)
        hidden = self.norm(self.hc_head(streams))
        return self.logits(hidden), hidden, streams, tuple(new_caches)

    def mtp_step(self, streams, next_tokens, start, count, cache: LayerCache):
        """The MTP block at positions start[b] + t: slot t combines the streams of position t with
        the token after it, next_tokens[:, t], and predicts the token after that.
        streams [B, T, N, D] (the main model's last layer, or the block's own output when drafting
        further), next_tokens [B, T] -> (logits [B, T, V] float32, its streams [B, T, N, D], cache)."""
        positions = start[:, None] + jnp.arange(next_tokens.shape[1])[None]
        with jax.named_scope("mtp"):
            hidden, streams, cache = self.mtp(streams, self.embed_tokens(next_tokens), next_tokens, positions, start,
                                              count, cache)
        return self.logits(hidden), streams, cache

    def init_all(self, tokens, start, count, caches, mtp_cache):
        """Touches every submodule so that `init` creates all parameters."""
        logits, _, streams, _ = self(tokens, start, count, caches)
        if self.config.has_mtp:
            self.mtp_step(streams, tokens, start, count, mtp_cache)
        return logits

    def logits(self, hidden):
        """hidden [B, T, D] -> float32 logits [B, T, V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden, out_dtype=jnp.float32)


def new_caches(config: V4Config, batch: int, max_len: int, headroom: int = 1, dtype=jnp.float32) -> tuple:
    """Empty caches of every layer for positions below max_len; `headroom`: the most positions a row
    may run past the length it is later rolled back to (k + 1 for drafts of k)."""
    return tuple(layer_cache(config, kind, batch, max_len, headroom, dtype) for kind in config.layer_types)


def new_mtp_cache(config: V4Config, batch: int, max_len: int, headroom: int = 1, dtype=jnp.float32) -> LayerCache:
    """An empty cache of the MTP block (a sliding-window layer)."""
    return layer_cache(config, SLIDING, batch, max_len, headroom, dtype)
