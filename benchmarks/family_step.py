"""DeepSeek-V3, V3.2 and V4 at the same tiny widths: one decode step (the main forward at 1 row)
and one verify pass (4 rows, k = 3) with 8K, 32K and 128K tokens in the cache, random weights,
batch 1.

V3 attends to every cached token. V3.2's indexer scores every cached token and the attention reads
the index_topk it selects. V4's layers attend to a 128-position window plus compressed entries:
a CSA layer's indexer scores one entry per 4 tokens and keeps 512 of them, an HCA layer attends
to one entry per 128 tokens. The widths keep the cache per token per layer comparable (V3's
kv_lora_rank + qk_rope_head_dim = 160 = V4's head_dim) and the indexers alike (8 heads of 32).
Both passes here are few-query passes, in which jaxmtp's V4 gathers each query's selected CSA
entries (jaxmtp.models.deepseek_v4.attention.GATHER_QUERIES).

    python benchmarks/family_step.py [--tokens 8192,32768,131072] [--rows 1,4] [--calls 10]
        [--repeats 5] [--json benchmarks/results/family_step.json]
"""

import argparse
import statistics

import jax
import jax.numpy as jnp

import sparse_attention
from jaxmtp.models.deepseek_v4 import CSA, HCA, V4Config, init_v4
from jaxmtp.models.deepseek_v4.transformer import DeepseekV4, new_caches
from jaxmtp.provenance import write
from timing import seconds_per_call

# sparse_attention.py's V3 and V3.2 widths, with positions for 128K cached tokens.
V3 = dict(sparse_attention.V3, max_position_embeddings=262144)
V32 = dict(sparse_attention.V32, max_position_embeddings=262144)
V4 = V4Config(vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
              q_lora_rank=192, n_routed_experts=8, num_experts_per_tok=2, layer_types=(CSA, HCA),
              mlp_layer_types=("moe", "moe"), head_dim=160, qk_rope_head_dim=32, o_groups=4, o_lora_rank=64,
              index_n_heads=8, index_head_dim=32, index_topk=512, max_position_embeddings=262144)


def v4_times(tokens: int, rows: list[int], calls: int, repeats: int) -> dict[int, list[float]]:
    """Seconds per call of V4's main forward (its caches stored by position) at each row count."""
    model = init_v4(V4)
    caches = new_caches(V4, 1, tokens + 1024, 4)
    times = {}
    for t in rows:
        def loop(params, caches, t=t):
            def body(i, carry):
                caches, acc = carry
                fed = (jnp.arange(t, dtype=jnp.int32)[None] * 131 + 5 + acc.astype(jnp.int32) % 2) % V4.vocab_size
                start = jnp.full((1,), tokens, jnp.int32) + i % 32
                logits, _, _, caches = DeepseekV4(V4).apply({"params": params}, fed, start, jnp.full((1,), t), caches)
                return caches, acc + logits[0, 0, 0]
            return jax.lax.fori_loop(0, calls, body, (caches, jnp.float32(0)))[1]

        times[t] = seconds_per_call(jax.jit(loop), (model.params, caches), calls, repeats)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768,131072", help="cached tokens before the step")
    parser.add_argument("--rows", default="1,4", help="rows per pass: 1 (decode step), k + 1 (verify pass)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures and raw times, with their provenance, here")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    figures, raw = [], {}
    print(f"main forward, ms per call (median of {args.repeats} loops of {args.calls} calls), "
          f"{jax.devices()[0].device_kind}")
    for tokens in (int(n) for n in args.tokens.split(",")):
        times = {"v3": sparse_attention.step_times(V3, tokens, rows, args.calls, args.repeats),
                 "v32": sparse_attention.step_times(V32, tokens, rows, args.calls, args.repeats),
                 "v4": v4_times(tokens, rows, args.calls, args.repeats)}
        for t in rows:
            ms = {name: statistics.median(times[name][t]) * 1e3 for name in times}
            figures.append({"cached_tokens": tokens, "rows": t, **{f"{name}_ms": value for name, value in ms.items()}})
            raw[f"{tokens}/{t}"] = {f"{name}_s": times[name][t] for name in times}
            print(f"{tokens:7d} tokens, {t} row{'s' if t > 1 else ' '}: V3 {ms['v3']:8.3f}   V3.2 {ms['v32']:8.3f}   "
                  f"V4 {ms['v4']:8.3f}", flush=True)
    if args.json:
        write(args.json, "family_step", figures, raw, args.repeats)


if __name__ == "__main__":
    main()
