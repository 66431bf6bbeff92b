"""DeepSeek-V4 attention and its caches, stored by position so that rejecting drafts is a length reset.

Attention is one shared key/value head (K = V) of head_dim, rotated on its trailing qk_rope_head_dim
dims, read by every query head, with a learned per-head sink in the softmax's denominator, a
low-rank query with a weightless per-head norm, and a grouped low-rank output projection. Every
layer attends to the last `sliding_window` positions; compressed layers also attend to entries that
each pool `rate` positions (a softmax-gated sum per channel): compressed sparse attention (CSA,
rate 4, each entry pooling 8 positions, two overlapping series) keeps, per query, the entries a
lightning indexer scores highest; heavily compressed attention (HCA, rate 128) attends to all.

Cache, per layer and row (`LayerCache`):
- the window's K=V rows in a ring of sliding_window + headroom slots, each slot tagged with the
  position it holds;
- per pool (the compressor, and the indexer's in CSA layers): its per-position inputs (the
  projected value and gate) for the last span + headroom positions in a tagged ring, and its
  entries indexed by entry number.
A forward pass over positions start..start+T-1 writes every entry whose last position falls in it,
recomputed from the tagged rows, and queries see entry w only when w < (position + 1) // rate. Rows
and entries written for positions past a row's length are never read before being rewritten, so
rolling a row back is setting its length. `headroom` (at least the most positions a row may run
past its kept length, k + 1 for drafts of k) keeps the rows a rolled-back row needs in the rings.
"""

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxmtp.layers import Dtype, Linear, RMSNorm, projection_weight
from jaxmtp.layout import CHECKPOINT
from jaxmtp.models.deepseek_v4.blocks import frequencies, rotate_tail, unit_rms
from jaxmtp.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from jaxmtp.quant import as_dense


# Passes of at most this many queries per row gather each query's selected CSA entries; longer ones
# mask the unselected (benchmarks/family_step.py measures the decode step and the verify pass).
GATHER_QUERIES = 16


@flax.struct.dataclass
class PoolCache:
    """kv, gate: [B, S, width] the pool's inputs at the positions in `pos` [B, S] (-1: none);
    entries: [B, M, entry width], entry w pooled from positions up to w * rate + rate - 1."""

    kv: jax.Array
    gate: jax.Array
    pos: jax.Array
    entries: jax.Array


@flax.struct.dataclass
class LayerCache:
    """window: [B, R, head_dim] K=V rows at positions `window_pos` [B, R] (-1: none); compressor
    and indexer: PoolCache or None (sliding layers have neither; HCA layers no indexer)."""

    window: jax.Array
    window_pos: jax.Array
    compressor: PoolCache | None = None
    indexer: PoolCache | None = None


def pool_shape(config: V4Config, layer_type: str, indexer: bool = False) -> tuple[int, int, int]:
    """(entry width, positions an entry pools, input width per position) of a layer's pool."""
    width = config.index_head_dim if indexer else config.head_dim
    rate = config.compress_rate(layer_type)
    overlap = layer_type == CSA
    return width, (2 if overlap else 1) * rate, (2 if overlap else 1) * width


def layer_cache(config: V4Config, layer_type: str, batch: int, max_len: int, headroom: int,
                dtype=jnp.float32) -> LayerCache:
    """An empty cache for one layer, for positions below max_len."""
    def pool(indexer):
        width, span, inputs = pool_shape(config, layer_type, indexer)
        rows = span + headroom
        entries = math.ceil(max_len / config.compress_rate(layer_type))
        return PoolCache(kv=jnp.zeros((batch, rows, inputs), dtype), gate=jnp.zeros((batch, rows, inputs), dtype),
                         pos=jnp.full((batch, rows), -1, jnp.int32), entries=jnp.zeros((batch, entries, width), dtype))

    rows = config.sliding_window + headroom
    return LayerCache(window=jnp.zeros((batch, rows, config.head_dim), dtype),
                      window_pos=jnp.full((batch, rows), -1, jnp.int32),
                      compressor=None if layer_type == SLIDING else pool(False),
                      indexer=pool(True) if layer_type == CSA else None)


def ring_write(ring, ring_pos, new, start, count):
    """Stores a row's newest positions in a ring slot by position modulo its size.

    ring [B, R, W], ring_pos [B, R]; new [B, T, W] at positions start[b] + t, of which the first
    count[b] are real -> (ring, ring_pos) with each slot holding the newest real position that maps
    to it, if it is in this chunk."""
    size, steps = ring.shape[1], new.shape[1]
    last = (start + count - 1)[:, None]
    held = last - jnp.mod(last - jnp.arange(size)[None], size)  # [B, R]
    take = (held >= start[:, None]) & (count[:, None] > 0)
    rows = jnp.take_along_axis(new, jnp.clip(held - start[:, None], 0, steps - 1)[..., None], axis=1)
    return jnp.where(take[..., None], rows.astype(ring.dtype), ring), jnp.where(take, held, ring_pos)


def gather_positions(new, ring, ring_pos, start, wanted):
    """Rows at the positions `wanted` [B, ...]: from the chunk `new` [B, T, W] (positions start[b] + t)
    where they are in it, else from the ring. -> (rows [B, ..., W], valid [B, ...]: held and >= 0)."""
    b = new.shape[0]
    flat = wanted.reshape(b, -1)
    in_chunk = flat >= start[:, None]
    from_new = jnp.take_along_axis(new, jnp.clip(flat - start[:, None], 0, new.shape[1] - 1)[..., None], axis=1)
    slot = jnp.mod(flat, ring.shape[1])
    from_ring = jnp.take_along_axis(ring, slot[..., None], axis=1)
    held = jnp.take_along_axis(ring_pos, slot, axis=1) == flat
    rows = jnp.where(in_chunk[..., None], from_new.astype(ring.dtype), from_ring)
    valid = (flat >= 0) & (in_chunk | held)
    return rows.reshape(wanted.shape + rows.shape[-1:]), valid.reshape(wanted.shape)


class Pool(nn.Module):
    """A compressor: entry w = kv_norm(sum_j softmax_j(gate_j) * kv_j) over its span's positions j,
    per channel, rotated at position w * rate. Each position contributes kv_proj(x) and gate_proj(x) +
    position_bias[position % rate] (the bias added in float32 when pooling); with overlap (CSA) each projects two series of `width`, the first
    half feeding the next entry and the second half this one, so entry w pools 2 * rate positions."""

    config: V4Config
    layer_type: str
    indexer: bool = False
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        width, _, inputs = pool_shape(c, self.layer_type, self.indexer)
        rate = c.compress_rate(self.layer_type)
        self.kv_proj = Linear(c.hidden_size, inputs, ("pool", "embed"), self.dtype, c.initializer_range)
        self.gate_proj = Linear(c.hidden_size, inputs, ("pool", "embed"), self.dtype, c.initializer_range)
        self.position_bias = self.param("position_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                                      (None, "pool")),
                                        (rate, inputs), jnp.float32)
        self.kv_norm = RMSNorm(width, c.rms_norm_eps, self.dtype)

    def __call__(self, x, positions, start, count, cache: PoolCache) -> PoolCache:
        """x [B, T, D] (the attention's normed input) at positions [B, T] = start[:, None] + t, the
        first count[b] real -> the cache with this chunk's rows stored and its closed entries written."""
        c = self.config
        width, span, _ = pool_shape(c, self.layer_type, self.indexer)
        rate = c.compress_rate(self.layer_type)
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        b, steps = positions.shape
        entry = start[:, None] // rate + jnp.arange(steps // rate + 1)[None]  # [B, J] entries that may close
        closing = entry * rate + rate - 1
        closed = (closing >= start[:, None]) & (closing < start[:, None] + steps)
        sources = entry[..., None] * rate - (span - rate) + jnp.arange(span)  # [B, J, span]
        kv_rows, valid = gather_positions(kv, cache.kv, cache.pos, start, sources)
        gate_rows, _ = gather_positions(gate, cache.gate, cache.pos, start, sources)
        # The bias is added in float32 when pooling, as the rows are stored in the cache's dtype.
        gate_rows = gate_rows.astype(jnp.float32) + self.position_bias[sources % rate]
        if span > rate:  # overlap: the earlier window's first series, this window's second
            kv_rows = jnp.concatenate([kv_rows[..., :rate, :width], kv_rows[..., rate:, width:]], axis=-2)
            gate_rows = jnp.concatenate([gate_rows[..., :rate, :width], gate_rows[..., rate:, width:]], axis=-2)
        gate_rows = jnp.where(valid[..., None], gate_rows, -jnp.inf)
        weights = jax.nn.softmax(gate_rows, axis=-2)
        pooled = jnp.sum(weights.astype(kv_rows.dtype) * kv_rows, axis=-2)  # [B, J, width]
        pooled = rotate_tail(self.kv_norm(pooled), entry * rate, frequencies(c, self.layer_type))
        pooled = jnp.where(closed[..., None], pooled, 0)
        slots = jnp.where(closed, entry, cache.entries.shape[1])  # unclosed ones dropped
        entries = cache.entries.at[jnp.arange(b)[:, None], slots].set(pooled.astype(cache.entries.dtype), mode="drop")
        kv_ring, pos = ring_write(cache.kv, cache.pos, kv, start, count)
        gate_ring, _ = ring_write(cache.gate, cache.pos, gate, start, count)
        return PoolCache(kv=kv_ring, gate=gate_ring, pos=pos, entries=entries)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own pool of index keys (overlapping, index_head_dim
    wide) and, per query, score(t, s) = sum_h w[t, h] * relu(q[t, h] . key[s]) / sqrt(index_head_dim)
    with q = q_b_proj(query latent) rotated at t and w = weights_proj(x) / sqrt(index_n_heads); each
    query keeps its index_topk best-scoring visible entries."""

    config: V4Config
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.compressor = Pool(c, CSA, indexer=True, dtype=self.dtype)
        self.q_b_proj = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, ("index_heads", "q_lora"),
                               self.dtype, c.initializer_range)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, ("index_heads", "embed"), self.dtype,
                                   c.initializer_range)

    def __call__(self, x, q_latent, positions, start, count, cache: PoolCache):
        """-> (top [B, T, K]: the entries each query keeps, best first, K = min(index_topk, M);
        valid [B, T, K]: those that are visible (a query with fewer visible entries keeps fewer);
        the indexer's cache)."""
        c = self.config
        cache = self.compressor(x, positions, start, count, cache)
        keys = cache.entries
        b, steps = positions.shape
        q = self.q_b_proj(q_latent).reshape(b, steps, c.index_n_heads, c.index_head_dim)
        q = rotate_tail(q, positions, frequencies(c, CSA))
        w = self.weights_proj(x).astype(jnp.float32) * c.index_n_heads ** -0.5
        dots = jnp.einsum("bthi,bsi->bths", q, keys, preferred_element_type=jnp.float32)
        scores = jnp.einsum("bths,bth->bts", jax.nn.relu(dots) * c.index_head_dim ** -0.5, w)
        visible = visible_entries(positions, keys.shape[1], c.compress_rates[0])
        scores = jnp.where(visible, scores, -jnp.inf)
        _, top = jax.lax.top_k(scores, min(c.index_topk, keys.shape[1]))
        return top, jnp.take_along_axis(visible, top, axis=-1), cache


def visible_entries(positions, entries: int, rate: int):
    """[B, T, M]: entry w is complete, hence visible, at position t when w < (t + 1) // rate."""
    return jnp.arange(entries)[None, None] < ((positions + 1) // rate)[..., None]


def sink_attention(q, parts, sinks, scale: float):
    """softmax over every visible key of every part plus a per-head sink that only adds exp(sink)
    to the denominator; keys are also the values. q [B, T, H, d]; parts: (keys, mask) pairs, keys
    shared by the queries [B, S, d] with mask [B, T, S], or each query's own [B, T, S, d] with mask
    [B, T, S]; sinks [H] -> [B, T, H, d] in q's dtype."""
    logits = []
    for keys, mask in parts:
        subscripts = "bthd,bsd->bhts" if keys.ndim == 3 else "bthd,btsd->bhts"
        part = jnp.einsum(subscripts, q, keys, preferred_element_type=jnp.float32) * scale
        logits.append(jnp.where(mask[:, None], part, -jnp.inf))
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    top = functools.reduce(jnp.maximum, [part.max(axis=-1, keepdims=True) for part in logits], sink)
    probs = [jnp.exp(part - top) for part in logits]
    total = sum(p.sum(axis=-1, keepdims=True) for p in probs) + jnp.exp(sink - top)
    out = 0
    for (keys, _), p in zip(parts, probs):
        subscripts = "bhts,bsd->bthd" if keys.ndim == 3 else "bhts,btsd->bthd"
        out = out + jnp.einsum(subscripts, (p / total).astype(keys.dtype), keys, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


class GroupedLinear(nn.Module):
    """o_a_proj, block diagonal over o_groups: `weight` [g * o_lora_rank, H * d / g] as stored, group
    i mapping the outputs of heads i*H/g..(i+1)*H/g-1 to its own o_lora_rank values.
    out [B, T, H, d] -> [B, T, g * o_lora_rank]."""

    config: V4Config
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, out):
        c = self.config
        g, per_group = c.o_groups, c.num_attention_heads * c.head_dim // c.o_groups
        weight = projection_weight(self, g * c.o_lora_rank, per_group, ("o_lora", "heads"), self.dtype,
                                   c.initializer_range, CHECKPOINT)
        grouped = out.reshape(out.shape[:2] + (g, per_group))
        weight = as_dense(weight, out.dtype).reshape(g, c.o_lora_rank, per_group)
        return jnp.einsum("btgi,goi->btgo", grouped, weight).reshape(out.shape[:2] + (g * c.o_lora_rank,))


class Attention(nn.Module):
    """One V4 attention layer of `layer_type`. (x [B, T, D] normed, positions [B, T] = start + t,
    start [B], count [B] real positions, cache) -> (out [B, T, D], cache)."""

    config: V4Config
    layer_type: str
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        heads, d, std = c.num_attention_heads, c.head_dim, c.initializer_range
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, ("q_lora", "embed"), self.dtype, std)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, self.dtype)
        self.q_b_proj = Linear(c.q_lora_rank, heads * d, ("heads", "q_lora"), self.dtype, std)
        self.kv_proj = Linear(c.hidden_size, d, ("kv_head", "embed"), self.dtype, std)
        self.kv_norm = RMSNorm(d, c.rms_norm_eps, self.dtype)
        self.o_b_proj = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, ("embed", "o_lora"), self.dtype, std)
        self.o_a_proj = GroupedLinear(c, self.dtype)
        self.sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads_only",)),
                                (heads,), jnp.float32)
        if self.layer_type != SLIDING:
            self.compressor = Pool(c, self.layer_type, dtype=self.dtype)
        if self.layer_type == CSA:
            self.indexer = Indexer(c, self.dtype)

    def __call__(self, x, positions, start, count, cache: LayerCache):
        c = self.config
        b, steps, _ = x.shape
        freqs = frequencies(c, self.layer_type)
        with jax.named_scope("query"):
            q_latent = self.q_a_norm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent).reshape(b, steps, c.num_attention_heads, c.head_dim)
            q = rotate_tail(unit_rms(q, c.rms_norm_eps).astype(x.dtype), positions, freqs)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), positions, freqs)
        with jax.named_scope("window"):
            keys, mask = self._window(kv, positions, start, cache)
            window, window_pos = ring_write(cache.window, cache.window_pos, kv, start, count)
        compressor = indexer = None
        parts = [(keys, mask)]
        if self.layer_type != SLIDING:
            with jax.named_scope("compressed"):
                compressor = self.compressor(x, positions, start, count, cache.compressor)
                entries = compressor.entries.astype(keys.dtype)
                visible = visible_entries(positions, entries.shape[1], c.compress_rate(self.layer_type))
                if self.layer_type == HCA:
                    parts.append((entries, visible))
                else:
                    top, valid, indexer = self.indexer(x, q_latent, positions, start, count, cache.indexer)
                    parts.append(self._selected(entries, top, valid))
        with jax.named_scope("attend"):
            out = sink_attention(q, parts, self.sinks, c.head_dim ** -0.5)
            out = rotate_tail(out, positions, freqs, inverse=True)
        out = self.o_b_proj(self.o_a_proj(out))
        return out, LayerCache(window=window, window_pos=window_pos, compressor=compressor, indexer=indexer)

    def _selected(self, entries, top, valid):
        """The CSA entries the indexer kept, as a (keys, mask) part: for few queries (decode steps,
        verify passes, MTP drafts; at most GATHER_QUERIES) each query's own entries gathered, so the
        attention reads index_topk entries rather than every one; for more (prefill chunks) every
        entry with the unkept ones masked. entries [B, M, d], top / valid [B, T, K]."""
        b, steps, _ = top.shape
        if steps <= GATHER_QUERIES:
            return jnp.take_along_axis(entries[:, None], top[..., None], axis=2), valid
        chosen = jnp.zeros((b, steps, entries.shape[1]), bool)
        chosen = chosen.at[jnp.arange(b)[:, None, None], jnp.arange(steps)[None, :, None], top].set(valid)
        return entries, chosen

    def _window(self, kv, positions, start, cache: LayerCache):
        """Keys of the sliding window: the ring's rows before this chunk, then the chunk's own.
        -> (keys [B, R + T, d], mask [B, T, R + T])."""
        held = jnp.where((cache.window_pos >= 0) & (cache.window_pos < start[:, None]), cache.window_pos, -2 ** 30)
        key_pos = jnp.concatenate([held, positions], axis=1)[:, None, :]
        query_pos = positions[..., None]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - self.config.sliding_window) & (key_pos >= 0)
        return jnp.concatenate([cache.window, kv.astype(cache.window.dtype)], axis=1), mask

