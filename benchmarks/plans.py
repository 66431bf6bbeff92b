"""Per-device memory of the large models at real scale, as `jaxmtp plan` computes it (AOT compile
for emulated devices, XLA's memory analysis), for the scenarios the docs quote: each compiles the
speculative_k="auto" loop with sampling that `jaxmtp generate` runs by default and the fixed k = 3
loop, and counts the larger against the memory JAX's allocator may hold on each device at its
default settings (75% of a GPU's). With --fit, the longest cache that fits within an H200's limit
per batch on one 8-GPU node (several compiles).

    XLA_FLAGS=--xla_force_host_platform_device_count=64 python benchmarks/plans.py \
        [--only NAME,..] [--fit] [--fraction F] [--json benchmarks/results/plans.json]
"""

import argparse
import os

import jax.numpy as jnp

import jaxmtp
from jaxmtp.plan import DEVICES, AllocatorSettings, default_loops, fit, largest, memory_limit, plans, total_bytes
from jaxmtp.provenance import write

# name: (config, mesh (data, expert, tensor), batch, cache tokens, prompt tokens); k = 3 beside the auto
# loop (Kimi K2, which has no MTP layer: plain decoding), sampling with top-k and top-p, FP8 kept and
# multiplied by the W8A8 kernels.
SCENARIOS = {
    "v3_64_devices_batch1": ("deepseek_v3_671b", (8, 1, 8), 1, 4096, 256),
    "v3_one_node_batch8_32k": ("deepseek_v3_671b", (8, 1, 1), 8, 32768, 32768),
    "v3_64_devices_batch8_32k": ("deepseek_v3_671b", (8, 1, 8), 8, 32768, 8192),
    "v3_one_node_batch8_128k": ("deepseek_v3_671b", (8, 1, 1), 8, 131072, 131072),
    "v32_one_node_batch8_128k": ("deepseek_v32_671b", (8, 1, 1), 8, 131072, 131072),
    "kimi_k2_64_devices_batch8_32k": ("kimi_k2", (8, 1, 8), 8, 32768, 8192),
}
K = 3


def config(name: str) -> jaxmtp.ModelConfig:
    return jaxmtp.ModelConfig.from_hf_config(os.path.join(jaxmtp.CONFIGS, name + ".json"))


def summary(results: list[dict], settings: AllocatorSettings) -> dict:
    """The figures the docs show of a plan's loops (the largest temporaries' op names stay in raw):
    the largest loop's, every loop's total, and the fit within each device's limit under `settings`."""
    figures = largest(results)
    keep = ("devices", "mesh", "batch", "cache_len", "prompt_len", "prefill_chunk", "k", "auto", "loop", "matmul",
            "parameter_bytes_per_device", "cache_bytes_per_device", "xla_temp_bytes", "compile_seconds")
    out = {name: figures[name] for name in keep}
    total = total_bytes(figures)
    out["total_bytes_per_device"] = total
    out["loops"] = [{"loop": r["loop"], "k": r["k"], "auto": r["auto"], "total_bytes_per_device": total_bytes(r),
                     "xla_temp_bytes": r["xla_temp_bytes"], "compile_seconds": r["compile_seconds"]} for r in results]
    limits = [memory_limit(device, settings) for device in DEVICES.values()]
    out["limits"] = {limit.device.label: {"limit_bytes": limit.bytes, "fraction": limit.fraction, "how": limit.how,
                                          "fits": total <= limit.bytes, "verdict": limit.verdict(total)}
                     for limit in limits}
    out["fits"] = {label: limit["fits"] for label, limit in out["limits"].items()}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated scenario names (default: all)")
    parser.add_argument("--fit", action="store_true", help="also DeepSeek-V3 671B's fit table on data=8 H200s")
    parser.add_argument("--fraction", type=float,
                        help="count against this XLA_CLIENT_MEM_FRACTION of a GPU's memory (default: JAX's, 0.75)")
    parser.add_argument("--json", help="write the figures, with their provenance, here")
    args = parser.parse_args()
    if args.fraction is not None and not 0 < args.fraction <= 1:
        parser.error(f"--fraction {args.fraction}: expected a fraction of a GPU's memory in (0, 1]")
    # JAX's settings as given here, not this process's environment: the figures say what they assume.
    settings = AllocatorSettings(fraction=args.fraction)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    figures, raw = {}, {}
    for name in names:
        model, (data, expert, tensor), batch, cache, prompt = SCENARIOS[name]
        loops = default_loops(config(model), K if config(model).has_mtp else 0)
        results = plans(config(model), data, expert, tensor, batch, cache, prompt, loops=loops, matmul="fp8")
        figures[name] = dict(summary(results, settings), config=model)
        raw[name] = results
        for r in results:
            print(f"{name}, {r['loop']}: {total_bytes(r) / 1e9:.2f} GB per device (temporaries "
                  f"{r['xla_temp_bytes'] / 1e9:.2f} GB), compiled in {r['compile_seconds']:.0f} s", flush=True)
    if args.fit:
        limit = memory_limit(DEVICES["h200"], settings)
        model = config("deepseek_v3_671b")
        results = fit(model, 8, 1, 1, limit.bytes, K, jnp.bfloat16, "fp8", loops=default_loops(model, K))
        figures["fit_h200_v3_one_node"] = [dict(r, config="deepseek_v3_671b", limit_bytes=limit.bytes,
                                                limit=limit.describe(), total_bytes_per_device=total_bytes(r))
                                           for r in _without_temporaries(results)]
        raw["fit_h200_v3_one_node"] = results
        for r in results:
            print(f"fit within {limit.describe()}: batch {r['batch']}, cache {r['cache_len']} tokens, "
                  f"{total_bytes(r) / 1e9:.2f} GB", flush=True)
    if args.json:
        write(args.json, "plans", figures, raw, repeats=1)


def _without_temporaries(results: list[dict]) -> list[dict]:
    """fit's results without the largest temporaries' op names (kept in raw)."""
    return [{name: value for name, value in r.items() if name != "largest_temporaries"} for r in results]


if __name__ == "__main__":
    main()
