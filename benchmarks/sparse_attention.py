"""DeepSeek-V3 against DeepSeek-V3.2 (DeepSeek Sparse Attention) at the same widths: one decode
step (the main forward at 1 row) and one verify pass (4 rows, k = 3) with 2K, 8K and 32K tokens
in the cache, random weights, batch 1.

V3 attends to every cached token; V3.2's indexer scores every cached token with its few small
heads and the attention then reads only the index_topk (2048) it selects, so the step's cost
should stop growing with the cache as fast as V3's. The widths keep DeepSeek's proportions where
it matters here: the indexer's per-key work (heads x head dim) about a tenth of the absorbed
attention's (heads x (kv_lora_rank + qk_rope_head_dim)).

    python benchmarks/sparse_attention.py [--tokens 2048,8192,32768] [--rows 1,4] [--calls 20]
        [--repeats 5] [--json benchmarks/results/sparse_attention.json]
"""

import argparse
import statistics

import jax

import jaxmtp
from decode_step import plain_static, step_loops
from jaxmtp.decoding import empty_caches
from jaxmtp.provenance import write
from timing import seconds_per_call

V3 = dict(model_type="deepseek_v3", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
          num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=192, kv_lora_rank=128,
          qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
          n_group=1, topk_group=1, num_nextn_predict_layers=1, max_position_embeddings=65536)
V32 = dict(V3, model_type="deepseek_v32", index_n_heads=8, index_head_dim=32, index_topk=2048)


def step_times(config: dict, tokens: int, rows: list[int], calls: int, repeats: int) -> dict[int, list[float]]:
    """Seconds per call of the main forward at each row count, at position `tokens` of a cache of
    `tokens` + 1024 slots: `repeats` timed loops of `calls` calls after one that compiles."""
    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(config)).decoding()
    static = plain_static(model, tokens + 1024)
    return {t: seconds_per_call(jax.jit(step_loops(static, t, calls, start=tokens)[0]),
                                (model.params, empty_caches(static, 1)), calls, repeats) for t in rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192,32768", help="cached tokens before the step")
    parser.add_argument("--rows", default="1,4", help="rows per pass: 1 (decode step), k + 1 (verify pass)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures and raw times, with their provenance, here")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    figures, raw = [], {}
    print(f"main forward, ms per call (median of {args.repeats} loops of {args.calls} calls), "
          f"{jax.devices()[0].device_kind}; V3.2 selects {V32['index_topk']} keys")
    for tokens in (int(n) for n in args.tokens.split(",")):
        dense, sparse = step_times(V3, tokens, rows, args.calls, args.repeats), step_times(V32, tokens, rows,
                                                                                          args.calls, args.repeats)
        for t in rows:
            v3, v32 = statistics.median(dense[t]) * 1e3, statistics.median(sparse[t]) * 1e3
            figures.append({"cached_tokens": tokens, "rows": t, "v3_ms": v3, "v32_ms": v32, "v3_over_v32": v3 / v32})
            raw[f"{tokens}/{t}"] = {"v3_s": dense[t], "v32_s": sparse[t]}
            print(f"{tokens:6d} tokens, {t} row{'s' if t > 1 else ' '}: V3 {v3:8.3f}   V3.2 {v32:8.3f}   "
                  f"V3 / V3.2 {v3 / v32:5.2f}", flush=True)
    if args.json:
        write(args.json, "sparse_attention", figures, raw, args.repeats)


if __name__ == "__main__":
    main()
