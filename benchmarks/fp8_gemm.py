"""FP8 block-scaled GEMM (W8A8) against the on-the-fly W8A16 path, side by side in one run.

For each shape [M, K] x [N, K]^T, the median time (compile excluded) of
1. `fp8_block_matmul` on activations already quantized,
2. `act_quant` + `fp8_block_matmul` from bf16 activations,
3. the weight dequantized to bf16 (`jaxmtp.quant.dequantize`) + a bf16 `jnp.dot`,
as TFLOPS (2 M N K / time) and the speedup of 1 and 2 over 3, and the largest error of the
kernel's float32 output relative to the jnp reference (so that one run on new hardware also checks
the compiled kernels). "deepgemm" is DeepGEMM's
DeepSeek-V3 table; "small" is for CPU, where the kernels run in Pallas interpret mode (slow, and
the figures say nothing about accelerator speed), and is the default there.

    python benchmarks/fp8_gemm.py [--shapes small|deepgemm] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
from timing import median_seconds

from jaxmtp.quant import dequantize
from pallas_kernels import act_quant, backend, fp8_block_matmul, fp8_block_matmul_reference

SHAPES = {
    "deepgemm": [(m, n, k) for m in (64, 128, 4096) for n, k in ((2112, 7168), (7168, 16384), (4096, 7168))],
    "small": [(m, n, k) for m in (16, 64) for n, k in ((576, 512), (256, 1024))],
}


def inputs(m, n, k, seed=0):
    """bf16 activations [M, K]; their quantization; an e4m3fn weight [N, K] with block scales."""
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.uniform(kw, (n, k), minval=-448.0, maxval=448.0).astype(jnp.float8_e4m3fn)
    ws = jax.random.uniform(ks, (-(-n // 128), -(-k // 128)), minval=1e-3, maxval=1e-2)
    return x, *act_quant(x), w, ws


def measure(m, n, k, repeats):
    """One row of the table: seconds and TFLOPS of the three variants."""
    x, xq, xs, w, ws = inputs(m, n, k)
    variants = {
        "w8a8": (jax.jit(fp8_block_matmul), (xq, xs, w, ws)),
        "quant+w8a8": (jax.jit(lambda x, w, ws: fp8_block_matmul(*act_quant(x), w, ws)), (x, w, ws)),
        "w8a16": (jax.jit(lambda x, w, ws: x @ dequantize(w, ws).astype(jnp.bfloat16).T), (x, w, ws)),
    }
    row = {"m": m, "n": n, "k": k}
    for name, (fn, args) in variants.items():
        row[name + "_s"] = median_seconds(fn, args, repeats)
        row[name + "_tflops"] = 2 * m * n * k / row[name + "_s"] / 1e12
    got = fp8_block_matmul(xq, xs, w, ws, out_dtype=jnp.float32)
    want = fp8_block_matmul_reference(xq, xs, w, ws, jnp.float32)
    row["max_relative_error"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    row["speedup"] = row["w8a16_s"] / row["w8a8_s"]
    row["speedup_with_quant"] = row["w8a16_s"] / row["quant+w8a8_s"]
    return row


def print_table(rows):
    print(f"{'':>20} | {'TFLOPS':^29} | {'speedup over W8A16':^20} |")
    print(f"{'M':>6} {'N':>6} {'K':>6} | {'W8A8':>8} {'quant+W8A8':>10} {'W8A16':>9} | {'W8A8':>8} {'quant+W8A8':>11} "
          f"| rel. error")
    for r in rows:
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {r['w8a8_tflops']:>8.3f} {r['quant+w8a8_tflops']:>10.3f} "
              f"{r['w8a16_tflops']:>9.3f} | {r['speedup']:>7.2f}x {r['speedup_with_quant']:>10.2f}x "
              f"| {r['max_relative_error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), help="default: small on CPU, deepgemm elsewhere")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the rows and the backend as JSON")
    args = parser.parse_args()
    target = backend()
    shapes = args.shapes or ("small" if target.platform == "cpu" else "deepgemm")
    print(f"device: {jax.devices()[0].device_kind}; kernels: {target}; shapes: {shapes}")
    if target.interpret:
        print("Pallas interpret mode: these figures measure the emulation, not the kernels.")
    rows = [measure(m, n, k, args.repeats) for m, n, k in SHAPES[shapes]]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "backend": dataclasses.asdict(target), "shapes": shapes,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
