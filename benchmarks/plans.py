"""Per-device memory of the large models at real scale, as `jaxmtp plan` computes it (AOT compile
for emulated devices, XLA's memory analysis), for the scenarios the docs quote; with --fit, the
longest cache that fits an H200 per batch on one 8-GPU node (several compiles).

    XLA_FLAGS=--xla_force_host_platform_device_count=64 python benchmarks/plans.py \
        [--only NAME,..] [--fit] [--json benchmarks/results/plans.json]
"""

import argparse
import os

import jax.numpy as jnp

import jaxmtp
from jaxmtp.plan import DEVICES, DEVICE_NAMES, fit, plan, total_bytes
from jaxmtp.provenance import write

# name: (config, mesh (data, expert, tensor), batch, cache tokens, prompt tokens); k = 3 (Kimi K2, which
# has no MTP layer: 0), FP8 kept and multiplied by the W8A8 kernels.
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


def summary(figures: dict) -> dict:
    """The figures the docs show (the largest temporaries' op names stay in raw)."""
    keep = ("devices", "mesh", "batch", "cache_len", "prompt_len", "prefill_chunk", "k", "matmul",
            "parameter_bytes_per_device", "cache_bytes_per_device", "xla_temp_bytes", "compile_seconds")
    out = {name: figures[name] for name in keep}
    out["total_bytes_per_device"] = total_bytes(figures)
    out["fits"] = {device: total_bytes(figures) <= capacity for device, capacity in DEVICES.items()}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated scenario names (default: all)")
    parser.add_argument("--fit", action="store_true", help="also DeepSeek-V3 671B's fit table on data=8 H200s")
    parser.add_argument("--json", help="write the figures, with their provenance, here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    figures, raw = {}, {}
    for name in names:
        model, (data, expert, tensor), batch, cache, prompt = SCENARIOS[name]
        k = K if config(model).has_mtp else 0
        result = plan(config(model), data, expert, tensor, batch, cache, prompt, k, jnp.bfloat16, "fp8")
        figures[name] = dict(summary(result), config=model)
        raw[name] = result
        print(f"{name}: {figures[name]['total_bytes_per_device'] / 1e9:.2f} GB per device "
              f"(temporaries {result['xla_temp_bytes'] / 1e9:.2f} GB), compiled in {result['compile_seconds']:.0f} s",
              flush=True)
    if args.fit:
        results = fit(config("deepseek_v3_671b"), 8, 1, 1, DEVICES[DEVICE_NAMES["h200"]], K, jnp.bfloat16, "fp8")
        figures["fit_h200_v3_one_node"] = [dict(summary(r), config="deepseek_v3_671b") for r in results]
        raw["fit_h200_v3_one_node"] = results
        for r in results:
            print(f"fit H200: batch {r['batch']}, cache {r['cache_len']} tokens, {total_bytes(r) / 1e9:.2f} GB", flush=True)
    if args.json:
        write(args.json, "plans", figures, raw, repeats=1)


if __name__ == "__main__":
    main()
