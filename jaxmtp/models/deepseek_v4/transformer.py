"""The DeepSeek-V4 module: embedding, the residual widened to hc_mult streams, decoder layers of
the config's attention and routing kinds, the final collapse of the streams, norm and head.

The layers are kept in segments (`segments`): runs of a repeated unit of one or two layer kinds
(V4-Flash: 2 sliding hash layers, 1 CSA hash layer, then 20 pairs of an HCA and a CSA layer), each
unit's parameters and caches stacked on a leading axis, and a segment's repeats run in a loop. In
a loop only one unit's converted weights are live at a time (dequantized FP4 experts, a backend's
widening of bf16), where unrolled layers let XLA hold every layer's copies at once
(jaxmtp.models.deepseek_v4.plan lists the largest temporaries). Checkpoints name layers one by one;
`stack_layers` and `unstack_layers` map between the two at load and save.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers first .. first + len(kinds) * repeats - 1: a unit of layers of the kinds `kinds`
    ((layer_type, hash routed) each), repeated."""

    first: int
    kinds: tuple[tuple[str, bool], ...]
    repeats: int

    @property
    def layers(self) -> range:
        return range(self.first, self.first + len(self.kinds) * self.repeats)


def segments(config: V4Config) -> tuple[Segment, ...]:
    """The layers in order, as runs of a repeated unit of one or two layers: at each layer, the unit
    whose repeats cover the most layers (one layer where neither repeats)."""
    kinds = [(kind, is_hashed(config, i)) for i, kind in enumerate(config.layer_types)]
    out, i = [], 0
    while i < len(kinds):
        best = Segment(i, (kinds[i],), 1)
        for size in (1, 2):
            unit = tuple(kinds[i:i + size])
            repeats = 1
            while tuple(kinds[i + repeats * size:i + (repeats + 1) * size]) == unit:
                repeats += 1
            if repeats > 1 and repeats * size > len(best.layers):
                best = Segment(i, unit, repeats)
        out.append(best)
        i += len(best.layers)
    return tuple(out)


class Unit(nn.Module):
    """One repeat of a segment's unit: its layers in order.
    (streams, (tokens, positions, start, count), caches: a LayerCache per layer) -> (streams, caches)."""

    config: V4Config
    kinds: tuple[tuple[str, bool], ...]
    dtype: Dtype = jnp.float32

    def setup(self):
        self.layers = [DecoderLayer(self.config, kind, hashed, self.dtype) for kind, hashed in self.kinds]

    def __call__(self, streams, shared, caches):
        out = []
        for layer, cache in zip(self.layers, caches):
            streams, cache = layer(streams, *shared, cache)
            out.append(cache)
        return streams, tuple(out)


class DeepseekV4(nn.Module):
    """The main model and its MTP block (`num_nextn_predict_layers` 1). Parameters: `segments_{s}`,
    each `layers_{j}` (the unit's j-th layer) stacked [repeats, ...]. Caches (`new_caches`): a tuple
    over the segments of a tuple over the unit's layers of LayerCaches stacked [repeats, B, ...];
    the MTP block's is a LayerCache of a sliding layer."""

    config: V4Config
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.dtype, c.initializer_range)
        self.segments = [nn.scan(Unit, variable_axes={"params": 0}, split_rngs={"params": True},
                                 in_axes=(nn.broadcast, 0), length=segment.repeats,
                                 metadata_params={nn.PARTITION_NAME: "layers"})(c, segment.kinds, self.dtype)
                         for segment in segments(c)]
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
        shared = (tokens, positions, start, count)
        new_caches = []
        for s, (segment, module) in enumerate(zip(segments(c), self.segments)):
            with jax.named_scope(f"layers_{segment.first}_{segment.layers[-1]}"):
                if self.is_initializing():
                    streams, cache = module(streams, shared, caches[s])
                else:
                    streams, cache = _segment(c, segment, self.dtype, self.variables["params"][f"segments_{s}"],
                                              streams, shared, caches[s])
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


@functools.cache
def _layer_call(config: V4Config, layer_type: str, hashed: bool, dtype):
    """(params, streams, tokens, positions, start, count, cache) -> (streams, cache): a DecoderLayer
    of one kind under jax.jit, shared by the layers of that kind, so that a program traces and
    lowers each kind once rather than each layer (XLA inlines the calls; the compiled program is the
    same)."""
    layer = DecoderLayer(config, layer_type, hashed, dtype, parent=None)
    return jax.jit(lambda params, *args: layer.apply({"params": params}, *args))


def _segment(config: V4Config, segment: Segment, dtype, params, streams, shared, caches):
    """A segment's layers over the streams: its units in a fori_loop over the stacked parameters and
    caches (each unit's caches written back in place), or directly where it has one repeat.

    The parameters pass through an optimization barrier with the loop index, as the V3 family's
    stacked layers do (jaxmtp.decoder._layer_loop): XLA cannot then hoist a conversion of the whole
    stack out of the loop, and one unit's converted weights are live at a time."""
    calls = [_layer_call(config, kind, hashed, dtype) for kind, hashed in segment.kinds]

    def unit(i, streams, caches, stacked):
        own = jax.tree.map(lambda a: a[i], stacked)
        mine = jax.tree.map(lambda a: a[i], caches)
        out = []
        for j, call in enumerate(calls):
            streams, cache = call(own[f"layers_{j}"], streams, *shared, mine[j])
            out.append(cache)
        caches = jax.tree.map(lambda a, c: jax.lax.dynamic_update_index_in_dim(a, c.astype(a.dtype), i, 0), caches,
                              tuple(out))
        return streams, caches

    if segment.repeats == 1:
        return unit(0, streams, caches, params)

    def body(i, carry):
        stacked, i = jax.lax.optimization_barrier((params, i))
        return unit(i, *carry, stacked)

    return jax.lax.fori_loop(0, segment.repeats, body, (streams, caches))


def stack_layers(config: V4Config, tree: dict) -> dict:
    """A parameter tree with one entry per layer (`layers_{i}`, as checkpoints name them) -> the
    model's (`segments_{s}/layers_{j}` stacked [repeats, ...]); other entries unchanged. Host
    (numpy) leaves stay on the host; abstract ones (jax.ShapeDtypeStruct) stay abstract."""
    out = {key: value for key, value in tree.items() if not key.startswith("layers_")}
    for s, segment in enumerate(segments(config)):
        size = len(segment.kinds)
        out[f"segments_{s}"] = {f"layers_{j}": jax.tree.map(
            _stack, *[tree[f"layers_{segment.first + r * size + j}"] for r in range(segment.repeats)])
            for j in range(size)}
    return out


def _stack(*leaves):
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves),) + tuple(leaves[0].shape), leaves[0].dtype)
    if isinstance(leaves[0], np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def unstack_layers(config: V4Config, tree: dict) -> dict:
    """The model's parameter tree -> one entry per layer (`layers_{i}`), the inverse of
    `stack_layers`. Abstract leaves give abstract ones."""
    out = {key: value for key, value in tree.items() if not key.startswith("segments_")}
    for s, segment in enumerate(segments(config)):
        size = len(segment.kinds)
        for r in range(segment.repeats):
            for j in range(size):
                out[f"layers_{segment.first + r * size + j}"] = jax.tree.map(
                    functools.partial(_index, r), tree[f"segments_{s}"][f"layers_{j}"])
    return out


def _index(r, leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype)
    return leaf[r]


def new_caches(config: V4Config, batch: int, max_len: int, headroom: int = 1, dtype=jnp.float32) -> tuple:
    """Empty caches of every layer for positions below max_len, in the segments' layout (see
    DeepseekV4; the batch is axis 1 of every leaf); `headroom`: the most positions a row may run past
    the length it is later rolled back to (k + 1 for drafts of k)."""
    def stacked(kind, repeats):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (repeats,) + a.shape),
                            layer_cache(config, kind, batch, max_len, headroom, dtype))

    return tuple(tuple(stacked(kind, segment.repeats) for kind, _ in segment.kinds) for segment in segments(config))


def new_mtp_cache(config: V4Config, batch: int, max_len: int, headroom: int = 1, dtype=jnp.float32) -> LayerCache:
    """An empty cache of the MTP block (a sliding-window layer)."""
    return layer_cache(config, SLIDING, batch, max_len, headroom, dtype)
