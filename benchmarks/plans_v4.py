"""DeepSeek-V4-Flash and V4-Pro: the longest cache that fits per batch on H200 and TPU v6e meshes,
as `jaxmtp plan --fit` searches it (AOT compiles of the prefill chunk and the round for emulated
devices, XLA's memory analysis; jaxmtp.models.deepseek_v4.plan), FP8 linears and FP4 experts kept
as a released checkpoint loads, counting the speculative_k="auto" loop with sampling (rounds of up
to 3 drafts) against the memory JAX may hold on each device at its default settings.

    XLA_FLAGS=--xla_force_host_platform_device_count=64 python benchmarks/plans_v4.py \
        [--only NAME,..] [--json benchmarks/results/plans_v4.json]
    XLA_FLAGS=--xla_force_host_platform_device_count=128 python benchmarks/plans_v4.py \
        --only pro_v6e_x128 --json benchmarks/results/plans_v4_x128.json

With --depths, instead: a round's temporaries (k = 2, greedy, batch 8, 8K caches, `expert=8`) of
V4-Flash cut to its first 5, 9, 17 and all 43 layers, which a loop over each segment's repeats keeps
from growing with depth (benchmarks/results/plans_v4_depth.json).
"""

import argparse
import os

import jax.numpy as jnp

import jaxmtp
from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.models.deepseek_v4.config import V4Config
from jaxmtp.models.deepseek_v4.plan import plans
from jaxmtp.plan import DEVICES, AllocatorSettings, default_loops, fit, memory_limit, total_bytes
from jaxmtp.provenance import write

# name: (config, mesh (data, expert, tensor), device, prefill chunk). The routed experts split over
# data (and their intermediate dim over tensor), attention rows over data, heads and the vocabulary
# over tensor. The CPU expands a prefill chunk's grouped expert matmuls into dense products over
# every local expert, which grows with the chunk and the local experts; at the default chunk (512)
# nothing fitted these three meshes, so they prefill in chunks of 64.
FITS = {
    "flash_h200_x8": ("deepseek_v4_flash", (8, 1, 1), "h200", DEFAULT_PREFILL_CHUNK),
    "flash_v6e_x16": ("deepseek_v4_flash", (4, 1, 4), "v6e", 64),
    "pro_h200_x16": ("deepseek_v4_pro", (2, 1, 8), "h200", 64),
    "pro_v6e_x64": ("deepseek_v4_pro", (8, 1, 8), "v6e", 64),
    # measured on its own (128 emulated devices): benchmarks/results/plans_v4_x128.json
    "pro_v6e_x128": ("deepseek_v4_pro", (16, 1, 8), "v6e", 64),
}
DEFAULT = [name for name in FITS if not name.endswith("x128")]
K = 3  # auto's most drafts per round
ROWS = 2  # batches of data x 1 and 2 rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (default: all)")
    parser.add_argument("--json", help="write the figures, with their provenance, here")
    parser.add_argument("--depths", action="store_true", help="a round's temporaries by depth instead")
    args = parser.parse_args()
    if args.depths:
        return depths(args.json)
    settings = AllocatorSettings()  # JAX's defaults, not this process's environment
    figures, raw = {}, {}
    for name in args.only.split(",") if args.only else DEFAULT:
        model, (data, expert, tensor), device, chunk = FITS[name]
        config = V4Config.from_hf_config(os.path.join(jaxmtp.CONFIGS, model + ".json"))
        limit = memory_limit(DEVICES[device], settings)

        compiled = []

        def shown(f, name=name, compiled=compiled):
            compiled.append(f)
            print(f"{name}: batch {f['batch']}, cache {f['cache_len']}: {total_bytes(f) / 1e9:.2f} GB per device "
                  f"({f['largest_program']} largest; compiled in {f['compile_seconds']:.0f} s)", flush=True)

        results = fit(config, data, expert, tensor, limit.bytes, K, jnp.bfloat16, "dequant", chunk, ROWS,
                      progress=shown, loops=default_loops(config, K, "auto"), planner=plans)
        figures[name] = {"config": model, "mesh": {"data": data, "expert": expert, "tensor": tensor},
                         "devices": data * expert * tensor, "device": DEVICES[device].label,
                         "limit": limit.describe(), "limit_bytes": limit.bytes, "prefill_chunk": chunk,
                         "parameter_bytes_per_device": compiled[0]["parameter_bytes_per_device"],
                         "compiled": [{key: f[key] for key in ("batch", "cache_len", "xla_temp_bytes", "programs")}
                                      | {"total_bytes_per_device": total_bytes(f)} for f in compiled],
                         "rows": [{key: r[key] for key in ("batch", "cache_len", "parameter_bytes_per_device",
                                                           "cache_bytes_per_device", "xla_temp_bytes",
                                                           "largest_program", "loop", "prefill_chunk",
                                                           "compile_seconds")}
                                  | {"total_bytes_per_device": total_bytes(r)} for r in results]}
        raw[name] = results
        print(f"{name}: {len(results)} batches fit within {limit.describe()}", flush=True)
    if args.json:
        write(args.json, "plans_v4", figures, raw, repeats=1)


def depths(json_path):
    config = V4Config.from_hf_config(os.path.join(jaxmtp.CONFIGS, "deepseek_v4_flash.json"))
    rows, raw = [], []
    for layers in (5, 9, 17, config.num_hidden_layers):
        cut = config.replace(num_hidden_layers=layers, layer_types=config.layer_types[:layers],
                             mlp_layer_types=config.mlp_layer_types[:layers])
        (r,) = plans(cut, 1, 8, 1, 8, 8192, 8192, loops=default_loops(cut, 2, "fixed", greedy=True))
        rows.append({"layers": layers, "temp_bytes": r["program_temp_bytes"], "total_bytes": r["programs"],
                     "parameter_bytes_per_device": r["parameter_bytes_per_device"]})
        raw.append(r)
        print(rows[-1], flush=True)
    if json_path:
        write(json_path, "plans_v4_depth", rows, raw, repeats=1)


if __name__ == "__main__":
    main()
