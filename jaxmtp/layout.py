"""Parameter layouts: the checkpoint's, and the one that decoding runs fastest in.

Both hold the same numbers; a layout only arranges them differently, and every Flax module reads
its parameters in whichever layout it is given (`layout` attribute), so the model math exists once.

- unrolled: each stack's layers as parameters of their own (`layers_0 .. layers_{L-1}`, one cache
  each), so that a step does not slice every layer's weights and cache out of arrays stacked on a
  `layers` axis and write the cache back, as a scan over the stack does.
- split_experts: a layer's routed experts as a tuple of E weights, each run under its own
  conditional (on all rows where any row chose it, else not at all), so that no expert is gathered or
  sliced out of the stack, which XLA copies (benchmarks/decode_step.py --experts). CPU only:
  XLA:GPU waits for the host on every conditional's predicate, so E x L conditionals would stall a
  GPU step; there the experts stay stacked and few tokens gather their experts' weights.
- prefix_attention: a pass attends over the shortest prefix of the cache that holds every query
  position (one `lax.switch` branch per prefix; `prefix_lengths`), so that the first steps of a
  long generation, and a prompt's first chunks, skip the slots they have not reached
  (benchmarks/decode_step.py --prefix-attention, benchmarks/prefix_attention.py). Not a parameter
  arrangement; CPU only, for split_experts' reason.
- inputs_first: dense projection weights stored [in, out], because XLA's CPU GEMM re-packs an
  [out, in] weight on every call of two or more rows (benchmarks/decode_step.py). kv_b_proj is
  stored as the per-head products it is read as, `key` [H, N, C] (q_nope -> latent) and `value`
  [H, C, V] (latent -> values), which cut out of its [H * (N + V), C] weight on every step would be
  copied in each layer. FP8-kept weights stay [out, in]: their kernels take [out, in] blocks.
- joint_projections: projections of the same input joined along out into one weight (`qkv_a_proj`:
  q_a_proj and kv_a_proj_with_mqa; `gate_up_proj`: gate_proj and up_proj in every MLP and split
  expert), because each small product of a decode step costs a kernel call that its few rows do not
  amortise (benchmarks/decode_step.py). Needs inputs_first; not where a mesh splits these weights
  over `tensor`, whose slices of a joined weight would not be the ones each half needs.
- absorbed_queries: W_uk (kv_b_proj's per-head key half) folded into the query projection (head
  h's nope columns become W_q[:, h, :N] @ W_uk[h]), so that one product gives the query in the
  latent space and every pass, prefill included, attends in the absorbed form. Chosen where the
  folded weight [Q, H * (C + R)] holds no more numbers than the two it replaces (the demo, not
  DeepSeek-V3), which saves a batched product and two transposing copies per layer
  (benchmarks/decode_step.py). Needs inputs_first.

`decode_layout` picks the layout for a model and `convert` derives its parameters, once per model
(`Model.decoding`): the checkpoint layout for models too large to unroll.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxmtp.config import ModelConfig
from jaxmtp.errors import InputError
from jaxmtp.quant import QuantizedWeight, is_quantized
from jaxmtp.sharding import expert_axes

# Routed experts are split only for small expert counts: every expert has its own branch in every
# MoE layer, and many tokens run every expert over all of them.
MAX_SPLIT_EXPERTS = 16
# Larger models keep their scanned stacks: unrolling DeepSeek-V3 671B's 61 layers multiplies its
# compile time and XLA's temporaries per device (`jaxmtp plan` reports both).
MAX_UNROLLED_BYTES = 8 << 30
# Weights that keep the checkpoint's [out, in] layout under inputs_first.
OUT_IN_ONLY = frozenset({"embed_tokens"})
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # under each layer's `experts`
# Prefix attention's shortest prefix (cache slots); each longer one doubles it. Caches of up to
# 256 slots keep one branch: over shorter prefixes, what the skipped slots save does not pay for
# the switch (benchmarks/decode_step.py --prefix-attention).
SHORTEST_PREFIX = 256
# Passes of at least this many positions per row (prefill chunks) choose from finer prefixes below
# FINE_PREFIXES_BELOW slots; longer caches attend blockwise in such passes (mla.KEY_BLOCK), which
# skips the blocks past a chunk's last position anyway.
MANY_QUERIES = 16
FINE_PREFIXES_BELOW = 1024


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the parameters are arranged (static, part of every compiled function's signature)."""

    unrolled: bool = False
    split_experts: bool = False
    inputs_first: bool = False
    prefix_attention: bool = False
    joint_projections: bool = False
    absorbed_queries: bool = False

    def __post_init__(self):
        if (self.split_experts or self.inputs_first) and not self.unrolled:
            raise InputError(f"{self}: split_experts and inputs_first apply to unrolled layers only")
        if self.joint_projections and not self.inputs_first:
            raise InputError(f"{self}: joint_projections joins [in, out] weights, so it needs inputs_first")
        if self.absorbed_queries and not self.inputs_first:
            raise InputError(f"{self}: absorbed_queries folds kv_b_proj's per-head key into [in, out] weights, "
                             "so it needs inputs_first")


    def on_cpu(self, split_experts: bool) -> Layout:
        """This layout with the CPU-only arrangements: prefix attention, and split experts where asked."""
        return dataclasses.replace(self, prefix_attention=True, split_experts=split_experts)


# The presets that `decode_layout` chooses from (before `Layout.on_cpu`):
CHECKPOINT = Layout()  # as stored: stacks scanned over a `layers` axis (models over MAX_UNROLLED_BYTES)
UNROLLED = Layout(unrolled=True)  # layers of their own, weights as stored (FP8-kept weights)
# Every arrangement of a dense model's weights; decode_layout drops joint_projections where a mesh
# splits them over `tensor` and absorbed_queries where the folded weight would be larger.
REARRANGED = Layout(unrolled=True, inputs_first=True, joint_projections=True, absorbed_queries=True)


def prefix_lengths(cache_len: int, queries: int = 1) -> tuple[int, ...]:
    """The cache prefixes that prefix attention chooses from for passes of `queries` positions per
    row: SHORTEST_PREFIX slots, doubling while at most half the cache, then the whole cache. XLA
    copies a prefix out of the cache before the products read it: a decode round of 8 rows over 512
    of 640 slots cost more than over all of them (benchmarks/prefix_attention.py). Passes of at
    least MANY_QUERIES (prefill chunks) choose from finer prefixes below FINE_PREFIXES_BELOW:
    SHORTEST_PREFIX / 2 slots, then by steps of x 1.5 and x 4/3 in turn, so that a chunk reads at
    most half as many slots again as it reaches, where doubling read up to twice as many; the copy
    costs little beside the products of a chunk's many queries (the same benchmark)."""
    lengths = []
    while (SHORTEST_PREFIX << len(lengths) + 1) <= cache_len:
        lengths.append(SHORTEST_PREFIX << len(lengths))
    if queries >= MANY_QUERIES:
        shortest = SHORTEST_PREFIX // 2
        fine = {n for i in range(FINE_PREFIXES_BELOW.bit_length()) for n in (shortest << i, 3 * shortest << i >> 1)}
        lengths = sorted({n for n in fine if n < min(cache_len, FINE_PREFIXES_BELOW)}
                         | {n for n in lengths if n >= FINE_PREFIXES_BELOW})
    return (*lengths, cache_len)


def _bytes(params) -> int:
    """Bytes of all parameters (arrays or abstract shapes; FP8 values and scales both counted)."""
    return sum(leaf.size * jax.numpy.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))


def decode_layout(config: ModelConfig, params, mesh=None) -> Layout:
    """The layout to decode this model in: CHECKPOINT for models of more than MAX_UNROLLED_BYTES of
    parameters; UNROLLED for weights kept in FP8 (their kernels take [out, in] blocks); REARRANGED
    for dense models, less joint_projections where a mesh splits them over `tensor` and
    absorbed_queries where the folded weight is larger. On a CPU, `Layout.on_cpu`, splitting a
    dense model's experts where there are at most MAX_SPLIT_EXPERTS and no mesh axis runs them
    expert-parallel (that needs the stack)."""
    if _bytes(params) > MAX_UNROLLED_BYTES:
        return CHECKPOINT
    tensor = mesh is not None and mesh.shape.get("tensor", 1) > 1
    parallel = tensor or (mesh is not None and bool(expert_axes(mesh, config.n_routed_experts)))
    quantized = is_quantized(params)
    layout = UNROLLED if quantized else dataclasses.replace(REARRANGED, joint_projections=not tensor,
                                                            absorbed_queries=absorbing_is_no_larger(config))
    if platform(params, mesh) != "cpu":
        return layout
    return layout.on_cpu(split_experts=not quantized and config.n_routed_experts <= MAX_SPLIT_EXPERTS and not parallel)


def absorbing_is_no_larger(config: ModelConfig) -> bool:
    """Whether the query projection with W_uk folded in ([Q, H * (C + R)]) holds no more numbers
    than the two it replaces ([Q, H * (N + R)] and W_uk [H, N, C]): true at the demo's widths, not
    at DeepSeek-V3's."""
    c = config
    q_in = c.q_lora_rank or c.hidden_size
    heads, rope = c.num_attention_heads, c.qk_rope_head_dim
    return q_in * heads * (c.kv_lora_rank + rope) <= (q_in * heads * (c.qk_nope_head_dim + rope)
                                                       + heads * c.qk_nope_head_dim * c.kv_lora_rank)


def platform(params, mesh=None) -> str:
    """The platform of the mesh's devices, or of the devices the parameters are on (abstract
    parameters: the default device's)."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    devices = getattr(jax.tree.leaves(params)[0], "devices", None)
    return next(iter(devices())).platform if callable(devices) else jax.devices()[0].platform


def convert(params, layout: Layout, config: ModelConfig):
    """Checkpoint-layout parameters of `config` -> the same parameters in `layout` (new arrays
    where the arrangement changes; jit it to keep a mesh's shardings)."""
    if not layout.unrolled:
        return params
    if (layout.joint_projections or layout.absorbed_queries) and is_quantized(params):
        raise InputError(f"{layout}: FP8-kept weights cannot be joined or folded together (their kernels take "
                         "[out, in] blocks)")
    params = dict(params)
    for group in ("dense_layers", "moe_layers"):
        if group in params:
            stacked = params[group]["layers"]
            count = jax.tree.leaves(stacked)[0].shape[0]
            params[group] = {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(count)}
    if layout.split_experts:
        params = _split_experts(params)
    if layout.inputs_first:  # kv_b_proj first: its per-head halves are 3-D, which the transpose leaves alone
        params = _per_head_up_projections(params, config)
        params = jax.tree_util.tree_map_with_path(_to_inputs_first, params,
                                                  is_leaf=lambda x: isinstance(x, QuantizedWeight))
    if layout.absorbed_queries:
        params = _absorbed_queries(params, config)
    if layout.joint_projections:
        params = _joint_projections(params)
    return params


def _split_experts(tree):
    """Every `experts` entry {gate_proj: [E, ., .], ...} -> {gate_proj: (E arrays [., .]), ...}."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if key == "experts":
            out[key] = {name: tuple(jax.tree.map(lambda a, e=e: a[e], value[name])
                                    for e in range(jax.tree.leaves(value[name])[0].shape[0]))
                        for name in EXPERT_WEIGHTS}
        else:
            out[key] = _split_experts(value)
    return out


def _per_head_up_projections(tree, config: ModelConfig):
    """Every `kv_b_proj` {weight: [H * (N + V), C]} -> {key: [H, N, C], value: [H, C, V]}."""
    if not isinstance(tree, dict):
        return tree
    if "kv_b_proj" in tree:
        key, value = up_projections(tree["kv_b_proj"]["weight"], config)
        tree = dict(tree, kv_b_proj={"key": key, "value": value})
    return {key: _per_head_up_projections(value, config) for key, value in tree.items()}


def _absorbed_queries(tree, config: ModelConfig):
    """Every attention's inputs-first query projection (`q_b_proj`, or `q_proj` without a query
    LoRA) [Q, H * (N + R)] with W_uk [H, N, C] folded into each head's nope columns ->
    [Q, H * (C + R)], each head's latent query then its rope part; kv_b_proj keeps only `value`."""
    if not isinstance(tree, dict):
        return tree
    tree = {key: _absorbed_queries(value, config) for key, value in tree.items()}
    name = "q_b_proj" if "q_b_proj" in tree else "q_proj"
    if "kv_b_proj" in tree:
        c, weight = config, tree[name]["weight"]
        per_head = weight.reshape(weight.shape[0], c.num_attention_heads, c.qk_head_dim).astype(jax.numpy.float32)
        nope, rope = per_head[..., :c.qk_nope_head_dim], per_head[..., c.qk_nope_head_dim:]
        key = tree["kv_b_proj"]["key"].astype(jax.numpy.float32)
        latent = (np.einsum("qhn,hnc->qhc", nope, key) if _on_host(nope)
                  else jax.numpy.einsum("qhn,hnc->qhc", nope, key, precision=jax.lax.Precision.HIGHEST))
        joined = _concatenate([latent, rope], axis=-1).reshape(weight.shape[0], -1).astype(weight.dtype)
        tree = dict(tree, **{name: {"weight": joined}, "kv_b_proj": {"value": tree["kv_b_proj"]["value"]}})
    return tree


def _joint_projections(tree):
    """Inputs-first weights that read the same input, side by side along out: every {q_a_proj,
    kv_a_proj_with_mqa} -> qkv_a_proj, every MLP's {gate_proj, up_proj} -> gate_up_proj, and every
    split expert's (tuples of E weights) likewise; stacked experts ([E, out, in]) stay apart."""
    if not isinstance(tree, dict):
        return tree
    tree = {key: _joint_projections(value) for key, value in tree.items()}
    join = lambda first, second: _concatenate([first, second], axis=1)  # noqa: E731
    if "q_a_proj" in tree:
        q_a, kv_a = tree.pop("q_a_proj"), tree.pop("kv_a_proj_with_mqa")
        tree["qkv_a_proj"] = {"weight": join(q_a["weight"], kv_a["weight"])}
    gate = tree.get("gate_proj")
    if isinstance(gate, dict):
        tree["gate_up_proj"] = {"weight": join(tree.pop("gate_proj")["weight"], tree.pop("up_proj")["weight"])}
    elif isinstance(gate, tuple):
        tree["gate_up_proj"] = tuple(map(join, tree.pop("gate_proj"), tree.pop("up_proj")))
    return tree


def _on_host(array) -> bool:
    return isinstance(array, np.ndarray)


def _concatenate(arrays, axis: int):
    """numpy's for host arrays (see `convert_on_host`), jax.numpy's otherwise."""
    return (np if all(map(_on_host, arrays)) else jax.numpy).concatenate(arrays, axis=axis)


def convert_on_host(params, layout: Layout, config: ModelConfig):
    """`convert` for parameters on a CPU without a mesh, in numpy (views where it can) and put back
    as JAX arrays: op by op in JAX, each of the few dozen shapes would compile its own small program
    first, which the first run of `jaxmtp generate` waits for (benchmarks/compile_cache.py)."""
    converted = convert(jax.tree.map(np.asarray, params), layout, config)
    return jax.tree.map(jax.numpy.asarray, converted)


def up_projections(kv_b, config: ModelConfig):
    """The checkpoint's kv_b_proj weight [H * (N + V), C] viewed per head, each product's input
    first -> W_uk [H, N, C] (q_nope -> latent), W_uv [H, C, V] (latent -> values)."""
    c = config
    per_head = kv_b.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return per_head[:, :c.qk_nope_head_dim], per_head[:, c.qk_nope_head_dim:].transpose(0, 2, 1)


def _to_inputs_first(path, leaf):
    """A dense projection weight [out, in] -> [in, out]; everything else unchanged."""
    names = [getattr(key, "key", None) for key in path]
    projection = names[-1] == "weight" and names[-2] not in OUT_IN_ONLY
    expert = "experts" in names  # split: one [out, in] per expert (a stacked [E, out, in] is 3-D)
    if isinstance(leaf, QuantizedWeight) or leaf.ndim != 2 or not (projection or expert):
        return leaf
    return leaf.T
