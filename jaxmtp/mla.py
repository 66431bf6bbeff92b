"""Multi-head Latent Attention over a compressed (c_kv, k_pe) sequence.

Two mathematically identical forms:
- expanded (prefill): K/V per head are rebuilt from c_kv with kv_b_proj, then ordinary attention;
- absorbed (decode): kv_b_proj's key half is folded into the query and its value half applied after
  attending, so attention runs directly on the 512-wide latent and nothing per-head is materialised
  per cached token. Where the layout stores the key half already folded into the query projection
  (layout.absorbed_queries), every pass takes this form.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp import indexer
from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.indexer import Indexer
from jaxmtp.layers import Dtype, Linear, RMSNorm, normal_init
from jaxmtp.layout import CHECKPOINT, Layout, prefix_lengths, up_projections
from jaxmtp.quant import as_dense
from jaxmtp.rope import apply_rope


# Attention over more cache slots than this runs over blocks of this many with an online softmax ...
KEY_BLOCK = 1024
# ... in passes of at least this many query rows per batch row: a prefill chunk, whose [T, S]
# scores per head would grow with the cache, and which then reads only the blocks up to its last
# position ...
MIN_BLOCKWISE_QUERIES = 16
# ... and in decode and verify passes (k + 1 <= 9 rows) whose [T, S] scores per row and head would
# exceed this many entries (k = 8 past 116K cached tokens). Below it they attend in one product:
# their scores grow only as the cache does, and a loop over blocks would add kernels to every step.
MAX_DECODE_SCORES = 1 << 20
# Passes of at least this many positions per row (prefill chunks; decode and verify passes have k + 1
# <= 9) attend query-major in the latent space (MLA.attend_absorbed).
QUERY_MAJOR_POSITIONS = 16


def blockwise(queries: int, keys: int) -> bool:
    """Whether a pass of `queries` rows attends over `keys` cache slots blockwise (MLA.attend_blockwise)."""
    return (keys > KEY_BLOCK and keys % KEY_BLOCK == 0
            and (queries >= MIN_BLOCKWISE_QUERIES or queries * keys > MAX_DECODE_SCORES))


class MLA(nn.Module):
    """One layer's Multi-head Latent Attention.

    Args of __call__:
      x: [B, T, D] normed input; positions: [B, T] absolute positions.
      cache: one layer's MLACache ([B, S, ...]) or None. With a cache, the new entries are written at
        `positions` and attention reads the cache (with `layout.prefix_attention` its shortest
        prefix that holds the positions), masked to key position <= query position. Without one,
        the T tokens attend causally among themselves.
    Returns: ([B, T, D] output, updated cache or None).
    """

    config: ModelConfig
    dtype: Dtype = jnp.float32
    absorbed: bool = False
    layout: Layout = CHECKPOINT

    def setup(self):
        c, D, H = self.config, self.config.hidden_size, self.config.num_attention_heads
        lin = lambda i, o, axes, layout=self.layout: Linear(i, o, axes, self.dtype, c.initializer_range,  # noqa: E731
                                                            layout=layout)
        if c.q_lora_rank is None:
            self.q_proj = lin(D, H * self.query_width, ("heads", "embed"))
        else:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, self.dtype)
            self.q_b_proj = lin(c.q_lora_rank, H * self.query_width, ("heads", "q_lora"))
        if self.joint:
            self.qkv_a_proj = lin(D, c.q_lora_rank + c.cache_width, ("kv_lora", "embed"))
        else:
            if c.q_lora_rank is not None:
                self.q_a_proj = lin(D, c.q_lora_rank, ("q_lora", "embed"))
            self.kv_a_proj_with_mqa = lin(D, c.cache_width, ("kv_lora", "embed"))
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, self.dtype)
        if self.layout.inputs_first:  # stored as what it is read as: per-head up-projections
            self.kv_b_proj = UpProjections(c, self.dtype, with_key=not self.layout.absorbed_queries)
        else:
            self.kv_b_proj = lin(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), ("heads", "kv_lora"),
                                 CHECKPOINT)
        self.o_proj = lin(H * c.v_head_dim, D, ("embed", "heads"))
        if c.has_indexer:
            self.indexer = Indexer(c, self.dtype, self.layout)

    @property
    def query_width(self) -> int:
        """Per head: N + R query values, or C + R with layout.absorbed_queries (W_uk folded into
        the query projection, so its nope part is the query in the latent space)."""
        c = self.config
        return (c.kv_lora_rank if self.layout.absorbed_queries else c.qk_nope_head_dim) + c.qk_rope_head_dim

    @property
    def joint(self) -> bool:
        """q_a_proj and kv_a_proj_with_mqa stored as one weight `qkv_a_proj` (jaxmtp.layout)."""
        return self.layout.joint_projections and self.config.q_lora_rank is not None

    def __call__(self, x: jax.Array, positions: jax.Array, cache: MLACache | None = None):
        q_input, kv_a = self.down_projections(x)
        q_resid = q_input if self.config.q_lora_rank is None else self.q_a_layernorm(q_input)
        q_nope, q_pe = self.queries(q_resid, positions)
        c_kv, k_pe = self.compress(kv_a, positions)
        index = None
        if self.config.has_indexer:
            with jax.named_scope("indexer"):
                index = (*self.indexer.queries(x, q_resid, positions), self.indexer.keys(x, positions))
        # Absorbed queries have no per-head key part to expand with: every pass attends absorbed.
        attend = self.attend_absorbed if self.absorbed or self.layout.absorbed_queries else self.attend_expanded
        causal = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
        if cache is None:
            if index is not None and x.shape[1] > self.config.index_topk:
                causal &= self.select(index, index[2], causal)
            out = attend(q_nope, q_pe, c_kv, k_pe, causal)  # [B, T, H, V]
        elif index is not None and cache.max_len > self.config.index_topk:
            cache = cache.write(positions, c_kv, k_pe, index[2])
            out = self.attend_sparse(attend, q_nope, q_pe, cache, positions, index)
        elif attend == self.attend_expanded or x.shape[1] > 1 or blockwise(1, cache.max_len):
            cache = cache.write(positions, c_kv, k_pe, None if index is None else index[2])
            out = self.attend_cache(attend, q_nope, q_pe, cache, positions)
        else:
            # One row (a decode step, an MTP draft): attend over the slots before it and over its own
            # new entry apart, then write the entry. The entry takes on a zero computed from the
            # attention's output, so that data orders the write after the cache reads and XLA CPU updates
            # the cache in place instead of copying it (benchmarks/decode_step.py).
            out = self.attend_cache(functools.partial(attend, own=(c_kv, k_pe, causal)), q_nope, q_pe, cache,
                                    positions - 1)
            after = (0 * out[:, :, 0, :1]).astype(c_kv.dtype)  # [B, 1, 1]
            cache = cache.write(positions, c_kv + after, k_pe + after, None if index is None else index[2] + after)
        return self.o_proj(out.reshape(out.shape[:2] + (-1,))), cache

    def select(self, index, keys, visible):
        """The keys [B, S, Di] that the indexer selects for each query among the visible ones
        (visible [B, T, S]) -> mask [B, T, S]. index: (queries, weights, _) of Indexer."""
        chosen = indexer.top_keys(self.config, indexer.scores(self.config, index[0], index[1], keys, visible))
        return indexer.selected_mask(*chosen, keys.shape[1])

    def attend_sparse(self, attend, q_nope, q_pe, cache, positions, index):
        """DeepSeek Sparse Attention over a cache of more than index_topk slots: each query reads
        the index_topk keys at or before its position that the indexer scores highest. A pass of
        few queries (decode, verify, an MTP draft) gathers those keys and attends over them alone;
        one whose queries together would gather more keys than the cache holds (a prefill chunk)
        masks the others in the attention over the cache. -> [B, T, H, V]"""
        c = self.config
        visible = jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = indexer.scores(c, index[0], index[1], cache.index_k, visible)
        b, t = positions.shape
        if t * c.index_topk >= cache.max_len:
            selected = indexer.selected_mask(*indexer.top_keys(c, scores), cache.max_len)
            return self.attend_cache(attend, q_nope, q_pe, cache, positions, selected)
        indices, chosen = indexer.top_keys(c, scores)  # [B, T, K]
        gather = jax.vmap(lambda slots, rows: slots[rows])  # [S, W], [T, K] -> [T, K, W] per batch row
        dtype = q_nope.dtype
        keys = [gather(a, indices).astype(dtype).reshape((b * t, indices.shape[-1], -1))
                for a in (cache.c_kv, cache.k_pe)]
        rows = lambda a: a.reshape((b * t, 1) + a.shape[2:])  # noqa: E731  (each query its own batch row)
        out = attend(rows(q_nope), rows(q_pe), *keys, chosen.reshape(b * t, 1, -1))
        return out.reshape((b, t) + out.shape[2:])

    def attend_cache(self, attend, q_nope, q_pe, cache, positions, selected=None):
        """`attend` over the cache: all its slots, or with `layout.prefix_attention` the shortest of
        the `prefix_lengths` for T positions that holds every query position (one lax.switch branch
        per prefix); slots past a query's position are masked either way, and so are those that `selected`
        ([B, T, S], the indexer's choice) leaves out. -> [B, T, H, V]"""
        def over(length):
            def branch(q_nope, q_pe, c_kv, k_pe):
                chosen = None if selected is None else selected[:, :, :length]
                if blockwise(q_nope.shape[1], length):
                    absorbed = attend != self.attend_expanded
                    return self.attend_blockwise(absorbed, q_nope, q_pe, c_kv[:, :length], k_pe[:, :length], positions,
                                                 chosen)
                mask = jnp.arange(length)[None, None, :] <= positions[:, :, None]  # [B, T, S]
                mask = mask if chosen is None else mask & chosen
                dtype = q_nope.dtype
                return attend(q_nope, q_pe, c_kv[:, :length].astype(dtype), k_pe[:, :length].astype(dtype), mask)
            return branch

        queries = q_nope.shape[1]
        lengths = prefix_lengths(cache.max_len, queries) if self.layout.prefix_attention else (cache.max_len,)
        operands = (q_nope, q_pe, cache.c_kv, cache.k_pe)
        if len(lengths) == 1:
            return over(lengths[0])(*operands)
        shortest = jnp.searchsorted(jnp.asarray(lengths), positions.max(), side="right")
        return jax.lax.switch(shortest, [over(n) for n in lengths], *operands)

    def down_projections(self, x):
        """x [B, T, D] -> (the queries' input: q_a_proj(x) [B, T, Q], or x itself without a query
        LoRA; kv_a_proj_with_mqa(x) [B, T, C + R]), one product for both where they are joint."""
        c = self.config
        if self.joint:
            q_a, kv_a = jnp.split(self.qkv_a_proj(x), [c.q_lora_rank], axis=-1)
            return q_a, kv_a
        return (x if c.q_lora_rank is None else self.q_a_proj(x)), self.kv_a_proj_with_mqa(x)

    def queries(self, q_resid, positions):
        """q_resid (the query LoRA's normed output, or x without one) -> q_nope [B, T, H, N] (with
        layout.absorbed_queries already times W_uk: [B, T, H, C]), q_pe [B, T, H, R] (rotated)."""
        c = self.config
        q = self.q_proj(q_resid) if c.q_lora_rank is None else self.q_b_proj(q_resid)
        q = q.reshape(q.shape[:2] + (c.num_attention_heads, self.query_width))
        q_nope, q_pe = jnp.split(q, [self.query_width - c.qk_rope_head_dim], axis=-1)
        return q_nope, apply_rope(q_pe, positions, c)

    def compress(self, kv_a, positions):
        """kv_a [B, T, C + R] -> c_kv [B, T, C] (after kv_a_layernorm), k_pe [B, T, R] (rotated):
        what the cache holds."""
        c_kv, k_pe = jnp.split(kv_a, [self.config.kv_lora_rank], axis=-1)
        return self.kv_a_layernorm(c_kv), apply_rope(k_pe, positions, self.config)

    def up_projections(self):
        """kv_b_proj viewed per head -> W_uk [H, N, C] (None with layout.absorbed_queries), W_uv [H, C, V]."""
        if self.layout.inputs_first:
            return self.kv_b_proj.key, self.kv_b_proj.value
        return up_projections(as_dense(self.kv_b_proj.weight, self.dtype), self.config)

    def attend_expanded(self, q_nope, q_pe, c_kv, k_pe, mask):
        """Attention with per-head keys and values rebuilt from the latent (the prefill's form).
        q_nope [B, T, H, N], q_pe [B, T, H, R], c_kv [B, S, C], k_pe [B, S, R], mask [B, T, S]
        -> [B, T, H, V]."""
        w_uk, w_uv = self.up_projections()
        k_nope = jnp.einsum("bsc,hnc->bshn", c_kv, w_uk.astype(c_kv.dtype))
        v = jnp.einsum("bsc,hcv->bshv", c_kv, w_uv.astype(c_kv.dtype))
        scores = jnp.einsum("bthn,bshn->bhts", q_nope, k_nope) + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe)
        probs = self.softmax(scores, mask[:, None], axis=-1).astype(v.dtype)
        return jnp.einsum("bhts,bshv->bthv", probs, v)

    def attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, mask, own=None):
        """Attention in the latent space over c_kv [B, S, C] / k_pe [B, S, R] (mask [B, T, S]) and,
        with `own` = (c_kv [B, T, C], k_pe [B, T, R], mask [B, T, T]), over the T new entries too,
        read apart from the cache. -> [B, T, H, V]"""
        w_uk, w_uv = self.up_projections()
        b, t, h, _ = q_nope.shape
        q_latent = self.latent_queries(q_nope, w_uk)
        # T and H merged into one axis of M query rows. With few positions (decode, verify, drafts) the
        # products run slot-major, [S, C] x [C, M]: XLA CPU runs a product as [M, K] x [K, N] and
        # copies an operand laid out otherwise, so the cache is M in the scores and K in the output
        # product and is never copied; the (small) probabilities are transposed for the second
        # product so that XLA runs it as a library product, not a loop of its own. With many (a
        # prefill chunk) they run query-major, [M, C] x [C, S]: copying the cache's slots costs
        # less than transposing [M, S] probabilities, and the softmax reduces over the minor axis
        # (benchmarks/decode_step.py --rows 32,128 --cache-len 640 --start 256).
        rows_latent, rows_pe = q_latent.reshape(b, t * h, -1), q_pe.reshape(b, t * h, -1)  # [B, T*H, .]
        keys = [(c_kv, k_pe, mask)] + ([] if own is None else [own])
        if t >= QUERY_MAJOR_POSITIONS:
            scores = jnp.concatenate([jnp.einsum("bmc,bsc->bms", rows_latent, c) + jnp.einsum("bmr,bsr->bms", rows_pe, r)
                                      for c, r, _ in keys], axis=2)  # [B, T*H, S (+ T)]
            masks = jnp.concatenate([jnp.repeat(m, h, axis=1) for _, _, m in keys], axis=2)
            probs = self.softmax(scores, masks, axis=2).astype(c_kv.dtype)  # [B, T*H, S (+ T)]
        else:
            scores = jnp.concatenate([jnp.einsum("bsc,bmc->bsm", c, rows_latent) + jnp.einsum("bsr,bmr->bsm", r, rows_pe)
                                      for c, r, _ in keys], axis=1)  # [B, S (+ T), T*H]
            masks = jnp.concatenate([jnp.repeat(m.transpose(0, 2, 1), h, axis=2) for _, _, m in keys], axis=1)
            probs = self.softmax(scores, masks, axis=1).astype(c_kv.dtype).transpose(0, 2, 1)  # [B, T*H, S (+ T)]
        parts = jnp.split(probs, [c_kv.shape[1]], axis=2)[:len(keys)]
        out_latent = sum(jnp.einsum("bms,bsc->bmc", p, c) for p, (c, _, _) in zip(parts, keys))  # [B, T*H, C]
        out_latent = out_latent.reshape(b, t, h, -1).transpose(2, 0, 1, 3)  # [H, B, T, C]: W_uv's input order
        out = jnp.einsum("hmc,hcv->hmv", out_latent.reshape(h, b * t, -1), w_uv.astype(out_latent.dtype))
        return out.reshape(h, b, t, -1).transpose(1, 2, 0, 3)  # [B, T, H, V]

    def latent_queries(self, q_nope, w_uk):
        """q_nope [B, T, H, N] times W_uk [H, N, C] -> the queries in the latent space [B, T, H, C]
        (q_nope itself where the layout folded W_uk into the query projection)."""
        if self.layout.absorbed_queries:
            return q_nope
        # W_uk per head as one product batched over heads with the B*T rows as its M dimension, which
        # XLA CPU runs as a library product; as bthn,hnc->bthc it emits a loop of its own for 2+ rows
        # (benchmarks/decode_step.py).
        b, t, h, _ = q_nope.shape
        rows = q_nope.reshape(b * t, h, -1).transpose(1, 0, 2)  # [H, B*T, N]
        q_latent = jnp.einsum("hmn,hnc->hmc", rows, w_uk.astype(q_nope.dtype))
        return q_latent.transpose(1, 0, 2).reshape(b, t, h, -1)

    def attend_blockwise(self, absorbed: bool, q_nope, q_pe, c_kv, k_pe, positions, selected=None):
        """Attention over c_kv [B, S, C] / k_pe [B, S, R] a block of KEY_BLOCK keys at a time with an
        online softmax (a running maximum and sum per query and head), masked to key position <=
        query position (positions [B, T]) and to the `selected` keys [B, T, S] if given, so that no
        [T, S] score matrix of the whole cache is held: the absorbed form accumulates the latent
        [B, T, H, C] and applies W_uv once at the end; the expanded form expands each block's keys
        and values. Blocks past the largest query position are not visited. S is a multiple of
        KEY_BLOCK. -> [B, T, H, V]"""
        w_uk, w_uv = self.up_projections()
        dtype = q_nope.dtype
        b, t, h, _ = q_nope.shape
        queries = self.latent_queries(q_nope, w_uk) if absorbed else q_nope
        width = c_kv.shape[-1] if absorbed else w_uv.shape[-1]

        def block(j, carry):
            top, total, acc = carry  # [B, T, H], [B, T, H], [B, T, H, width] float32
            keys = jax.lax.dynamic_slice_in_dim(c_kv, j * KEY_BLOCK, KEY_BLOCK, axis=1).astype(dtype)
            rope = jax.lax.dynamic_slice_in_dim(k_pe, j * KEY_BLOCK, KEY_BLOCK, axis=1).astype(dtype)
            if absorbed:
                nope, values = keys, keys
                scores = jnp.einsum("bthc,bkc->bthk", queries, nope)
                subscripts = "bthk,bkc->bthc"
            else:
                nope = jnp.einsum("bkc,hnc->bkhn", keys, w_uk.astype(dtype))
                values = jnp.einsum("bkc,hcv->bkhv", keys, w_uv.astype(dtype))
                scores = jnp.einsum("bthn,bkhn->bthk", queries, nope)
                subscripts = "bthk,bkhv->bthv"
            scores = (scores + jnp.einsum("bthr,bkr->bthk", q_pe, rope)).astype(jnp.float32) * self.config.softmax_scale
            visible = j * KEY_BLOCK + jnp.arange(KEY_BLOCK) <= positions[:, :, None]  # [B, T, K]
            if selected is not None:
                visible &= jax.lax.dynamic_slice_in_dim(selected, j * KEY_BLOCK, KEY_BLOCK, axis=2)
            scores = jnp.where(visible[:, :, None, :], scores, jnp.finfo(jnp.float32).min)
            new_top = jnp.maximum(top, scores.max(axis=-1))
            kept = jnp.exp(top - new_top)
            probs = jnp.exp(scores - new_top[..., None])
            acc = acc * kept[..., None] + jnp.einsum(subscripts, probs.astype(dtype), values,
                                                     preferred_element_type=jnp.float32)
            return new_top, total * kept + probs.sum(axis=-1), acc

        # A block with no visible key adds weights of exp(0) at a running maximum of finfo.min, which
        # the first block with one (every query sees at least one key) multiplies by exp(-inf) = 0.
        start = (jnp.full((b, t, h), jnp.finfo(jnp.float32).min), jnp.zeros((b, t, h)), jnp.zeros((b, t, h, width)))
        blocks = jnp.minimum(positions.max() // KEY_BLOCK + 1, c_kv.shape[1] // KEY_BLOCK)
        _, total, acc = jax.lax.fori_loop(0, blocks, block, start)
        out = (acc / total[..., None]).astype(dtype)
        return jnp.einsum("bthc,hcv->bthv", out, w_uv.astype(dtype)) if absorbed else out

    def softmax(self, scores, mask, axis):
        """Scaled, masked softmax in float32 over the key slots' `axis` of scores; mask broadcasts
        to scores."""
        scores = scores.astype(jnp.float32) * self.config.softmax_scale
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(scores, axis=axis)


class UpProjections(nn.Module):
    """kv_b_proj in the decode layout (jaxmtp.layout): the checkpoint's [H * (N + V), C] weight as
    key [H, N, C] (W_uk; none where the layout folded it into the queries) and value [H, C, V]
    (W_uv), each product's input first."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    with_key: bool = True

    def setup(self):
        c, H = self.config, self.config.num_attention_heads
        init = lambda *axes: normal_init(c.initializer_range, ("heads", *axes))  # noqa: E731
        self.key = (self.param("key", init("head_dim", "kv_lora"), (H, c.qk_nope_head_dim, c.kv_lora_rank), self.dtype)
                    if self.with_key else None)
        self.value = self.param("value", init("kv_lora", "head_dim"), (H, c.kv_lora_rank, c.v_head_dim), self.dtype)
