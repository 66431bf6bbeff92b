"""`V4Model`: a DeepSeek-V4 config plus its parameter pytree, with a jitted step over caches stored
by position, a whole-sequence forward and greedy decoding; `init_v4`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import checks
from jaxmtp.errors import InputError
from jaxmtp.models.deepseek_v4.attention import pool_shape
from jaxmtp.models.deepseek_v4.config import CSA, SLIDING, V4Config
from jaxmtp.models.deepseek_v4.transformer import DeepseekV4, new_caches, new_mtp_cache
from jaxmtp.params import describe_unsplit
from jaxmtp.quant import QuantizedWeight
from jaxmtp.sharding import ShardingWarning, batch_sharding, spec, split


@dataclasses.dataclass
class V4Model:
    """A DeepSeek-V4 model: static config, parameter pytree and its device mesh (or None). On a
    mesh, the parameters are split by jaxmtp.sharding's rules (heads, vocabulary and intermediates
    over `tensor`, routed experts over `data` and `expert`), the caches' rows over `data`, and the
    MoE layers run expert-parallel."""

    config: V4Config
    params: Any
    mesh: Any = None
    # Why a checkpoint's MTP block was not loaded (a DSpark drafter, or none shipped), or None.
    mtp_note: str | None = None

    def mesh_context(self):
        """`jax.set_mesh(mesh)` for the model's mesh (the MoE layers read it); steps enter it."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def place_rows(self, tree, axis: int = 0):
        """Arrays whose axis `axis` is the batch (0; 1 for the main model's stacked caches), split
        over the mesh's `data` axis; where it does not divide the batch, replicated, with a
        ShardingWarning (every device then attends for every row). Unchanged without a mesh."""
        if self.mesh is None:
            return tree
        data = self.mesh.shape.get("data", 1)

        def put(leaf):
            leaf = jnp.asarray(leaf)
            if leaf.ndim > axis and leaf.shape[axis] % data == 0:
                return jax.device_put(leaf, rows_sharding(self.mesh, leaf.ndim, axis))
            if leaf.ndim > axis:
                warnings.warn(f"a batch of {leaf.shape[axis]} rows is not divisible by data={data}: every device "
                              "holds and attends for every row", ShardingWarning, stacklevel=3)
            return jax.device_put(leaf, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

        return jax.tree.map(put, tree)

    @property
    def dtype(self):
        return jnp.dtype(self.params["embed_tokens"]["weight"].dtype)

    def new_caches(self, batch: int, max_len: int, headroom: int = 1) -> tuple:
        """Empty caches for `batch` rows and positions below max_len (see transformer.new_caches)."""
        return self.place_rows(new_caches(self.config, batch, max_len, headroom, self.dtype), axis=1)

    def step(self, tokens, start, count, caches):
        """tokens [B, T] at positions start[b] + t, the first count[b] real -> (logits [B, T, V],
        hidden [B, T, D], last-layer streams [B, T, N, D], caches)."""
        with self.mesh_context():
            args = self.place_rows((jnp.asarray(tokens, jnp.int32), jnp.asarray(start, jnp.int32),
                                    jnp.asarray(count, jnp.int32)))
            return apply_step(self.config, self.dtype, self.params, *args, caches)

    def new_mtp_cache(self, batch: int, max_len: int, headroom: int = 1):
        """An empty cache of the MTP block."""
        return self.place_rows(new_mtp_cache(self.config, batch, max_len, headroom, self.dtype))

    def mtp_step(self, streams, next_tokens, start, count, cache):
        """The MTP block over streams [B, T, N, D] and the tokens after them [B, T] at positions
        start[b] + t -> (logits [B, T, V] of the token after those, its streams, cache)."""
        if not self.config.has_mtp:
            raise InputError("mtp_step: this model has no MTP block (num_nextn_predict_layers = 0)"
                             + (f": {self.mtp_note}" if self.mtp_note else ""))
        with self.mesh_context():
            args = self.place_rows((jnp.asarray(streams, self.dtype), jnp.asarray(next_tokens, jnp.int32),
                                    jnp.asarray(start, jnp.int32), jnp.asarray(count, jnp.int32)))
            return apply_mtp_step(self.config, self.dtype, self.params, *args, cache)

    def forward(self, tokens, lengths=None) -> tuple[jax.Array, jax.Array]:
        """tokens [B, T] from position 0 (rows right-padded to their `lengths`, default T) ->
        (logits [B, T, V] float32, post-norm hidden [B, T, D]); padded positions hold garbage."""
        tokens = checks.token_ids("tokens", tokens, self.config.vocab_size)
        b, steps = tokens.shape
        lengths = np.full(b, steps) if lengths is None else np.asarray(lengths)
        if lengths.shape != (b,) or (lengths < 1).any() or (lengths > steps).any():
            raise InputError(f"lengths: expected {b} values in 1..{steps}, found {lengths.tolist()}")
        logits, hidden, _, _ = self.step(tokens, np.zeros(b), lengths, self.new_caches(b, steps))
        return logits, hidden

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None) -> list[list[int]]:
        """Greedy decoding of each prompt (no stop tokens): its prompt prefilled in chunks of `chunk`
        positions (default: whole), then one position per step. -> the new tokens of each prompt."""
        prompts = checks.prompts(prompts, self.config.vocab_size)
        lengths = np.array([len(p) for p in prompts])
        width = chunk or int(lengths.max())
        max_len = int(lengths.max()) + max_new_tokens
        caches = self.new_caches(len(prompts), max_len)
        padded = np.zeros((len(prompts), -(-int(lengths.max()) // width) * width), np.int32)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        last = np.zeros((len(prompts), self.config.vocab_size), np.float32)
        for at in range(0, padded.shape[1], width):
            count = np.clip(lengths - at, 0, width)
            logits, _, _, caches = self.step(padded[:, at:at + width], np.full(len(prompts), at), count, caches)
            logits = np.asarray(logits)
            ends = (lengths > at) & (lengths <= at + width)
            last[ends] = logits[ends, lengths[ends] - 1 - at]
        out = [[] for _ in prompts]
        positions = lengths.copy()
        for _ in range(max_new_tokens):
            token = last.argmax(-1)
            for i, t in enumerate(token):
                out[i].append(int(t))
            logits, _, _, caches = self.step(token[:, None], positions, np.ones(len(prompts)), caches)
            last = np.asarray(logits[:, 0])
            positions = positions + 1
        return out


def rows_sharding(mesh, ndim: int, axis: int = 0):
    """Axis `axis` (the batch) over `data`, the rest replicated."""
    if axis == 0:
        return batch_sharding(mesh, ndim)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * axis), "data"))


@partial(jax.jit, static_argnums=(0, 1))
def apply_step(config, dtype, params, tokens, start, count, caches):
    """The main model over one chunk of positions per row (see V4Model.step)."""
    return DeepseekV4(config, dtype).apply({"params": params}, tokens, start, count, caches)


@partial(jax.jit, static_argnums=(0, 1))
def apply_mtp_step(config, dtype, params, streams, next_tokens, start, count, cache):
    """The MTP block over one chunk of positions per row (see V4Model.mtp_step)."""
    return DeepseekV4(config, dtype).apply({"params": params}, streams, next_tokens, start, count, cache,
                                           method=DeepseekV4.mtp_step)


def init_v4(config: V4Config, seed: int = 0, dtype="float32", mesh=None) -> V4Model:
    """Random parameters (normal(initializer_range) weights, unit norms, zero biases, sinks and
    position biases, a random token -> experts table); with a mesh (`jaxmtp.make_mesh`), each
    created directly with its NamedSharding (`param_shardings`)."""
    dtype = checks.float_dtype("dtype", dtype)
    fn = lambda key: nn.meta.unbox(_variables(config, dtype, key))["params"]  # noqa: E731
    shardings = None if mesh is None else param_shardings(config, abstract_params(config, dtype), mesh)
    return V4Model(config, jax.jit(fn, out_shardings=shardings)(jax.random.key(seed)), mesh)


def _variables(config: V4Config, dtype, key):
    """The boxed variables (parameters with their logical axis names) of a fresh init."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    one = jnp.ones((1,), jnp.int32)
    return DeepseekV4(config, dtype).init(key, tokens, one * 0, one, new_caches(config, 1, 1, 1, dtype),
                                          new_mtp_cache(config, 1, 1, 1, dtype), method=DeepseekV4.init_all)


def logical_axes(config: V4Config) -> dict:
    """The logical axis names of every parameter, as a pytree of PartitionSpecs."""
    return nn.get_partition_spec(_abstract(config, jnp.dtype(jnp.float32)))["params"]


def param_shardings(config: V4Config, params, mesh):
    """NamedSharding for every leaf of `params` (abstract or real; kept FP8 and FP4 weights get one
    for their values and one for their scales) by jaxmtp.sharding's rules; a dimension a mesh axis
    does not divide stays whole over it, and one ShardingWarning lists them."""
    unsplit: dict[str, list[str]] = {}

    def one(path, logical, leaf):
        values = leaf.value if isinstance(leaf, QuantizedWeight) else leaf
        partition, reasons = split(tuple(logical), values.shape, mesh)
        for reason in reasons:
            unsplit.setdefault(reason, []).append("/".join(str(getattr(k, "key", k)) for k in path))
        if isinstance(leaf, QuantizedWeight):  # the block scales cut along the same axes where they divide
            return leaf.replace(value=jax.sharding.NamedSharding(mesh, partition),
                                scale=jax.sharding.NamedSharding(mesh, spec(tuple(logical), leaf.scale.shape, mesh)))
        return jax.sharding.NamedSharding(mesh, partition)

    shardings = jax.tree_util.tree_map_with_path(one, logical_axes(config), params,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    if unsplit:
        warnings.warn(describe_unsplit(unsplit, mesh), ShardingWarning, stacklevel=2)
    return shardings


def abstract_params(config: V4Config, dtype=jnp.bfloat16):
    """The parameter tree's shapes and dtypes (jax.ShapeDtypeStruct leaves), without allocating."""
    abstract = nn.meta.unbox(_abstract(config, jnp.dtype(dtype)))["params"]
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)


@functools.lru_cache(maxsize=16)
def _abstract(config: V4Config, dtype):
    """The boxed variables of a fresh init, traced once per config and dtype: tracing the whole
    model takes a second or more, and one load asks for its shapes and its axis names several times
    (callers get new trees: unbox and get_partition_spec map over it)."""
    return jax.eval_shape(partial(_variables, config, dtype), jax.random.key(0))


def parameter_counts(config: V4Config) -> dict[str, int]:
    """Parameters of the main model (`main`; the routed experts' share in `routed_experts`), of the
    MTP block (`mtp`), and those active per token in the main model (all but its routed experts,
    plus num_experts_per_tok of them per layer)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
    counts = {"main": 0, "routed_experts": 0, "mtp": 0}
    for path, leaf in leaves:
        keys = [getattr(p, "key", None) for p in path]
        size = int(np.prod(leaf.shape))
        counts["mtp" if keys[0] == "mtp" else "main"] += size
        if keys[0] != "mtp" and "experts" in keys:
            counts["routed_experts"] += size
    experts = counts["routed_experts"]
    counts["active"] = counts["main"] - experts + experts * config.num_experts_per_tok // config.n_routed_experts
    return counts


def cache_bytes(config: V4Config, dtype=jnp.bfloat16, headroom: int = 1) -> tuple[int, int]:
    """(bytes per cached token, bytes per sequence besides them) of every layer's cache and the MTP
    block's: compressed entries and index keys grow with the sequence; windows and pooling rows
    (plus `headroom` rows each) do not. Position tags (int32) counted with their rows."""
    size = jnp.dtype(dtype).itemsize
    growing, bounded = 0.0, 0
    kinds = list(config.layer_types) + ([SLIDING] if config.has_mtp else [])
    for kind in kinds:
        bounded += (config.sliding_window + headroom) * (config.head_dim * size + 4)
        for indexer in ((False, True) if kind == CSA else (False,) if kind != SLIDING else ()):
            width, span, inputs = pool_shape(config, kind, indexer)
            growing += width * size / config.compress_rate(kind)
            bounded += (span + headroom) * (2 * inputs * size + 4)
    return int(round(growing)), bounded
