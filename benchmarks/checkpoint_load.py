"""Checkpoint loading: peak host memory and throughput on a generated multi-file checkpoint.

Writes a random mid-size DeepSeek-V3-architecture model (~2 GB in bf16) as HF-layout safetensors in
several files and as orbax, then loads each in a fresh process and prints peak RSS against the bound
(final parameter bytes + largest file + 500 MB), MB/s, and orbax vs safetensors restore time.

    python benchmarks/checkpoint_load.py [--dir /tmp/jaxmtp_ckpt_bench] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
    "moe_intermediate_size": 512, "num_hidden_layers": 16, "first_k_dense_replace": 1, "num_attention_heads": 16,
    "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
}


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process; unlike ru_maxrss, VmHWM starts afresh at exec."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def measure(path: str) -> None:
    """Child process: load `path` once, print a JSON line of figures."""
    import jax

    import jaxmtp

    baseline = _status_mb("VmRSS")
    start = time.perf_counter()
    model = jaxmtp.load(path, quiet=True)
    jax.block_until_ready(model.params)
    seconds = time.perf_counter() - start
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    peak = _status_mb("VmHWM")
    print(json.dumps({"seconds": seconds, "param_mb": param_bytes / 2**20, "peak_mb": peak, "baseline_mb": baseline}))


def generate(directory: str) -> None:
    import jaxmtp

    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(CONFIG), seed=0, dtype="bfloat16")
    jaxmtp.save(model, os.path.join(directory, "hf"), format="hf", max_shard_bytes=300 << 20)
    jaxmtp.save(model, os.path.join(directory, "orbax"), format="orbax")


def _run_child(path: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/jaxmtp_ckpt_bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure)
    hf_dir = os.path.join(args.dir, "hf")
    if not os.path.exists(hf_dir):
        generate(args.dir)
    files = [os.path.join(hf_dir, f) for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    total_mb = sum(os.path.getsize(f) for f in files) / 2**20
    largest_mb = max(os.path.getsize(f) for f in files) / 2**20
    print(f"checkpoint: {hf_dir}, {len(files)} files, {total_mb:.0f} MB, largest file {largest_mb:.0f} MB")
    runs = {fmt: [_run_child(os.path.join(args.dir, fmt)) for _ in range(args.repeats)] for fmt in ("hf", "orbax")}
    for fmt, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = max(r["peak_mb"] for r in results)
        param_mb = results[0]["param_mb"]
        print(f"{fmt:6s} load: median {seconds:.2f} s over {len(results)} runs, {total_mb / seconds:.0f} MB/s; "
              f"params {param_mb:.0f} MB, peak RSS {peak:.0f} MB (process baseline before load "
              f"{results[0]['baseline_mb']:.0f} MB)")
        if fmt == "hf":
            bound = param_mb + largest_mb + 500
            print(f"       bound params + largest file + 500 MB = {bound:.0f} MB: "
                  f"{'within' if peak < bound else 'EXCEEDED'} ({bound - peak:+.0f} MB margin)")
    ratio = statistics.median(r["seconds"] for r in runs["orbax"]) / statistics.median(r["seconds"] for r in runs["hf"])
    print(f"orbax restore time / safetensors load time: {ratio:.2f}")


if __name__ == "__main__":
    main()
