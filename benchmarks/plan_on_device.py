"""`jaxmtp plan`'s prediction against what a real device holds: the widths of a config with fewer
layers, random FP8 weights made on the device, speculative generation run once, and the device's
peak memory (`memory_stats()["peak_bytes_in_use"]`) beside XLA's memory analysis of the same
program compiled for that device. Run it on the accelerator (benchmarks/accelerator.sh, step
plan_device, which also prints the CPU's prediction with JAX_PLATFORMS=cpu --plan-only); on a CPU
it checks that the script runs (CPUs report no memory stats).

    python benchmarks/plan_on_device.py [--config deepseek_v3_671b] [--layers 4] [--batch 1]
        [--max-len 4096] [--prompt-len 256] [--k 3] [--matmul fp8] [--plan-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxmtp
from jaxmtp.params import abstract_params
from jaxmtp.plan import plan, total_bytes
from jaxmtp.quant import QuantizedWeight, default_matmul


def random_parameters(config, dtype=jnp.bfloat16, seed=0):
    """Random parameters in the shapes of `config` (FP8 weights kept where it is quantized), each
    drawn on the default device, so that a model larger than the host's memory can be made."""
    shapes = abstract_params(config, dtype, keep_fp8=config.quantization is not None)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def one(key, leaf):
        if isinstance(leaf, QuantizedWeight):
            draw = jax.jit(lambda k: jax.random.normal(k, leaf.value.shape, jnp.bfloat16).astype(jnp.float8_e4m3fn))
            value = draw(key)
            scale = jnp.full(leaf.scale.shape, 0.02, jnp.float32)
            return leaf.replace(value=value, scale=scale)
        return jax.jit(lambda k: (0.02 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))(key)

    return jax.tree.unflatten(tree, [one(k, leaf) for k, leaf in zip(keys, leaves)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deepseek_v3_671b")
    parser.add_argument("--layers", type=int, default=4, help="main layers (the config's first dense ones first)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--matmul", choices=("fp8", "dequant"), help="how FP8 weights are multiplied; default: "
                        "the platform's (jaxmtp.quant.default_matmul)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plan-only", action="store_true",
                        help="only XLA's analysis on this platform (JAX_PLATFORMS=cpu: the CPU's prediction)")
    args = parser.parse_args()

    path = os.path.join(jaxmtp.CONFIGS, args.config + ".json") if os.sep not in args.config else args.config
    config = jaxmtp.ModelConfig.from_hf_config(path).replace(num_hidden_layers=args.layers)
    matmul = args.matmul or default_matmul()
    device = jax.devices()[0]
    predicted = plan(config, 1, 1, 1, args.batch, args.max_len, args.prompt_len, args.k, matmul=matmul)
    if args.plan_only:
        print(json.dumps({"device": str(device), "predicted_total_bytes": total_bytes(predicted),
                          "predicted_temp_bytes": predicted["xla_temp_bytes"]}))
        return
    model = jaxmtp.Model(config, random_parameters(config))
    if config.quantization is not None:
        model = model.with_matmul(matmul)
    stats = device.memory_stats() or {}
    before = stats.get("bytes_in_use")
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.prompt_len)).tolist()
    new_tokens = max(1, min(16, args.max_len - args.prompt_len - args.k - 1))
    out = jaxmtp.generate(model, prompts, max_new_tokens=new_tokens, speculative_k=args.k)
    stats = device.memory_stats() or {}
    figures = {"device": str(device), "config": args.config, "layers": args.layers, "batch": args.batch,
               "cache_len": predicted["cache_len"], "prompt_len": args.prompt_len, "k": args.k, "matmul": matmul,
               "predicted_total_bytes": total_bytes(predicted), "predicted_temp_bytes": predicted["xla_temp_bytes"],
               "parameter_bytes": predicted["parameter_bytes_per_device"], "bytes_in_use_before": before,
               "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "new_tokens": sum(len(t) for t in out.tokens),
               "jax": jax.__version__}
    print(json.dumps(figures, indent=1))
    if figures["peak_bytes_in_use"]:
        print(f"peak on {device}: {figures['peak_bytes_in_use'] / 1e9:.2f} GB; XLA's analysis of the program: "
              f"{figures['predicted_total_bytes'] / 1e9:.2f} GB "
              f"({figures['peak_bytes_in_use'] / figures['predicted_total_bytes']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
