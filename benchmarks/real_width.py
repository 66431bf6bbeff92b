"""Decode speed at DeepSeek-V3 671B widths on one device: a plain decode step and a speculative
round at k = 1..3 at batch 1, 8 and 32, each with the bytes it reads and the fraction of the
device's memory bandwidth that achieves; then DeepSeek-V3.2 at the same widths with 32K and 128K
cached tokens, a decode step with sparse attention against the same model attending densely.

The model has the config's widths and fewer layers (default: 1 dense, 2 MoE and the MTP layer,
39 GB of FP8 weights), random FP8 weights made on the device (plan_on_device.py's
`random_parameters`, with unit norms and a router whose choices vary from token to token as they
do on text: `routed_like_text`), multiplied as `jaxmtp.quant.default_matmul` says (the FP8
kernels on Hopper). What is timed is the engine's own decode loop, `jaxmtp.decoding.advance`,
running --calls rounds at a fixed k from a state whose rows stand at --context cached tokens
(caches zero, greedy, no stop): k = 0 is a plain decode step; k > 0 is a whole round (draft
k - 1 tokens with the MTP layer, verify k + 1 in one main forward, accept, repair the MTP cache).
Seconds per round = the loop's wall time / --calls, median of --repeats loops after one that
compiles (its wall time kept as first_call_seconds). With the default 3 of DeepSeek-V3's 61
layers, the head (1.85 GB in bfloat16) is half of what a plain step at batch 1 reads, so the
figures describe these layers, not the whole model's step.

Bytes counted per round (`round_bytes`): every parameter a pass reads whole, in its stored dtype
(FP8 values and their float32 block scales), once per pass: the main model's but the embedding
table and the routed experts, then per MTP pass the MTP layer's own and the shared head; the
embedding rows of the pass's tokens; the routed experts the pass's tokens choose, counted per MoE
layer from the router's choices in one main pass and one MTP pass over random tokens at the same
positions (`routed_experts`; one token chooses exactly num_experts_per_tok); and the KV cache
attention reads: every cache slot of every layer ([B, slots, kv_lora_rank + qk_rope_head_dim]),
or with V3.2's sparse attention the indexer's keys of every slot plus the index_topk rows each
query gathers. Writes of new cache entries, activations and the loop's bookkeeping are not
counted. The GPU's grouped FP8 kernel may read more expert weights than the tokens chose (each
row tile loops over a contiguous range of groups, pallas_kernels/fp8_gemm.py), so the fraction of
bandwidth is that of the bytes a round needs, not of what the kernels fetch.

The fraction of bandwidth is bytes / seconds / the device's peak from PEAK_BANDWIDTH (keyed by
jax's device_kind); it is left out, and the JSON says why, on a CPU or a device not in the table.
From the plain step and the k = 1 round it computes the decode speedup that DeepSeek's published
acceptance implies (ACCEPTANCE); no acceptance for k > 1 is published, so none is computed.

--command-buffers sets XLA_FLAGS (before jax is imported) so that XLA:GPU records the decode
loop's control flow (while loops and conditionals) into command buffers (CUDA graphs) too;
benchmarks/accelerator.sh runs it beside the default (steps real_width, real_width_cmdbuf).
--tiny runs the same code at tiny widths on a CPU, where compiling takes most of the time
(tests/test_real_width.py runs a few of its rows).

    python benchmarks/real_width.py [--tiny] [--config deepseek_v3_671b] [--v32-config deepseek_v32_671b]
        [--layers 3] [--dense-layers 1] [--batches 1,8,32] [--ks 0,1,2,3] [--context 4096]
        [--cached 32768,131072] [--parts v3,v32] [--calls 20] [--repeats 5] [--matmul fp8|dequant]
        [--command-buffers] [--json OUT]
"""

import os
import sys

# Command types XLA:GPU records into command buffers: its defaults plus WHILE and CONDITIONAL (the
# decode loop's control flow). The whole list is given: in XLA's parser a "+TYPE,+TYPE" list adds
# only its first entry.
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"

if __name__ == "__main__" and "--command-buffers" in sys.argv[1:]:
    if "jax" in sys.modules:
        raise SystemExit("--command-buffers: XLA_FLAGS must be set before jax is imported; run this file as a script")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS}".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmtp  # noqa: E402
from decode_step import plain_static  # noqa: E402
from jaxmtp.cache import MLACache  # noqa: E402
from jaxmtp.config import config_file  # noqa: E402
from jaxmtp.decoding import NEVER, DecodeState, Drafts, Inputs, Stats, Tokens, advance, empty_caches  # noqa: E402
from jaxmtp.layout import prefix_lengths  # noqa: E402
from jaxmtp.moe import Router  # noqa: E402
from jaxmtp.params import module  # noqa: E402
from jaxmtp.provenance import write  # noqa: E402
from jaxmtp.quant import QuantizedWeight, default_matmul  # noqa: E402
from jaxmtp.sampling import SamplingParams  # noqa: E402
from jaxmtp.transformer import DeepseekV3  # noqa: E402
from plan_on_device import random_parameters  # noqa: E402

# Peak memory bandwidth in bytes/s by jax's device_kind, from NVIDIA's H200 and H100 datasheets
# (H200: 4.8 TB/s HBM3e; H100 SXM: 3.35 TB/s HBM3).
PEAK_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
PEAK_SOURCE = "NVIDIA's H200 and H100 datasheets: H200 4.8 TB/s, H100 SXM 3.35 TB/s"
# DeepSeek-V3 Technical Report (arXiv:2412.19437): the acceptance rate of the second token, which
# its MTP module predicts, is 85% to 90%; a round at k = 1 then yields 1.85 to 1.9 tokens on average.
ACCEPTANCE = (0.85, 0.90)
ACCEPTANCE_SOURCE = ("DeepSeek-V3 Technical Report (arXiv:2412.19437): acceptance of the second token 85-90% "
                     "(one MTP draft per round, k = 1); no acceptance is published for k > 1")
# The widths of --tiny: the shape of the 671B configs, small enough for a CPU; V3.2's
# indexer selects fewer keys than the tiny cached lengths of --tiny hold.
TINY_WIDTHS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
TINY_INDEXER = dict(index_n_heads=4, index_head_dim=16, index_topk=64)
TINY_DEFAULTS = dict(context=64, cached="256,512", calls=4, repeats=2)


# ----- the models ---------------------------------------------------------------------------


def widths(name: str, *, layers: int, dense_layers: int, tiny: bool) -> jaxmtp.ModelConfig:
    """The config `name` (a shipped config or a path) with `layers` main layers, the first
    `dense_layers` dense, and with --tiny the TINY_WIDTHS."""
    config = jaxmtp.ModelConfig.from_hf_config(config_file(name))
    if dense_layers > layers:
        raise SystemExit(f"--dense-layers {dense_layers} exceeds --layers {layers}")
    config = config.replace(num_hidden_layers=layers, first_k_dense_replace=dense_layers)
    if tiny:
        config = config.replace(**TINY_WIDTHS, **(TINY_INDEXER if config.has_indexer else {}))
    return config


def random_model(config: jaxmtp.ModelConfig, matmul: str) -> jaxmtp.Model:
    """Random FP8 parameters made on the device, multiplied by `matmul`, in the decode layout."""
    if config.quantization is None:
        raise SystemExit(f"{config.model_type}: the config keeps no FP8 weights (no quantization_config)")
    return jaxmtp.Model(config, routed_like_text(random_parameters(config), config)).with_matmul(matmul).decoding()


def routed_like_text(params, config: jaxmtp.ModelConfig):
    """Random parameters with unit norm weights and router weights of std hidden_size^-0.5, so that
    the router's logits vary from token to token (std about 1) and tokens choose different experts
    as text does: with every weight drawn at 0.02 the scores barely differ and the tokens of a
    batch choose nearly the same experts, which would read far fewer weights than text does."""
    def one(path, leaf):
        names = [str(getattr(key, "key", "")) for key in path]
        if isinstance(leaf, QuantizedWeight) or names[-1] != "weight":
            return leaf
        if names[-2].endswith("norm"):
            return jnp.ones_like(leaf)
        if names[-2] == "gate":
            key = jax.random.key(zlib.crc32(jax.tree_util.keystr(path).encode()))
            return (jax.random.normal(key, leaf.shape, jnp.float32) * config.hidden_size ** -0.5).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def dense_attention(model: jaxmtp.Model) -> jaxmtp.Model:
    """A V3.2 model with its indexers dropped: the same weights attending over the whole cache (V3's
    attention)."""
    def drop(tree):
        return {key: drop(value) for key, value in tree.items() if key != "indexer"} if isinstance(tree, dict) else tree

    config = model.config.replace(model_type="deepseek_v3", index_n_heads=0, index_head_dim=0, index_topk=0)
    return jaxmtp.Model(config, drop(model.params), layout=model.layout)


# ----- timing -------------------------------------------------------------------------------


def loop_static(model: jaxmtp.Model, k: int, cache_len: int):
    """The decode loop's static configuration: greedy rounds at k over `cache_len` slots."""
    return dataclasses.replace(plain_static(model, cache_len), k=k)


def slots_for(position: int, calls: int, k_max: int) -> int:
    """Cache slots for rounds from `position` on: `calls` rounds of up to k_max + 1 tokens each and
    a round's k_max + 1 writes past them, rounded up to a multiple of 256."""
    need = position + (calls + 1) * (k_max + 1)
    return -(-need // 256) * 256


def loop_state(static, batch: int, position: int) -> DecodeState:
    """A decode state whose rows stand at `position` (random tokens, zero caches, no draft yet),
    as the prefill of a prompt of `position` tokens would leave it but for the caches' contents,
    which do not change what a round costs."""
    c = static.config
    seq = jax.random.randint(jax.random.key(position), (batch, static.cache_len + static.k + 1), 0, c.vocab_size,
                             jnp.int32)
    n = jnp.full((batch,), position, jnp.int32)
    drafts = None
    if static.k:
        drafts = Drafts(cache=MLACache.zeros(c, None, batch, static.cache_len, static.dtype),
                        token=seq[:, position + 1], hidden=jnp.zeros((batch, c.hidden_size), static.dtype), probs=None)
    tokens = Tokens(seq=seq, logprobs=None, n=n, count=jnp.zeros_like(n), done=jnp.zeros((batch,), bool))
    return DecodeState(tokens=tokens, caches=empty_caches(static, batch), drafts=drafts, auto=None,
                       stats=Stats.zeros(batch, static.k), key=jax.random.key(1))


def loop_inputs(static, batch: int, position: int) -> Inputs:
    """Inputs for rounds that never stop: no stop sequence, no token limit within reach."""
    return Inputs(prompt=jnp.zeros((batch, 1), jnp.int32), lengths=jnp.full((batch,), position, jnp.int32),
                  limits=jnp.full((batch,), 1 << 30, jnp.int32), real=jnp.ones((batch,), bool),
                  stops=jnp.full((1, 1), NEVER, jnp.int32),
                  sampling=SamplingParams(jnp.float32(1e-6), jnp.int32(1), jnp.float32(1.0)), key=jax.random.key(2),
                  costs=jnp.ones((static.k + 1,), jnp.float32), force_k=jnp.int32(-1))


def round_seconds(model: jaxmtp.Model, static, *, batch: int, position: int, calls: int,
                  repeats: int) -> tuple[float, list[float]]:
    """Seconds per round of `advance` running `calls` rounds from a fresh state at `position`
    (made before the clock starts), for each of `repeats` loops after one that compiles -> (the
    first loop's whole wall time, compiling included; the repeats' seconds per round)."""
    inputs, halt, steps = loop_inputs(static, batch, position), jnp.zeros((batch,), bool), jnp.int32(calls)
    fresh = jax.jit(lambda: loop_state(static, batch, position))  # distinct buffers, which `advance` donates

    def once() -> float:
        state = jax.block_until_ready(fresh())
        start = time.perf_counter()
        jax.block_until_ready(advance(static, model.params, state, inputs, steps, halt))
        return (time.perf_counter() - start) / calls

    first = once() * calls
    return first, [once() for _ in range(repeats)]


# ----- bytes --------------------------------------------------------------------------------


def nbytes(tree) -> int:
    """Bytes of every array in a parameter tree (FP8 values and block scales both)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def without_experts(tree):
    """(the tree without its `experts` subtrees, the `experts` subtrees alone as a list)."""
    if not isinstance(tree, dict):
        return tree, []
    kept, experts = {}, []
    for key, value in tree.items():
        if key == "experts":
            experts.append(value)
        else:
            kept[key], inner = without_experts(value)
            experts += inner
    return kept, experts


@dataclasses.dataclass(frozen=True)
class Weights:
    """What a pass reads whole: main (the main model's parameters but the embedding table and the
    routed experts; the head included), mtp (the MTP layer's own but its routed experts, plus the
    shared head); expert: one routed expert's bytes; embed_row: one embedding row's."""

    main: int
    mtp: int
    expert: int
    embed_row: int

    @classmethod
    def of(cls, model: jaxmtp.Model) -> "Weights":
        c, params = model.config, model.params
        main, main_experts = without_experts({k: v for k, v in params.items() if k not in ("mtp", "embed_tokens")})
        mtp, mtp_experts = without_experts(params.get("mtp", {}))
        head = params["lm_head"] if "lm_head" in params else params["embed_tokens"]
        experts = c.n_routed_experts * (c.num_moe_layers + c.num_nextn_predict_layers)
        return cls(main=nbytes(main), mtp=nbytes(mtp) + nbytes(head) if c.has_mtp else 0,
                   expert=(nbytes(main_experts) + nbytes(mtp_experts)) // max(experts, 1),
                   embed_row=c.hidden_size * jnp.dtype(model.dtype).itemsize)


def kv_bytes(config: jaxmtp.ModelConfig, layout, *, batch: int, rows: int, slots: int, position: int, dtype) -> int:
    """Cache bytes one layer's attention reads in a pass of `rows` queries per batch row at
    positions from `position` (jaxmtp.mla.MLA): every slot (with prefix attention the prefix that
    holds the positions read), or with sparse attention the indexer's keys of every slot plus the
    index_topk rows that each query gathers (every slot where the queries together would gather
    more)."""
    size = jnp.dtype(dtype).itemsize
    read = slots
    if layout.prefix_attention:  # a one-row pass attends over the slots before its own entry
        last = position + rows - 1 - (rows == 1)
        read = next(n for n in prefix_lengths(slots) if n > last)
    whole = batch * read * config.cache_width * size
    if not config.has_indexer or slots <= config.index_topk:
        return whole
    keys = batch * slots * config.index_head_dim * size
    gathered = batch * rows * config.index_topk * config.cache_width * size
    return keys + (whole if rows * config.index_topk >= slots else gathered)


def routed_experts(model: jaxmtp.Model, static, *, batch: int, rows: int, position: int) -> dict:
    """Distinct routed experts chosen per MoE layer by the tokens of passes of 1..rows tokens per
    batch row: one main pass and one MTP pass over random tokens at positions position.., the
    router's choices recorded (a causal pass's first t rows are those of a pass of t rows).
    -> {"main": [[per MoE layer] for t = 1..rows], "mtp": [for t = 1..rows]}. One token chooses
    exactly num_experts_per_tok, so batch 1 at one row needs no pass."""
    c = model.config
    if batch * rows == 1:
        return {"main": [[c.num_experts_per_tok] * c.num_moe_layers], "mtp": [c.num_experts_per_tok] * c.has_mtp}
    flax_module = module(c, static.dtype, True, static.layout)
    routers = lambda mdl, method: isinstance(mdl, Router) and method == "__call__"  # noqa: E731

    @jax.jit
    def choices(params, tokens, positions, caches, mtp_cache):
        (_, hidden, _), main = flax_module.apply({"params": params}, tokens, positions, caches,
                                                 capture_intermediates=routers, mutable=["intermediates"])
        _, mtp = flax_module.apply({"params": params}, hidden, tokens, positions, mtp_cache, method=DeepseekV3.mtp_step,
                                   capture_intermediates=routers, mutable=["intermediates"])
        return chosen_experts(main["intermediates"]), chosen_experts(mtp["intermediates"])

    tokens = jax.random.randint(jax.random.key(3), (batch, rows), 0, c.vocab_size, jnp.int32)
    positions = position + jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (batch, rows))
    mtp_cache = MLACache.zeros(c, None, batch, static.cache_len, static.dtype)
    main, mtp = choices(model.params, tokens, positions, empty_caches(static, batch), mtp_cache)

    def distinct(layers, t):  # each [B * rows, K] -> the first t rows of every batch row
        return [len(np.unique(np.asarray(e).reshape(batch, rows, -1)[:, :t])) for e in layers]

    return {"main": [distinct(main, t) for t in range(1, rows + 1)],
            "mtp": [sum(distinct(mtp, t)) for t in range(1, rows + 1)]}


def chosen_experts(intermediates) -> list:
    """The expert indices [N, K] that every Router recorded, one per layer (a scanned stack's
    [L, N, K] split into its layers), in the tree's order."""
    layers = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        names = [str(getattr(key, "key", "")) for key in path]
        if "gate" in names and jnp.issubdtype(leaf.dtype, jnp.integer):
            layers += list(leaf) if leaf.ndim == 3 else [leaf]
    return layers


def pass_bytes(weights: Weights, experts: int, kv: int, tokens: int, *, mtp: bool) -> int:
    """A main (or MTP) pass's bytes: the weights it reads whole, `experts` routed experts, the
    embedding rows of `tokens` tokens and `kv` cache bytes."""
    return (weights.mtp if mtp else weights.main) + experts * weights.expert + tokens * weights.embed_row + kv


def round_bytes(model: jaxmtp.Model, static, weights: Weights, chosen: dict, *, batch: int, k: int,
                position: int) -> dict:
    """Bytes of a round at k (see the module's docstring): the main pass over k + 1 rows, k - 1
    MTP drafts of one row and the MTP repair over k + 1 rows. -> its parts and their sum."""
    c = model.config
    layers = c.num_dense_layers + c.num_moe_layers
    kv = lambda rows: kv_bytes(c, static.layout, batch=batch, rows=rows, slots=static.cache_len,  # noqa: E731
                               position=position, dtype=static.dtype)
    parts = {"main": pass_bytes(weights, sum(chosen["main"][k]), layers * kv(k + 1), batch * (k + 1), mtp=False)}
    if k:
        parts["mtp_drafts"] = (k - 1) * pass_bytes(weights, chosen["mtp"][0], kv(1), batch, mtp=True)
        parts["mtp_repair"] = pass_bytes(weights, chosen["mtp"][k], kv(k + 1), batch * (k + 1), mtp=True)
    experts = sum(chosen["main"][k]) + ((k - 1) * chosen["mtp"][0] + chosen["mtp"][k] if k else 0)
    cache = layers * kv(k + 1) + ((k - 1) * kv(1) + kv(k + 1) if k else 0)
    return {"bytes": sum(parts.values()), "parts": parts, "of_which_kv_cache": cache,
            "of_which_routed_experts": experts * weights.expert}


# ----- the measurements ---------------------------------------------------------------------


def peak_bandwidth() -> tuple[float | None, str]:
    """(peak bytes/s of the default device or None, where that comes from or why there is none)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None, "a CPU: no peak bandwidth is tabled, so no fraction is given"
    peak = PEAK_BANDWIDTH.get(device.device_kind)
    if peak is None:
        return None, f"{device.device_kind!r} is not in PEAK_BANDWIDTH, so no fraction is given"
    return peak, PEAK_SOURCE


def measured(seconds: list[float], size: dict, peak: float | None) -> dict:
    median = statistics.median(seconds)
    return {"seconds": median, "bytes": size["bytes"], "bytes_parts": size["parts"],
            "kv_cache_bytes": size["of_which_kv_cache"], "routed_expert_bytes": size["of_which_routed_experts"],
            "fraction_of_peak": None if peak is None else size["bytes"] / median / peak}


def speedups(rows: list[dict]) -> list[dict]:
    """Per batch, the decode speedup of k = 1 over plain steps at DeepSeek's published acceptance:
    (1 + acceptance) tokens per round of `seconds` against one token per plain step."""
    out = []
    for plain in (r for r in rows if r["k"] == 0):
        one = next((r for r in rows if r["k"] == 1 and r["batch"] == plain["batch"]), None)
        if one is not None:
            out += [{"batch": plain["batch"], "acceptance": p, "mean_accepted_length": 1 + p,
                     "speedup": (1 + p) * plain["seconds"] / one["seconds"]} for p in ACCEPTANCE]
    return out


def v3_part(args, config, figures, raw, peak, save):
    """Plain steps and rounds at each batch and k."""
    model = random_model(config, args.matmul)
    weights = Weights.of(model)
    k_max = max(args.ks)
    cache_len = slots_for(args.context, args.calls, k_max)
    figures["v3"] = {"config": args.config, "cache_slots": cache_len, "weights": dataclasses.asdict(weights),
                     "layout": str(model.layout), "rows": [], "speedup_at_published_acceptance": []}
    for batch in args.batches:
        chosen = routed_experts(model, loop_static(model, 0, cache_len), batch=batch, rows=k_max + 1,
                                position=args.context)
        for k in args.ks:
            static = loop_static(model, k, cache_len)
            first, seconds = round_seconds(model, static, batch=batch, position=args.context, calls=args.calls,
                                           repeats=args.repeats)
            size = round_bytes(model, static, weights, chosen, batch=batch, k=k, position=args.context)
            experts = {"main_per_moe_layer": chosen["main"][k]}
            if k:
                experts.update(mtp_draft=chosen["mtp"][0] if k > 1 else None, mtp_repair=chosen["mtp"][k])
            row = {"batch": batch, "k": k, **measured(seconds, size, peak), "routed_experts_chosen": experts,
                   "first_call_seconds": first}
            figures["v3"]["rows"].append(row)
            raw[f"v3/{batch}/{k}"] = seconds
            figures["v3"]["speedup_at_published_acceptance"] = speedups(figures["v3"]["rows"])
            print(f"V3 batch {batch:2d} k={k}: {row['seconds'] * 1e3:8.3f} ms  {size['bytes'] / 1e9:7.3f} GB"
                  + ("" if peak is None else f"  {row['fraction_of_peak']:.3f} of peak"), flush=True)
            save()


def v32_part(args, config, figures, raw, peak, save):
    """A plain decode step with sparse attention and with the indexer dropped, at each cached length."""
    sparse = random_model(config, args.matmul)
    models = {"sparse": sparse, "dense": dense_attention(sparse)}
    figures["v32"] = {"config": args.v32_config, "index_topk": config.index_topk, "layout": str(sparse.layout),
                      "rows": []}
    for cached in args.cached:
        for batch in args.v32_batches:
            row = {"cached_tokens": cached, "batch": batch}
            for name, model in models.items():
                static = loop_static(model, 0, slots_for(cached, args.calls, 0))
                first, seconds = round_seconds(model, static, batch=batch, position=cached, calls=args.calls,
                                               repeats=args.repeats)
                chosen = routed_experts(model, static, batch=batch, rows=1, position=cached)
                size = round_bytes(model, static, Weights.of(model), chosen, batch=batch, k=0, position=cached)
                row[name] = dict(measured(seconds, size, peak), first_call_seconds=first)
                raw[f"v32/{cached}/{batch}/{name}"] = seconds
            row["dense_over_sparse"] = row["dense"]["seconds"] / row["sparse"]["seconds"]
            figures["v32"]["rows"].append(row)
            print(f"V3.2 {cached:6d} cached, batch {batch}: sparse {row['sparse']['seconds'] * 1e3:8.3f} ms  "
                  f"dense {row['dense']['seconds'] * 1e3:8.3f} ms  dense / sparse {row['dense_over_sparse']:.2f}",
                  flush=True)
            save()


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny widths (TINY_WIDTHS), for a CPU")
    parser.add_argument("--config", default="deepseek_v3_671b")
    parser.add_argument("--v32-config", default="deepseek_v32_671b")
    parser.add_argument("--layers", type=int, default=3, help="main layers")
    parser.add_argument("--dense-layers", type=int, default=1, help="of which dense (the first)")
    parser.add_argument("--batches", type=numbers, default=[1, 8, 32])
    parser.add_argument("--ks", type=numbers, default=[0, 1, 2, 3], help="k of the rounds (0: plain decode step)")
    parser.add_argument("--context", type=int, help="cached tokens before the V3 rounds (default 4096)")
    parser.add_argument("--cached", type=numbers, help="V3.2's cached tokens (default 32768,131072)")
    parser.add_argument("--v32-batches", type=numbers, default=[1])
    parser.add_argument("--parts", default="v3,v32", help="v3, v32 or both")
    parser.add_argument("--calls", type=int, help="rounds per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, help="timed loops (default 5)")
    parser.add_argument("--matmul", choices=("fp8", "dequant"), help="how FP8 weights are multiplied; default: the "
                        "platform's (jaxmtp.quant.default_matmul)")
    parser.add_argument("--command-buffers", action="store_true",
                        help=f"record loops and conditionals into command buffers ({COMMAND_BUFFERS})")
    parser.add_argument("--json", help="write the figures and raw times, with their provenance, here")
    args = parser.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else dict(context=4096, cached="32768,131072", calls=20, repeats=5)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, numbers(value) if name == "cached" else value)
    args.matmul = args.matmul or default_matmul()
    args.parts = args.parts.split(",")
    if not set(args.parts) <= {"v3", "v32"}:
        raise SystemExit(f"--parts: v3 and/or v32, found {','.join(args.parts)}")
    return args


def main(argv=None):
    args = arguments(argv)
    peak, peak_note = peak_bandwidth()
    figures = {"widths": "tiny" if args.tiny else "config", "layers": args.layers, "dense_layers": args.dense_layers,
               "matmul": args.matmul, "context": args.context, "calls": args.calls,
               "command_buffers": COMMAND_BUFFERS in os.environ.get("XLA_FLAGS", ""),
               "device_kind": jax.devices()[0].device_kind, "peak_bytes_per_s": peak, "peak_source": peak_note,
               "acceptance_source": ACCEPTANCE_SOURCE, "complete": False}
    raw = {}

    def save():  # after every row, whole or not at all, so that a run cut short keeps what it measured
        if args.json:
            write(args.json + ".partial", "real_width", figures, raw, args.repeats)
            os.replace(args.json + ".partial", args.json)

    print(f"{jax.devices()[0].device_kind}, matmul {args.matmul}, {args.layers} layers ({args.dense_layers} dense) "
          f"and MTP; {args.calls} rounds per loop, median of {args.repeats} loops; peak: {peak_note}", flush=True)
    if "v3" in args.parts:
        v3_part(args, widths(args.config, layers=args.layers, dense_layers=args.dense_layers, tiny=args.tiny),
                figures, raw, peak, save)
    if "v32" in args.parts:
        v32_part(args, widths(args.v32_config, layers=args.layers, dense_layers=args.dense_layers, tiny=args.tiny),
                 figures, raw, peak, save)
    figures["complete"] = True
    save()
    for s in figures.get("v3", {}).get("speedup_at_published_acceptance", []):
        print(f"batch {s['batch']:2d}, k = 1 at acceptance {s['acceptance']:.2f}: {s['speedup']:.2f}x plain decoding")


if __name__ == "__main__":
    main()
